"""The peer check: a small timed exchange with a few already-qualified peers over the data network.

Every node that qualified serves :class:`EchoServer` on its data address (the one it registers); the port goes
with its verdict (``NodeQualification.echo_port``). A node qualifying asks the coordinator for up to
``peer_count`` such peers (``QualifyPeers``), sends each ``peer_kib`` KiB and reads them back, and takes the
median of the round trips as its time. The coordinator keeps the times of the nodes that qualified before and
answers with their median (the reference): a node whose time is over ``peer_slow_ratio`` times the reference
fails. Its own link is on every one of its round trips, a slow peer on one only, so the median pins the slowness
on the node under test.

Honest limits: the reference needs ``peer_min_history`` earlier measurements (the first nodes of a job only
record theirs); it is the median, so it stays right while fewer than half of the earlier nodes were slow; it is
kept in the coordinator's memory (a restarted coordinator starts a new history); and a TCP exchange on the data
network is a stand-in for the job's collective (gloo/NCCL), not the collective itself.

Wire format of one exchange: 4 bytes big-endian length N (at most :data:`MAX_EXCHANGE_BYTES`), then N bytes;
the server writes the same N bytes back.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.agent.qualify.base import Outcome, QualifyContext, failed, passed, register_check, skipped

log = logging.getLogger(__name__)

#: Largest exchange a server answers, bytes.
MAX_EXCHANGE_BYTES = 16 << 20
#: Exchanges a server answers at once (more connections wait in the listen backlog).
MAX_CONCURRENT = 4
#: Seconds a server waits for a client's bytes before dropping the connection.
SERVER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Peer:
    """A qualified node that answers exchanges: its id, data address and echo port."""

    node_id: str
    address: str
    port: int


@dataclass(frozen=True)
class PeerSet:
    """What the coordinator answered: peers to time, and the reference time of the nodes before.

    Attributes:
        peers: up to the requested count.
        reference_s: median exchange time of the nodes that qualified so far, seconds (0: none yet).
        history: how many times the reference is the median of.
    """

    peers: tuple[Peer, ...] = ()
    reference_s: float = 0.0
    history: int = 0


def _recv_exact(sock: socket.socket, n: int, buf: bytearray | None = None) -> bytes:
    out = buf if buf is not None else bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return bytes(out) if buf is None else b""


class EchoServer:
    """Answers peers' timed exchanges on ``address`` (port 0 picks one); a daemon thread per connection.

    Args:
        address: the node's data address (what it registers).
    """

    def __init__(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, 0))
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self._closed = False
        threading.Thread(target=self._accept, name="qualify-echo", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._slots.acquire()
            threading.Thread(target=self._serve, args=(conn,), name="qualify-echo-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(SERVER_TIMEOUT_S)
            (n,) = struct.unpack("!I", _recv_exact(conn, 4))
            if n > MAX_EXCHANGE_BYTES:
                return
            conn.sendall(_recv_exact(conn, n))
        except (OSError, ConnectionError, struct.error) as exc:
            log.debug("qualify echo: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        """Stops accepting (exchanges in flight finish)."""
        self._closed = True
        self._sock.close()


def exchange(peer: Peer, payload: bytes, timeout_s: float) -> float:
    """One timed exchange with ``peer``: connect, send ``payload``, read it back.

    Returns:
        Seconds from connect to the last byte back.

    Raises:
        OSError, ConnectionError: unreachable, refused, timed out, or the echo differed.
    """
    t0 = time.monotonic()
    with socket.create_connection((peer.address, peer.port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("!I", len(payload)) + payload)
        back = _recv_exact(sock, len(payload))
    took = time.monotonic() - t0
    if back != payload:
        raise ConnectionError("echo differs from what was sent")
    return took


@register_check("peers")
class PeerExchangeCheck:
    """The node's median exchange time with a few qualified peers, against the reference of the nodes before."""

    name = "peers"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Asks for peers, times one exchange with each, compares the median with the reference."""
        cfg = ctx.config
        source: Callable[[int], PeerSet] | None = ctx.peer_source
        if cfg.peer_count == 0:
            return skipped("peer_count is 0")
        if source is None:
            return skipped("no coordinator to find peers through (runs at registration only)")
        found = source(cfg.peer_count)
        if not found.peers:
            return skipped("no qualified peer yet (the first node of a job)")
        payload = os.urandom(cfg.peer_kib * 1024)
        times: list[float] = []
        errors: list[str] = []
        for peer in found.peers:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                times.append(exchange(peer, payload, left))
            except (OSError, ConnectionError) as exc:
                errors.append(f"{peer.node_id} ({peer.address}:{peer.port}): {exc}")
        if not times:
            return failed("no peer answered over the data network: " + "; ".join(errors or ["out of time"]))
        mine = statistics.median(times)
        note = f"{len(times)} peer(s), median {mine * 1000:.1f} ms for {cfg.peer_kib} KiB each way"
        if errors:
            note += f" ({len(errors)} unreachable: {errors[0]})"
        if found.history < cfg.peer_min_history or found.reference_s <= 0:
            return passed(f"{note}; no reference yet ({found.history} earlier node(s), "
                          f"{cfg.peer_min_history} needed)", mine)
        ratio = mine / found.reference_s
        if ratio > cfg.peer_slow_ratio:
            return failed(f"{note}: {ratio:.1f}x the {found.reference_s * 1000:.1f} ms median of {found.history} "
                          f"qualified node(s) (limit {cfg.peer_slow_ratio:g}x)", mine)
        return passed(f"{note}, {ratio:.1f}x the median of {found.history} qualified node(s)", mine)


__all__ = ["EchoServer", "MAX_EXCHANGE_BYTES", "Peer", "PeerExchangeCheck", "PeerSet", "exchange"]
