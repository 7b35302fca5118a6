"""Keep the open-file limit: importing mlx-lm would lower it.

`mlx_lm.utils` runs `resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))` when it is
imported (meant to raise macOS's 256 for models of many files). Where the limit
was higher it lowers both the soft and the *hard* limit, and a process that is
not root can never raise its hard limit again: a server then runs out of file
descriptors at ~2,000 connections. So the first import of `mlx_lm.utils` runs
with a `setrlimit` that applies the open-file limit only where it raises the
soft limit, never lowering either. `install()` (from `trio_mlx/__init__.py`,
before anything imports mlx-lm) puts the import hook in place; it imports
nothing itself. `raise_soft_limit()` (the server's start) lifts the soft limit
to the hard one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

_MODULE = "mlx_lm.utils"


def _keep_nofile(real: Any) -> Any:
    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            return real(which, limits)
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if wanted > soft:
            real(which, (wanted, hard))
        return None

    return setrlimit


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != _MODULE:
            return None
        _remove()
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real = resource.setrlimit
            resource.setrlimit = _keep_nofile(real)
            try:
                run(module)
            finally:
                resource.setrlimit = real

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def install() -> None:
    if resource is None or _MODULE in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())
