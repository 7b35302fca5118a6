"""`trio-mlx bench chat`: multi-turn conversations against a real server, measured per turn.

Here the conversations' shapes and the plot; against a server: tests/integration/test_bench_chat.py.
"""

from __future__ import annotations

import json

from trio_mlx.bench import _chat


def test_conversations_share_the_system_prompt_and_each_has_its_own_turns():
    convs = _chat.make_conversations(3, 4, system_words=50, user_words=10, seed=1)
    assert len({c.system for c in convs}) == 1 and len(convs[0].system.split()) == 50 + 5
    users = [u for c in convs for u in c.users]
    assert len(set(users)) == 12 and all(len(u.split()) == 10 for u in users)
    again = _chat.make_conversations(3, 4, system_words=50, user_words=10, seed=1)
    assert [c.users for c in again] == [c.users for c in convs]  # the same seed, the same load


def test_the_plot_draws_every_run(tmp_path):
    def run(label: str, ms: float) -> dict:
        turns = [{"turn": t, "ttft_ms": {"p50": ms * (i + 1), "p90": None, "mean": None}}
                 for i, t in enumerate([1, 2, "fresh"])]
        return {"label": label, "levels": [{"conversations": n, "turns": turns} for n in (1, 8)]}

    for i, res in enumerate([run("cache on", 10.0), run("cache off", 50.0)]):
        (tmp_path / f"{i}.json").write_text(json.dumps(res))
    out = tmp_path / "chat.png"
    assert _chat.main(["plot", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
