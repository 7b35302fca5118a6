"""The HTTP layer: the ASGI app, its endpoints, the OpenAI wire format, OpenAPI, metrics,
settings, `trio-mlx serve`, the one-server-per-device guard and access logs.

It talks to the runtime only through `trio_mlx.engine`; it never reaches into the actor.
"""
