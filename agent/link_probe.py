"""The agent's side of slow-link localisation: a probe listener, and timed transfers to peers on request.

The coordinator localises a slow link by pairing nodes (:mod:`trainguard.recovery.link_locator`); each node
runs the transfers it is asked for in its heartbeat replies and reports their times in its next heartbeats.
A probe is plain TCP over the node's data address (the address it registered with, which its ranks use):

    client                                     server (the peer's LinkProbeServer)
    8-byte big-endian length N + N bytes  -->  reads them all
                                          <--  1 byte acknowledgement   (client: up_s = time to here)
                                          <--  N bytes back             (client: down_s = time for these)

so a capped rate on either node's egress shows in one direction. Probes run on their own threads and never
hold up the agent's loop; the listener bounds its connections, each probe's size and its time.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable, Mapping

from trainguard.proto import coordinator_pb2

log = logging.getLogger(__name__)

#: Largest probe the listener accepts, bytes (the coordinator asks for 1 MiB by default).
MAX_PROBE_BYTES = 64 << 20
#: Probe connections served at once; more wait in the listen backlog.
MAX_CONNECTIONS = 8
#: Per-connection socket timeout of the listener, seconds.
SERVE_TIMEOUT_S = 60.0
#: Probe ids remembered (a repeated ask is not run twice).
_SEEN_MAX = 1024
_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 16


class ProbeError(Exception):
    """A probe could not be run to its end (connection refused or reset, timeout, short read)."""


def _recv_exact(sock: socket.socket, n: int, buf: memoryview | None = None) -> int:
    """Reads exactly ``n`` bytes (into ``buf`` when given, else discarded); returns ``n``.

    Raises:
        ProbeError: the peer closed the connection early.
    """
    scratch = bytearray(min(n, _CHUNK)) if buf is None else None
    got = 0
    while got < n:
        view = buf[got:n] if buf is not None else memoryview(scratch)[: min(len(scratch), n - got)]
        k = sock.recv_into(view)
        if k == 0:
            raise ProbeError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return got


class LinkProbeServer:
    """Echoes probes back: the listener peers' probes connect to (one thread per connection, bounded).

    Args:
        address: the address to listen on (the node's data address); port 0 picks a free port.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, 0))
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        self.served = 0
        self._thread = threading.Thread(target=self._accept, name="link-probe-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._slots.acquire()
            threading.Thread(target=self._serve, args=(conn,), name="link-probe-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(SERVE_TIMEOUT_S)
                header = bytearray(_HEADER.size)
                _recv_exact(conn, _HEADER.size, memoryview(header))
                (n,) = _HEADER.unpack(header)
                if not 0 < n <= MAX_PROBE_BYTES:
                    return  # not a probe (or too big): drop the connection
                _recv_exact(conn, n)
                conn.sendall(b"A")
                payload = bytes(min(n, _CHUNK))
                sent = 0
                while sent < n:
                    k = min(len(payload), n - sent)
                    conn.sendall(payload[:k])
                    sent += k
                self.served += 1
        except (OSError, ProbeError) as exc:
            log.debug("link probe connection ended early: %s", exc)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stops listening (connections being served finish on their own)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def probe_once(address: str, port: int, nbytes: int, timeout_s: float) -> tuple[float, float]:
    """Runs one probe to a peer's listener.

    Args:
        address, port: the peer's listener.
        nbytes: bytes to send (and to get back).
        timeout_s: limit for the whole probe, seconds.

    Returns:
        (up_s, down_s): seconds to send the bytes until the peer acknowledged them, and to receive them back.

    Raises:
        ProbeError: connection refused/reset, timeout, or a short answer.
    """
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as s:
            payload = bytes(min(nbytes, _CHUNK))
            t0 = time.monotonic()
            s.sendall(_HEADER.pack(nbytes))
            sent = 0
            while sent < nbytes:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                k = min(len(payload), nbytes - sent)
                s.sendall(payload[:k])
                sent += k
            s.settimeout(max(0.01, deadline - time.monotonic()))
            ack = bytearray(1)
            _recv_exact(s, 1, memoryview(ack))
            t1 = time.monotonic()
            s.settimeout(max(0.01, deadline - time.monotonic()))
            _recv_exact(s, nbytes)
            t2 = time.monotonic()
    except OSError as exc:
        raise ProbeError(f"probe to {address}:{port}: {exc}") from exc
    return t1 - t0, t2 - t1


class LinkProber:
    """The node's probe listener (started on first use) and the probes the coordinator asks it to run.

    Args:
        address: the node's data address (listener and probes use it).
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._server: LinkProbeServer | None = None
        self._failed = False
        self._lock = threading.Lock()
        self._results: list[coordinator_pb2.LinkProbeResult] = []
        self._seen: dict[str, None] = {}

    @property
    def port(self) -> int:
        """The listener's port (started here on first use; 0 when it cannot listen: the node is then left out
        of link probes, and says so once in the log)."""
        if self._server is None and not self._failed:
            try:
                self._server = LinkProbeServer(self.address)
            except OSError as exc:
                self._failed = True
                log.warning("link probe listener cannot listen on %s (%s): this node is left out of slow-link "
                            "localisation", self.address, exc)
        return self._server.port if self._server is not None else 0

    def run(self, asks: Iterable[coordinator_pb2.LinkProbeAsk]) -> None:
        """Starts the probes not run before, each on its own thread (results come back through :meth:`drain`)."""
        for a in asks:
            with self._lock:
                if a.probe_id in self._seen:
                    continue
                self._seen[a.probe_id] = None
                if len(self._seen) > _SEEN_MAX:
                    del self._seen[next(iter(self._seen))]
            threading.Thread(target=self._probe, args=(a,), name=f"link-probe-{a.probe_id}", daemon=True).start()

    def _probe(self, a: coordinator_pb2.LinkProbeAsk) -> None:
        res = coordinator_pb2.LinkProbeResult(probe_id=a.probe_id, peer_node=a.peer_node, bytes=a.bytes)
        n = min(int(a.bytes), MAX_PROBE_BYTES)
        try:
            res.up_s, res.down_s = probe_once(a.peer_address, a.peer_port, n, max(0.5, a.timeout_s))
            log.info("link probe to %s (%s:%d): %d bytes up in %.3f s, back in %.3f s", a.peer_node,
                     a.peer_address, a.peer_port, n, res.up_s, res.down_s)
        except ProbeError as exc:
            res.error = str(exc)[:1000]
            log.warning("link probe to %s failed: %s", a.peer_node, exc)
        with self._lock:
            self._results.append(res)

    def drain(self) -> list[coordinator_pb2.LinkProbeResult]:
        """Results finished since the last call."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def close(self) -> None:
        """Stops the listener."""
        if self._server is not None:
            self._server.close()


class WithLinkProbe:
    """Heartbeat content (:class:`~trainguard.agent.parts.HeartbeatContent`): another content's fields plus the
    link probe's listener port and the probe results finished since the last heartbeat."""

    def __init__(self, inner, prober: LinkProber) -> None:
        self.inner = inner
        self.prober = prober

    def heartbeat_fields(self) -> Mapping[str, object]:
        """The inner content's ``NodeHeartbeatRequest`` fields, ``link_probe_port`` and ``link_results``."""
        return {**self.inner.heartbeat_fields(), "link_probe_port": self.prober.port,
                "link_results": self.prober.drain()}
