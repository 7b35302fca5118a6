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


async def ask(engine: trio_mlx.Engine, i: int, answers: dict[int, str]) -> None:
    text = []
    async with engine.chat([{"role": "user", "content": QUESTIONS[i]}], max_tokens=48, temperature=0) as events:
        async for event in events:
            if isinstance(event, trio_mlx.TextDelta):
                text.append(event.text)
            else:
                answers[i] = f"{''.join(text).strip()!r} ({event.finish_reason})"


async def main(model: str | None) -> None:
    async with trio_mlx.open_engine(model) as engine:
        answers: dict[int, str] = {}
        async with trio.open_nursery() as nursery:
            for i in range(len(QUESTIONS)):
                if i == 4:
                    # This one gives up after 50 ms: leaving its cancel scope
                    # aborts its sequence on the actor.
                    async def impatient(i: int = i) -> None:
                        with trio.move_on_after(0.05):
                            await ask(engine, i, answers)
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
