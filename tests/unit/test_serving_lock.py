"""The serving lock lives in the shared $TMPDIR: another local user must not be able to turn it
against the server (server/_workers.py). A link planted at the lock's path is refused, not
followed; the directory must be this user's own, and is made 0700.

Here the lock alone; a server process refusing to start: tests/system/test_serving_lock.py.
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from trio_mlx.server import _workers
from trio_mlx.server._settings import Settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tmpdir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shared = tmp_path / "tmp"
    shared.mkdir(mode=0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared


def test_a_link_at_the_lock_path_is_refused_and_its_target_untouched(tmpdir_env: Path, tmp_path: Path) -> None:
    settings = Settings(model=str(tmp_path))
    path = _workers.lock_path(settings)
    path.parent.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path.symlink_to(victim)
    with pytest.raises(_workers.UnsafeLockError, match="link"):
        _workers.acquire(settings)
    assert victim.read_text() == "precious"


def test_the_directory_must_be_this_users_and_is_made_private(tmpdir_env: Path, tmp_path: Path) -> None:
    settings = Settings(model=str(tmp_path))
    path = _workers.lock_path(settings)
    path.parent.mkdir(mode=0o777)
    os.chmod(path.parent, 0o777)
    lock = _workers.acquire(settings)
    try:
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        lock.release()
    other = 65534 if os.getuid() != 65534 else 65533
    if os.getuid() == 0:  # only root can give a directory away; the check is the same for anyone
        os.chown(path.parent, other, other)
        with pytest.raises(_workers.UnsafeLockError, match=f"belongs to uid {other}"):
            _workers.acquire(settings)
    # a directory replaced by a link to another one is refused too
    os.rename(path.parent, tmpdir_env / "elsewhere")
    path.parent.symlink_to(tmpdir_env / "elsewhere")
    with pytest.raises(_workers.UnsafeLockError, match="not a directory"):
        _workers.acquire(settings)


class _Exited(Exception):
    pass


def test_a_refused_worker_kills_its_supervisor_before_it_stops_the_lock_holder(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Under hypercorn's supervisor (server/_exit.py): a worker stopped while its supervisor still
    ran (the refused worker preempted between its two signals, on a loaded machine) let the
    supervisor see that worker's exit and return 0, the refusal's status lost."""
    from trio_mlx.server import _exit

    supervisor, holder = os.getppid(), 2**22 + 17
    sent: list[tuple[int, int]] = []

    def gone(status: int) -> None:
        raise _Exited(status)

    monkeypatch.setattr(_exit.multiprocessing, "parent_process", lambda: type("P", (), {"pid": supervisor})())
    monkeypatch.setattr(_exit.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    monkeypatch.setattr(_exit.os, "_exit", gone)
    with pytest.raises(_Exited) as exited:
        _exit.exit_if_unseen(_exit.ServerInfo("hypercorn.trio.lifespan"), "refused",
                             lock_holder=(holder, supervisor))
    assert exited.value.args == (_exit.STARTUP_FAILURE,)
    assert sent == [(supervisor, signal.SIGKILL), (holder, signal.SIGTERM)]
    assert capsys.readouterr().err == "error: refused\n"
