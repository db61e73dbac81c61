"""The node's one echo probe: the wire protocol, the bounded listener and the timed client.

Two features time the data network between nodes with it: node qualification's peer check
(:mod:`trainguard.agent.qualify.peers`, a short exchange with a few qualified peers before a node takes a slot)
and fail-slow's slow-link localisation (:mod:`trainguard.agent.link_probe`, transfers the coordinator asks for
while a job runs). A node serves one :class:`EchoListener` on its data address for both; its port goes in the
verdict (``NodeQualification.echo_port``) and in the heartbeats (``NodeHeartbeatRequest.link_probe_port``).

Wire format of one probe (plain TCP)::

    client                                     server (EchoProbeServer)
    8-byte big-endian length N + N bytes  -->  reads them all
                                          <--  1 byte acknowledgement   (client: up_s = time to here)
                                          <--  N bytes back             (client: down_s = time for these)

so a capped rate on either node's egress shows in one direction. The listener bounds each probe's size
(:data:`MAX_PROBE_BYTES`), the connections it serves at once (:data:`MAX_CONNECTIONS`) and each connection's
time (:data:`SERVE_TIMEOUT_S`).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

#: Largest probe the listener accepts, bytes (link probes ask for 1 MiB by default, the peer check 1 MiB).
MAX_PROBE_BYTES = 64 << 20
#: Probe connections served at once; more wait in the listen backlog.
MAX_CONNECTIONS = 8
#: Per-connection socket timeout of the listener, seconds.
SERVE_TIMEOUT_S = 60.0
_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 16


class ProbeError(ConnectionError):
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


class EchoProbeServer:
    """Echoes probes back (one thread per connection, bounded).

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
        self._thread = threading.Thread(target=self._accept, name="echo-probe-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._slots.acquire()
            threading.Thread(target=self._serve, args=(conn,), name="echo-probe-conn", daemon=True).start()

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
        except OSError as exc:  # ProbeError included
            log.debug("echo probe connection ended early: %s", exc)
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
        nbytes: bytes to send (and to get back), 1 to :data:`MAX_PROBE_BYTES`.
        timeout_s: limit for the whole probe, seconds.

    Returns:
        (up_s, down_s): seconds to send the bytes until the peer acknowledged them, and to receive them back.

    Raises:
        ProbeError: connection refused/reset, timeout, or a short answer.
    """
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
    except OSError as exc:  # ProbeError included
        raise ProbeError(f"probe to {address}:{port}: {exc}") from exc
    return t1 - t0, t2 - t1


class EchoListener:
    """The node's one echo listener, started on first use and shared by the features that need it.

    Args:
        address: the node's data address.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._server: EchoProbeServer | None = None
        self._failed = False
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The listener's port (started here on first use; 0 when it cannot listen: peers cannot time against
        this node, which the log says once)."""
        with self._lock:
            if self._server is None and not self._failed:
                try:
                    self._server = EchoProbeServer(self.address)
                except OSError as exc:
                    self._failed = True
                    log.warning("echo probe listener cannot listen on %s (%s): peers cannot time the links to "
                                "this node (qualification, slow-link localisation)", self.address, exc)
            return self._server.port if self._server is not None else 0

    @property
    def server(self) -> EchoProbeServer | None:
        """The running server, if started."""
        return self._server

    def close(self) -> None:
        """Stops the listener (a later :attr:`port` starts a new one)."""
        with self._lock:
            if self._server is not None:
                self._server.close()
                self._server = None


__all__ = ["EchoListener", "EchoProbeServer", "MAX_PROBE_BYTES", "ProbeError", "probe_once"]
