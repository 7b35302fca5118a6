"""`trio-mlx bench`: the load generator (HTTP, in-process engine, raw ceiling), its figures,
tables and plots.

It uses the runtime as any client would, through public names only: servers over HTTP, the
engine through the public channel API (`trio_mlx.open_engine`), model files through
`trio_mlx.models`, the raw ceiling it measures both against through `trio_mlx.actor.ceiling`,
and `trio_mlx.engine.freeze_heap`. `tests/unit/test_public_api.py` checks that it imports no
private module of the runtime."""
