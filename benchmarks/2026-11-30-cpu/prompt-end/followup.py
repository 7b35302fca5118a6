"""A lone agent's follow-ups: 6 chats of a ~300-token system prompt, 3 turns each, greedy, 6 tokens
a turn; the time to first token of turns 2 and 3 (prompt-cache hits, ~12 new tokens each). Run it
from outside the tree with PYTHONPATH naming the tree: trio_mlx is installed editable, and a
script's own folder comes first on the path.

    PYTHONPATH=TREE python followup.py [MODEL_DIR]
"""
import statistics
import sys
import time

import trio

import trio_mlx

M = sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/trio_mlx/smollm2-135m-instruct-4adb38cb8072"  # the embedded model's MLX dir
SYSTEM = " ".join(["You are a careful assistant that answers briefly."] * 30)
async def main():
    async with trio_mlx.open_engine(M) as engine:
        ttfts = []
        for conv in range(6):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {conv}: name a color."}]
            for turn in range(3):
                t0, first, text = time.perf_counter(), None, ""
                async with engine.chat(msgs, max_tokens=6, temperature=0) as s:
                    async for ev in s:
                        if isinstance(ev, trio_mlx.TextDelta):
                            if first is None:
                                first = time.perf_counter() - t0
                            text += ev.text
                if turn > 0:
                    ttfts.append(first * 1e3)
                msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And another one, {turn}?"}]
        print(f"follow-up TTFT p50 {statistics.median(ttfts):.1f} ms (n={len(ttfts)})", [round(t) for t in ttfts])


trio.run(main)
