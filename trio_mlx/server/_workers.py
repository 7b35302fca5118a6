"""One serving process per model and device: the guard against several server workers.

Every hypercorn, uvicorn or granian worker is a process that runs the whole app,
lifespan included: with `hypercorn -w 2` each would load its own copy of the model onto
the same device (twice the memory, two GPU actors contending for one GPU).
So before the engine starts, the app takes an advisory lock (`flock`) named
after the model, the device and the server's replica name (`--replica`,
empty by default). A second process serving the same model on the same
device under the same name finds it held and stops at startup with a message
saying why, unless `allow_multiple_workers` (TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1)
is set. Replicas behind a router are several servers meant to share a device
(a Mac, the CPU): each gets a name of its own, and holds a lock of its own. The kernel drops the lock when its process dies, SIGKILL included, so a
restarted server is never blocked by a dead one. Several apps in one process
(tests) share the lock: they are one process.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .._errors import TrioMLXError
from ._settings import DEFAULT_MODEL_NAME, Settings

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows, where MLX does not run anyway
    fcntl = None  # type: ignore[assignment]


class AlreadyServing(TrioMLXError):
    """Another process already serves this model on this device."""

    def __init__(self, message: str, holder: int = 0, holder_parent: int = 0):
        super().__init__(message)
        self.holder = holder  # its pid, and its parent's (a sibling worker shares ours); 0: unknown
        self.holder_parent = holder_parent


@dataclass
class _Held:
    fd: int
    users: int


# Locks this process holds, by path: a second app in the same process shares the first's.
_held: dict[str, _Held] = {}


def model_key(settings: Settings) -> str:
    """What identifies "the same model on the same device" across processes."""
    model = settings.model
    if settings.models:  # a server of several models: the lot, as named
        what = "models:" + ",".join(f"{n}={r}" for n, r in settings.model_table.items())
    elif not model or model in ("default", DEFAULT_MODEL_NAME):
        cache = (settings.cache_dir or os.environ.get("TRIO_MLX_CACHE_DIR")
                 or os.environ.get("XDG_CACHE_HOME") or "~/.cache")
        what = "default:" + os.path.realpath(os.path.expanduser(cache))
    elif os.path.exists(os.path.expanduser(model)):
        what = "path:" + os.path.realpath(os.path.expanduser(model))
    else:
        what = "hub:" + model
    # The device: MLX has one GPU per process; CUDA picks it from CUDA_VISIBLE_DEVICES.
    key = [what, os.environ.get("CUDA_VISIBLE_DEVICES", "")]
    if settings.replica:  # one of several replicas meant to share the device
        key.append(settings.replica)
    return json.dumps(key)


def lock_path(settings: Settings) -> Path:
    digest = hashlib.sha256(model_key(settings).encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"trio_mlx-{uid}" / f"serving-{digest}.lock"


class ServingLock:
    """Held while this process serves the model; `release()` when it stops serving."""

    def __init__(self, path: Path | None):
        self.path = path
        self._released = False

    def release(self) -> None:
        if self._released or self.path is None:
            return
        self._released = True
        key = str(self.path)
        held = _held[key]
        held.users -= 1
        if held.users == 0:
            del _held[key]
            os.ftruncate(held.fd, 0)  # no pid left behind for the next refused process to read
            os.close(held.fd)  # drops the flock


def acquire(settings: Settings) -> ServingLock:
    """Take the model's serving lock, or raise AlreadyServing naming the process that holds it."""
    if fcntl is None:
        return ServingLock(None)
    path = lock_path(settings)
    key = str(path)
    if (held := _held.get(key)) is not None:
        held.users += 1
        return ServingLock(path)
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, parent = _holder(fd)
        os.close(fd)
        model = settings.model or DEFAULT_MODEL_NAME
        named = f" as replica {settings.replica!r}" if settings.replica else ""
        raise AlreadyServing(
            f"another trio_mlx server process (pid {pid or '?'}) already serves {model!r} on this "
            f"device{named}; several server workers would each load the model onto it. Run one worker "
            "(hypercorn, uvicorn and granian: -w 1 / --workers 1; trio-mlx serve always does); for "
            "replicas behind a router give each server its own --replica NAME (TRIO_MLX_REPLICA); or "
            "set TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1 to let each process load its own copy",
            pid, parent,
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    # "pid parent-pid": a refused sibling worker (same parent) stops this one (see _exit.py).
    os.pwrite(fd, f"{os.getpid()} {os.getppid()}".encode(), 0)
    _held[key] = _Held(fd, 1)
    return ServingLock(path)


class UnsafeLockError(TrioMLXError):
    """The lock's directory or file is not this user's own (another user could plant a link)."""


def _open_lock(path: Path) -> int:
    """Open (creating) the lock file safely: `$TMPDIR` is shared with every local user, so the
    directory must be a real directory of this user's, mode 0700 (made so if it is looser), and
    the lock a regular file of this user's, opened without following a link: a link planted at
    the lock's path would otherwise have the server write its pid into the link's target."""
    uid = os.getuid()
    try:
        os.mkdir(path.parent, 0o700)
    except FileExistsError:
        pass
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow)
    except OSError as exc:
        raise UnsafeLockError(f"the serving lock's directory {str(path.parent)!r} is not a directory "
                              f"of this user's ({exc.strerror}); remove it") from None
    try:
        st = os.fstat(dfd)
        if st.st_uid != uid:
            raise UnsafeLockError(f"the serving lock's directory {str(path.parent)!r} belongs to uid "
                                  f"{st.st_uid}, not to this user ({uid}); remove it")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(dfd, 0o700)
        try:
            fd = os.open(path.name, os.O_RDWR | os.O_CREAT | nofollow, 0o600, dir_fd=dfd)
        except OSError as exc:
            raise UnsafeLockError(f"could not open the serving lock {str(path)!r} ({exc.strerror}): "
                                  "a link there is refused; remove it") from None
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
        os.close(fd)
        raise UnsafeLockError(f"the serving lock {str(path)!r} is not a file of this user's; remove it")
    return fd


def _holder(fd: int) -> tuple[int, int]:
    """The lock holder's pid and its parent's, as it wrote them just after taking the lock: read
    until they name a live process (not yet written, or a killed holder's), for at most 1 s."""
    deadline = time.monotonic() + 1.0
    while True:
        pid, _, parent = os.pread(fd, 64, 0).decode(errors="replace").strip().partition(" ")
        if (pid.isdigit() and _alive(int(pid))) or time.monotonic() > deadline:
            return (int(pid) if pid.isdigit() else 0), (int(parent) if parent.isdigit() else 0)
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's: alive
    return True
