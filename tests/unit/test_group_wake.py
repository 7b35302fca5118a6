"""An idle follower's wake socket (actor/_wake.py), without MLX: rank 0 listens where the launcher
placed it, keeps only the connections that send its greeting's secret, and wakes each follower
with one byte per message after a heartbeat; a follower's wait ends at the byte, and a closed or
silent socket is a group failure, bounded as the collective's wait is."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from trio_mlx.actor._group import GroupError
from trio_mlx.actor._wake import WakeClient, WakeServer, leader_host


def test_rank_0s_address_comes_from_the_launchers_variables(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    for key in ("MLX_HOSTFILE", "MLX_JACCL_COORDINATOR"):
        monkeypatch.delenv(key, raising=False)
    assert leader_host() is None and WakeServer.open() is None  # no address: the collective, as before
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["10.0.0.2:5001"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    assert leader_host() == "127.0.0.1"
    hosts.write_text("")  # mlx.launch writes "" for one rank
    assert leader_host() is None
    monkeypatch.delenv("MLX_HOSTFILE")
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:32323")
    assert leader_host() == "10.0.0.1"


def test_a_follower_is_woken_once_per_byte_and_a_stranger_is_not_kept() -> None:
    server = WakeServer("127.0.0.1")
    host, port, secret = server.address
    stranger = socket.create_connection((host, port))
    stranger.sendall(b"x" * len(secret))
    follower = WakeClient.connect(server.address, 5.0)
    assert follower is not None
    server.accept(1, 5.0)
    assert stranger.recv(1) == b""  # closed by rank 0
    server.wake()
    server.wake()
    follower.wait(1.0)
    follower.wait(1.0)  # two wakes, two waits: the sides count alike
    with pytest.raises(GroupError, match="sent nothing for 0.2 s"):
        follower.wait(0.2)
    woke = threading.Event()

    def wait() -> None:
        follower.wait(5.0)
        woke.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    assert not woke.is_set()  # blocked until rank 0 writes
    server.wake()
    waiter.join(5.0)
    assert woke.is_set()
    server.close()
    with pytest.raises(GroupError, match="closed the connection"):
        follower.wait(1.0)
    follower.close()
    stranger.close()


def test_rank_0_that_cannot_be_reached_leaves_the_follower_to_the_collective() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    assert WakeClient.connect(("127.0.0.1", port, b"s" * 16), 1.0) is None
    assert WakeClient.connect(None, 1.0) is None
    server = WakeServer("127.0.0.1")
    with pytest.raises(GroupError, match="only 0 of 1 followers"):
        server.accept(1, 0.2)
    server.close()
