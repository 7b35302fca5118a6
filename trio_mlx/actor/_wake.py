"""An idle follower's wait outside MLX's collectives: rank 0 wakes it with a byte over TCP.

A follower receives rank 0's messages through the group (`_distributed.Channel`),
and MLX's ring backend waits for a collective's peer by polling its sockets: a
follower waiting in an `all_sum` for rank 0's next heartbeat kept ~40% of a core
busy for as long as the group was idle. So once rank 0 sends a heartbeat ("beat":
it has nothing to do), both sides know the follower's next wait may be long, and
the follower waits for it here instead, blocked in `recv` on a plain socket, and
queues its receive of the next message only once rank 0 wakes it: rank 0 writes
one byte to every follower's socket (`WakeServer.wake`) before the message that
follows a heartbeat, whichever it is (another heartbeat, a step, "stop"). One
byte per such message, read one at a time, keeps the two sides counting alike.

Rank 0 listens on the address the launcher gave it (the ring's hostfile, JACCL's
coordinator), on a port of the system's choosing, and names it in its greeting
with a secret the greeting alone carries; a follower connects and sends the
secret, and rank 0 keeps the connections that send it. The group then counts,
by one collective, the followers that connected, and rank 0 waits for that many.
A follower that could not connect (an address it cannot reach, a backend with no
address to read) waits in the collective as before: slower to idle, never wrong.
Every wait here is bounded as the collective's would be, and a socket closed or
silent past the bound fails the group (`GroupError`) as a lost rank does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import time

from ._group import GroupError

log = logging.getLogger("trio_mlx.distributed")

_SECRET_BYTES = 16


def leader_host() -> str | None:
    """The address rank 0 has in the launcher's description of the group, or None: the
    ring's hostfile (rank 0's first "ip:port") or JACCL's coordinator ("ip:port")."""
    env = os.environ
    try:
        if env.get("MLX_HOSTFILE"):
            with open(env["MLX_HOSTFILE"], encoding="utf-8") as f:
                text = f.read().strip()
            hosts = json.loads(text) if text else []
            return str(hosts[0][0]).rsplit(":", 1)[0] if hosts and hosts[0] else None
        if env.get("MLX_JACCL_COORDINATOR"):
            return env["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0]
    except (OSError, ValueError, IndexError, TypeError, KeyError):
        return None
    return None


class WakeServer:
    """Rank 0's end: a listening socket, then the followers' connections it wakes."""

    def __init__(self, host: str):
        self._listener = socket.create_server((host, 0))
        self.secret = secrets.token_bytes(_SECRET_BYTES)
        self._peers: list[socket.socket] = []

    @classmethod
    def open(cls) -> WakeServer | None:
        """Listening on rank 0's address, or None where there is none to listen on."""
        host = leader_host()
        if host is None:
            return None
        try:
            return cls(host)
        except OSError as exc:
            log.warning("rank 0 cannot listen on %s to wake idle followers (%s): they wait in the collective",
                        host, exc)
            return None

    @property
    def address(self) -> tuple[str, int, bytes]:
        """What the greeting carries: (host, port, secret)."""
        host, port = self._listener.getsockname()[:2]
        return host, port, self.secret

    def accept(self, count: int, bound: float) -> None:
        """Keep `count` followers' connections: each sent the secret. Those that connected
        did before the collective that counted them, so they wait in the backlog."""
        deadline = time.monotonic() + bound
        while len(self._peers) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupError(f"only {len(self._peers)} of {count} followers reached rank 0's wake socket")
            self._listener.settimeout(left)
            try:
                peer, _ = self._listener.accept()
            except TimeoutError:
                continue
            peer.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                got = _read_exactly(peer, _SECRET_BYTES)
            except OSError:
                got = b""
            if got != self.secret:
                peer.close()  # not one of the group's ranks
                continue
            peer.setblocking(False)  # a wake never waits on a follower
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers.append(peer)
        self._listener.close()

    def wake(self) -> None:
        """One byte to every follower. A follower that is gone is the collective's to report."""
        for peer in self._peers:
            with contextlib.suppress(OSError):
                peer.send(b"w")

    def close(self) -> None:
        self._listener.close()
        for peer in self._peers:
            peer.close()


class WakeClient:
    """A follower's end: connected to rank 0's wake socket."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    @classmethod
    def connect(cls, address: tuple[str, int, bytes] | None, bound: float) -> WakeClient | None:
        """Connected, the secret sent; None where rank 0 named no address or it cannot be reached."""
        if address is None:
            return None
        host, port, secret = address
        try:
            sock = socket.create_connection((host, port), timeout=min(bound, 10.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(secret)
        except OSError as exc:
            log.warning("cannot reach rank 0's wake socket at %s:%d (%s): idle, this rank waits in the collective",
                        host, port, exc)
            return None
        return cls(sock)

    def wait(self, bound: float) -> None:
        """Block until rank 0 wakes this rank; GroupError if it closed the socket or stayed
        silent past `bound` seconds (rank 0 wakes it at least every heartbeat)."""
        self._sock.settimeout(bound)
        try:
            got = self._sock.recv(1)
        except TimeoutError:
            raise GroupError(f"rank 0 sent nothing for {bound:g} s: it is gone or hung") from None
        except OSError as exc:
            raise GroupError(f"waiting for rank 0: {exc}") from exc
        if not got:
            raise GroupError("waiting for rank 0: it closed the connection")

    def close(self) -> None:
        self._sock.close()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data
