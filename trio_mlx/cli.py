"""The `trio-mlx` command: a thin dispatcher to the subcommands.

Each subcommand's module owns its own argument parser and exposes
`main(argv) -> int`; this file only routes, so importing it is cheap and a
subcommand's heavy imports (MLX, hypercorn) happen only when it runs.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("trio_mlx.server._serve", "run the OpenAI-compatible HTTP server (hypercorn, trio worker)"),
    "bench": ("trio_mlx.bench._cli", "load-test an OpenAI-compatible endpoint, or the raw BatchGenerator ceiling"),
    "model": ("trio_mlx.models._cli", "prepare models: convert the embedded default, build test models"),
}


def _usage() -> str:
    lines = ["usage: trio-mlx <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `trio-mlx <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"trio-mlx: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
