"""Many concurrent streams share one continuous batch; one of them is cancelled.

The cancelled request's sequence is removed from the batch before the next
decode step, and everything else finishes normally.

    python examples/concurrent_streams.py [MODEL]
"""

import sys

import trio

import trio_mlx

QUESTIONS = [
    "Name a primary colour.",
    "What is 2 + 2?",
    "Say hello in French.",
    "What is the largest planet?",
    "Write a haiku about the sea.",
    "What do bees make?",
    "Name a fruit that is yellow.",
    "What is the opposite of hot?",
]


async def ask(engine: trio_mlx.Engine, i: int, answers: dict[int, str],
              give_up: trio.CancelScope | None = None) -> None:
    text = []
    async with engine.chat([{"role": "user", "content": QUESTIONS[i]}], max_tokens=48, temperature=0) as events:
        async for event in events:
            if isinstance(event, trio_mlx.TextDelta):
                text.append(event.text)
                if give_up is not None and len(text) == 3:
                    give_up.cancel()  # seen enough: leaving the stream aborts its sequence
            else:
                answers[i] = f"{''.join(text).strip()!r} ({event.finish_reason})"


async def main(model: str | None) -> None:
    async with trio_mlx.open_engine(model) as engine:
        answers: dict[int, str] = {}
        async with trio.open_nursery() as nursery:
            for i in range(len(QUESTIONS)):
                if i == 4:
                    # This one gives up after its first three pieces of text:
                    # cancelling its scope aborts its sequence on the actor.
                    # (A deadline, `trio.move_on_after(seconds)`, works alike.)
                    async def impatient(i: int = i) -> None:
                        with trio.CancelScope() as scope:
                            await ask(engine, i, answers, give_up=scope)
                        answers.setdefault(i, "(cancelled by the client)")

                    nursery.start_soon(impatient)
                else:
                    nursery.start_soon(ask, engine, i, answers)
        for i, question in enumerate(QUESTIONS):
            print(f"{question}\n  -> {answers[i]}")
        stats = engine.statistics()
        print(f"\n{stats.requests_finished} requests, {stats.aborts} aborted, "
              f"{stats.generated_tokens} tokens in {stats.decode_steps} decode steps")


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
