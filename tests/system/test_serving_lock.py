"""The serving lock lives in the shared $TMPDIR: another local user must not be able to turn it
against the server (server/_workers.py). A link planted at the lock's path is refused, not
followed; the directory must be this user's own, and is made 0700.

Here a server process; the lock alone: tests/unit/test_serving_lock.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio
from processes import ENV, SERVE

pytestmark = pytest.mark.timeout(60)


async def test_a_server_refuses_to_start_on_a_planted_link(tmp_path: Path, tiny_model_fp32: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    env = {**ENV, "TMPDIR": str(shared)}
    victim = tmp_path / "victim"
    victim.write_text("precious")
    digest_dir = shared / f"trio_mlx-{os.getuid()}"
    digest_dir.mkdir(mode=0o700)
    # the lock's name for this model, worked out as the server will
    probe = await trio.run_process(
        [sys.executable, "-c", "import sys; from trio_mlx.server import _workers; from trio_mlx.server._settings "
         "import Settings; print(_workers.lock_path(Settings(model=sys.argv[1])).name)", str(tiny_model_fp32)],
        capture_stdout=True, env=env)
    (digest_dir / probe.stdout.decode().strip()).symlink_to(victim)
    proc = await trio.run_process([*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup"],
                                  capture_stderr=True, check=False, env=env)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "a link there is refused" in err, err
    assert victim.read_text() == "precious"
