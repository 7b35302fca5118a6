"""`trio-mlx bench compare`'s plan: the rounds' alternating order and the server commands'
placeholders. tests/system/test_bench_compare.py runs it against servers in processes of their own."""

from __future__ import annotations

from pathlib import Path

from trio_mlx.bench._compare import Side, order, server_command


def test_rounds_alternate_the_order_and_commands_take_their_placeholders_and_environment(tmp_path: Path):
    a, b, c = Side("a", ""), Side("b", ""), Side("c", "")
    assert [(r, s.name) for r, s in order([a, b, c], 3)] == [
        (1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"), (3, "a"), (3, "b"), (3, "c")]
    env, argv = server_command("X=1 Y='two words' serve --port {port} --trace {out}/t-{run}.tsv",
                               8123, tmp_path, "a-2")
    assert env == {"X": "1", "Y": "two words"}
    assert argv == ["serve", "--port", "8123", "--trace", f"{tmp_path}/t-a-2.tsv"]
