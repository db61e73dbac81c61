"""The port a node offers its coordinator as a generation's ``MASTER_PORT``, held until nothing needs it.

A port found free by binding port 0 and closing the socket was free only then: the coordinator made it the
generation's ``MASTER_PORT`` and the store bound it ~2 s later (after torch's import), and any process of the
host that bound port 0 or connected out in between could take it; the store's bind then failed with
EADDRINUSE, a rank-0 fault that cost a restart (the whole job under ``--max-restarts 0``).

The offer keeps the port bound, with ``SO_REUSEADDR`` and never listening: the kernel gives a bound port to no
``bind(0)`` and no outgoing connection, while torch's TCPStore (libuv or not), which sets ``SO_REUSEADDR``, binds
and listens on it as if it were free. A plain ``bind`` without ``SO_REUSEADDR`` is refused while the port is
held, as it would be once the store listens.
"""

from __future__ import annotations

import socket
import threading

from trainguard.agent.errors import AgentError

__all__ = ["MasterPortOffer", "hold_port"]


def hold_port(address: str) -> socket.socket:
    """A TCP socket bound to a free port of ``address``, ``SO_REUSEADDR`` set, not listening.

    Raises:
        AgentError: ``address`` is not an address of this host (or a name that does not resolve); the node
            would publish an address its peers cannot reach, so this is a configuration error, not a retry.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 0))
        return sock
    except OSError as exc:  # gaierror (a name that does not resolve) included
        sock.close()
        raise AgentError(
            f"cannot listen on this node's address {address!r} ({exc.strerror or exc}): it must be an address "
            "of this host that its peers reach it at; pass one with --local-addr (or --address), or make the "
            "host name resolve to it") from exc


class MasterPortOffer:
    """One held port offered in every registration and heartbeat until a generation's rank table names it;
    that port stays held through the generation (its store, or rank 0's, binds it meanwhile) and is let go
    once a later generation's table arrives; the next offer is a new held port (the coordinator never gives
    two generations one port).

    Args:
        address: the node's address, where the generation's store listens.
    """

    def __init__(self, address: str) -> None:
        self._address = address
        self._lock = threading.Lock()
        self._offered: socket.socket | None = None
        self._in_use: tuple[int, socket.socket] | None = None  # (generation, socket) of the table naming it

    def port(self) -> int:
        """The port to offer now (held from the first call on).

        Raises:
            AgentError: the node's address cannot be bound (see :func:`hold_port`).
        """
        with self._lock:
            if self._offered is None:
                self._offered = hold_port(self._address)
            return self._offered.getsockname()[1]

    def seen(self, generation: int, master_port: int) -> None:
        """A rank table of ``generation`` with ``master_port`` arrived: the offered port, when named, is held for
        that generation; a port held for an older generation is let go."""
        with self._lock:
            if self._in_use is not None and generation > self._in_use[0]:
                self._in_use[1].close()
                self._in_use = None
            offered = self._offered
            if offered is not None and master_port > 0 and master_port == offered.getsockname()[1]:
                if self._in_use is not None:
                    self._in_use[1].close()
                self._in_use, self._offered = (generation, offered), None

    def close(self) -> None:
        """Lets every held port go."""
        with self._lock:
            for sock in (self._offered, self._in_use[1] if self._in_use else None):
                if sock is not None:
                    sock.close()
            self._offered = self._in_use = None
