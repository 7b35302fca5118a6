"""`trio-mlx bench`: the load generator (HTTP, in-process engine, raw ceiling), its figures,
tables and plots. It drives servers over HTTP and the engine through the public channel API;
the ceiling is `trio_mlx.actor.ceiling`."""
