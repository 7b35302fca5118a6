"""The test suite's interpreters skip transformers' scan of its own source tree, once it is made.

Every interpreter that imports transformers (5.x) has it read all ~3,300 files under
`transformers/models/` to build its lazy import table (`define_import_structure`): ~1.1 of
the ~2 CPU-s such a start costs on the 2-core CI box. The suite starts over a hundred of them
(servers, actor processes, ranks, workers, examples), so this module, imported at start by
every one (`sitecustomize.py` beside it; tests/conftest.py puts this folder on PYTHONPATH),
keeps that table on disk: the first interpreter builds it as transformers always does and
writes it; the others read it back. The key is the scanned folder's path and modification
time and transformers' version, so another install or an upgrade never reads a stale table.
The table is a pure function of those files; everything else about the import is untouched.
Any failure here leaves transformers' own function in place. Users' processes never load this.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

_MODULE = "transformers.utils.import_utils"
_DIR = Path(os.environ.get("TRIO_MLX_TEST_IMPORT_CACHE") or Path(tempfile.gettempdir()) / f"trio-mlx-tests-{os.getuid()}")


def _cached(real: Any, version: str) -> Any:
    @functools.lru_cache  # as transformers' own: one table per key within a process
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        try:
            stamp = os.stat(module_path).st_mtime_ns
            key = hashlib.sha256(f"{version}|{Path(module_path).resolve()}|{stamp}|{prefix}".encode()).hexdigest()[:32]
            path = _DIR / f"transformers-structure-{key}.pickle"
            if path.exists():
                with open(path, "rb") as f:
                    return pickle.load(f)
        except Exception:
            return real(module_path, prefix)
        table = real(module_path, prefix)
        try:  # written before transformers adds to the table it returns
            _DIR.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(table, f)
            os.replace(tmp, path)
        except Exception:
            pass
        return table

    return define_import_structure


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers' import_utils as the path finder does, and wraps its
    `define_import_structure` once the module has run, before transformers calls it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            real = getattr(module, "define_import_structure", None)
            if callable(real):
                version = str(getattr(sys.modules.get("transformers"), "__version__", ""))
                if not version:
                    try:
                        from importlib.metadata import version as dist_version

                        version = dist_version("transformers")
                    except Exception:
                        return
                module.define_import_structure = _cached(real, version)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
