"""`trio-mlx serve`: run the OpenAI-compatible server in this process (hypercorn, trio worker).

Every setting is a flag here and a TRIO_MLX_* variable (`_settings.py`);
flags win. Unlike plain `hypercorn -k trio trio_mlx.app:app`, this drains
on SIGTERM/SIGINT: readiness and new requests get 503 at once, in-flight
requests run for up to --drain-timeout seconds and are then ended with a
terminal event, and the process exits 0 (a second signal stops at once,
exit 1). A model that cannot load exits 1 with the reason on stderr; bad
settings exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from typing import Any

from ._settings import Settings, env_name, field_kind, parse_value, setting_fields

log = logging.getLogger("trio_mlx.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-mlx serve",
        description="Serve an MLX model over an OpenAI-compatible HTTP API (hypercorn, trio worker). "
        "With no model named, serves the embedded default (SmolLM2-135M-Instruct).",
    )
    parser.add_argument("model_arg", nargs="?", metavar="MODEL",
                        help="the model (same as --model): a local MLX directory or a Hugging Face id")
    defaults = Settings().flat()
    for f in setting_fields():
        flag = "--" + f.name.replace("_", "-")
        default = defaults[f.name]
        shown = "***" if f.metadata.get("secret") and default else default
        help_ = f"{f.metadata['doc']} [env {env_name(f.name)}; default: {shown}]"
        if field_kind(f) == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif field_kind(f) == "tuple":  # a list: the flag repeated, or commas, or both
            flags = [flag] + (["--" + f.metadata["flag"]] if "flag" in f.metadata else [])
            parser.add_argument(*flags, dest=f.name, default=None, action="append",
                                metavar=f.metadata.get("flag", f.name.split("_")[-1]).upper(), help=help_)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.split("_")[-1].upper(), help=help_)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for f in setting_fields():
        value = getattr(args, f.name)
        if value is None:
            continue
        try:
            if isinstance(value, list):  # a repeated flag (`build_parser`): its values joined
                overrides[f.name] = tuple(part for v in value for part in parse_value(f, v))
            else:
                overrides[f.name] = value if isinstance(value, bool) else parse_value(f, value)
        except ValueError as exc:
            raise ValueError(f"--{f.name.replace('_', '-')}: {exc}") from None
    if args.model_arg:
        overrides["model"] = args.model_arg
    return Settings.from_env(**overrides)


def describe_settings(settings: Settings) -> str:
    """The settings for the startup log: one per line, by flag name, secrets masked, and a `*`
    on each value that differs from its default."""
    defaults, values = Settings().flat(), settings.flat()
    public = settings.public()
    width = max(len(name) for name in public)
    lines = ["settings (* set by a flag or a TRIO_MLX_* variable; trio-mlx serve --help says what each does):"]
    for name, value in public.items():
        if value is None:
            shown = {"model": "- (models)" if settings.models else "(the embedded default)",
                     "model_name": "-" if settings.models else f"- (served as {settings.served_model_name})",
                     }.get(name, "-")
        elif isinstance(value, tuple):
            shown = ", ".join(value) or "-"
        else:
            shown = str(value)
        mark = "*" if values[name] != defaults[name] else " "
        lines.append(f"  {mark} {name.replace('_', '-'):<{width}}  {shown}")
    return "\n".join(lines)


def hypercorn_config(settings: Settings) -> Any:
    from hypercorn.config import Config

    from ._app import SHUTDOWN_MARGIN
    from ._logs import ACCESS_LOG_FORMAT, AccessLogger

    config = Config()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.worker_class = "trio"
    # Our drain ends every stream before hypercorn's graceful period starts; the margin
    # covers writing the terminal events. Hypercorn's 3 s default would cut streams.
    config.graceful_timeout = settings.drain_timeout + SHUTDOWN_MARGIN
    config.shutdown_timeout = settings.drain_timeout + 2 * SHUTDOWN_MARGIN
    config.startup_timeout = settings.startup_timeout
    config.backlog = settings.backlog
    config.accesslog = logging.getLogger("hypercorn.access") if settings.access_log else None
    # One line per request, ending with its X-Request-Id (see _logs.py for the duplicate it drops).
    config.logger_class = AccessLogger
    config.access_log_format = ACCESS_LOG_FORMAT
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


async def serve(app: Any, config: Any) -> bool:
    """Serve until SIGTERM/SIGINT, then drain. Returns False if a second signal cut the drain,
    or the engine broke for good (its actor died past the restart budget)."""
    import hypercorn.trio
    import trio

    stop = trio.Event()
    forced = False

    def fatal(reason: str) -> None:  # the engine is broken past its restart budget (_app.py)
        nonlocal forced
        log.critical("%s; stopping (exit 1)", reason)
        forced = True
        stop.set()

    app.on_fatal = fatal

    async def on_signals(signals: Any, cancel: trio.CancelScope) -> None:
        nonlocal forced
        async for signum in signals:
            if not stop.is_set():
                log.info("%s: draining, then stopping (signal again to stop now)", signal.Signals(signum).name)
                stop.set()
            else:
                log.warning("%s again: stopping now", signal.Signals(signum).name)
                forced = True
                cancel.cancel()

    async def shutdown_trigger() -> None:
        await stop.wait()
        await app.drain()

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signals, signals, nursery.cancel_scope)

            async def run_hypercorn(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await hypercorn.trio.serve(app, config, shutdown_trigger=shutdown_trigger,
                                               task_status=task_status)
                finally:
                    nursery.cancel_scope.cancel()

            # Started once the model is ready, or hypercorn's lifespan is over after a failed start
            # (hypercorn 0.18 binds and says "Running on" even then: `_HideRunningOn`).
            hide = _HideRunningOn(app)
            logging.getLogger("hypercorn.error").addFilter(hide)
            try:
                binds = await nursery.start(run_hypercorn)
                if binds and app.start_failure is None:
                    url = local_url(binds[0])
                    log.info("open %s/ in a browser for the chat page; the API's reference is at %s/docs",
                             url, url)
            finally:
                logging.getLogger("hypercorn.error").removeFilter(hide)
    if app.engine is not None and app.engine.state == "broken":
        # It failed for good without its actor returning (a distributed group that lost a
        # rank: `Engine.fail`): the process ends 1 whatever stopped the server, a launcher's
        # SIGTERM included, and whatever signal comes while it exits.
        forced = True
    _exit_on_sigterm(1 if forced else 0)
    return not forced


def _exit_on_sigterm(status: int) -> None:
    """From here the process is on its way out with `status`: the drain is over, and trio's
    signal handling with it, but its threads still join and its atexit handlers run (after a
    distributed group failed, for up to the watchdog's grace). A SIGTERM now, from a launcher
    or supervisor stopping what it believes still runs (mlx.launch once another rank failed),
    ended the process by the signal and hid the status; it exits with the status at once."""
    if threading.current_thread() is threading.main_thread():  # signal.signal's rule
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(status))


class _HideRunningOn(logging.Filter):
    """Drops hypercorn's "Running on http://..." once the app's start failed: hypercorn 0.18
    sets its lifespan's startup event even when the app reports `lifespan.startup.failed`,
    binds and says it runs, after the app said it could not start."""

    def __init__(self, app: Any):
        super().__init__()
        self._app = app

    def filter(self, record: logging.LogRecord) -> bool:
        return self._app.start_failure is None or not str(record.msg).startswith("Running on")


def local_url(bind: str) -> str:
    """A URL for `bind` (hypercorn's "http://HOST:PORT") that a browser on this machine can
    open: a wildcard address (0.0.0.0, [::]) is where the server listens, not one to ask
    (it answered 403: a foreign Host over loopback), so the loopback address instead."""
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    if host == "0.0.0.0":
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{scheme}://{host}:{port}"


def warn_if_open(settings: Settings) -> None:
    """A warning for a server bound beyond loopback without an API key: over another
    interface any Host is accepted (the DNS-rebinding guard holds over loopback only), so
    anyone who can reach the port can use it."""
    if settings.api_key or _loopback_host(settings.host):
        return
    log.warning("listening on %s without --api-key (TRIO_MLX_API_KEY): anyone who can reach this port "
                "can use the server; set an API key, or bind to 127.0.0.1", settings.host)


def _loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None, *, engine_factory: Any = None) -> int:
    """`trio-mlx serve`; `engine_factory` (tests: fault injection) builds the Engine from the settings."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"trio-mlx serve: {exc}", file=sys.stderr)
        return 2

    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("%s", describe_settings(settings))
    if settings.distributed:
        # Under mlx.launch: rank 0 goes on to serve HTTP; the other ranks follow its steps
        # and never start a server (docs/distributed.md).
        from ..engine import _distributed
        from ..engine._distributed import GroupError

        try:  # the rank alone, from the launcher's variables: no MLX on this thread
            rank, _, _ = _distributed.launched(settings.distributed_backend)
        except GroupError as exc:
            print(f"trio-mlx serve: {exc}", file=sys.stderr)
            return 2
        if rank != 0:
            _distributed.leave(_distributed.run_follower(
                settings.model, cache_dir=settings.cache_dir, backend=settings.distributed_backend,
                timeout=settings.distributed_timeout, startup_timeout=settings.startup_timeout))
        _distributed.leave(_serve_app(settings, engine_factory))
    return _serve_app(settings, engine_factory)


def _serve_app(settings: Settings, engine_factory: Any) -> int:
    """Serve HTTP until stopped; the process's exit status."""
    import trio
    from hypercorn.utils import LifespanFailureError, LifespanTimeoutError

    from ._app import create_app
    from ._connections import (
        capped_connections,
        connection_cap,
        quiet_accept_errors,
        raise_soft_limit,
    )

    app = create_app(settings, engine_factory=engine_factory)
    warn_if_open(settings)
    cap = connection_cap(settings.max_connections)
    quiet_accept_errors()
    log.info("at most %d open connections (open-file limit %d)", cap, raise_soft_limit()[0])
    try:
        with capped_connections(cap):
            clean = trio.run(serve, app, hypercorn_config(settings))
    except BaseException as exc:  # noqa: BLE001 - sorted below; the process ends here
        failure = _startup_failure(exc, (LifespanFailureError, LifespanTimeoutError))
        if failure is not None:
            print(f"trio-mlx serve: could not start: {failure}", file=sys.stderr)
            return 1
        if _only(exc, KeyboardInterrupt):
            return 130
        raise
    return 0 if clean else 1


def _startup_failure(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            if (found := _startup_failure(sub, kinds)) is not None:
                return found
    return None


def _only(exc: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(e, kind) for e in exc.exceptions)
    return isinstance(exc, kind)
