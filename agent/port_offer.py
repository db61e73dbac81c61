"""The ports a node offers its coordinator as a generation's ``MASTER_PORT``, held until nothing needs them.

A port found free by binding port 0 and closing the socket was free only then: the coordinator made it the
generation's ``MASTER_PORT`` and the store bound it ~2 s later (after torch's import), and any process of the
host that bound port 0 or connected out in between could take it; the store's bind then failed with
EADDRINUSE, a rank-0 fault that cost a restart (the whole job under ``--max-restarts 0``).

Each offer is a port held bound on every address (``SO_REUSEADDR``, never listening): the kernel gives a bound
port to no ``bind(0)`` and no outgoing connection, and refuses a plain ``bind`` of it on any address, while
torch's TCPStore (libuv or not), which sets ``SO_REUSEADDR``, binds and listens on it as if it were free.

Every registration and heartbeat offers a new port, as before (the coordinator never gives two generations one
port, and may have taken an offer for a generation this node never hears of: offering that port again would
leave the next generation without one); the last :data:`KEPT_OFFERS` stay held, since the START naming one
comes a reply or a few later. The port a rank table names stays held through its generation, and goes when a
later generation's table arrives.
"""

from __future__ import annotations

import collections
import socket
import threading

from trainguard.agent.errors import AgentError

__all__ = ["KEPT_OFFERS", "MasterPortOffer", "hold_port"]

#: Offers kept held: at the default 0.5 s heartbeat, about the last 4 s of them.
KEPT_OFFERS = 8


def _check_address(address: str) -> socket.AddressFamily:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as exc:  # gaierror (a name that does not resolve) included
        raise AgentError(
            f"cannot listen on this node's address {address!r} ({exc.strerror or exc}): it must be an address "
            "of this host that its peers reach it at; pass one with --local-addr (or --address), or make the "
            "host name resolve to it") from exc
    return family


def hold_port(address: str) -> socket.socket:
    """A TCP socket bound to a port free on every address of this host (the IPv6 wildcard with IPv4 mapped
    where the host has IPv6, else the IPv4 one), ``SO_REUSEADDR`` set, not listening: the store binds every
    address too, so a port held on ``address`` alone could still be taken on another (127.0.0.1).

    Raises:
        AgentError: ``address`` is not an address of this host (or a name that does not resolve); the node
            would publish an address its peers cannot reach, so this is a configuration error, not a retry.
    """
    family = _check_address(address)
    for fam, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(fam, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((wildcard, 0))
            return sock
        except OSError:
            sock.close()
            if fam == family:
                raise
    raise AgentError(f"cannot bind a port on this host for {address!r}")


class MasterPortOffer:
    """A new held port for every offer; the last :data:`KEPT_OFFERS` kept, and the one a rank table names kept
    through its generation (see the module docstring).

    Args:
        address: the node's address (checked at every offer; the port is held on every address).
    """

    def __init__(self, address: str) -> None:
        self._address = address
        self._lock = threading.Lock()
        self._offered: collections.OrderedDict[int, socket.socket] = collections.OrderedDict()
        self._in_use: tuple[int, int, socket.socket] | None = None  # (generation, port, socket)

    def port(self) -> int:
        """A new port to offer, held (also after :meth:`close`: a port of 0 would leave a generation without one).

        Raises:
            AgentError: the node's address cannot be bound (see :func:`hold_port`).
        """
        with self._lock:
            sock = hold_port(self._address)
            port = sock.getsockname()[1]
            self._offered[port] = sock
            while len(self._offered) > KEPT_OFFERS:
                self._offered.popitem(last=False)[1].close()
            return port

    def seen(self, generation: int, master_port: int) -> None:
        """A rank table of ``generation`` with ``master_port`` arrived: an offered port it names is held for that
        generation; a port held for an older generation is let go."""
        with self._lock:
            if self._in_use is not None and generation > self._in_use[0]:
                self._in_use[2].close()
                self._in_use = None
            sock = self._offered.pop(master_port, None) if master_port > 0 else None
            if sock is not None:
                if self._in_use is not None:
                    self._in_use[2].close()
                self._in_use = (generation, master_port, sock)

    def held(self) -> list[int]:
        """The ports held now (offers kept, then the generation's)."""
        with self._lock:
            return list(self._offered) + ([self._in_use[1]] if self._in_use else [])

    def close(self) -> None:
        """Lets every held port go."""
        with self._lock:
            for sock in self._offered.values():
                sock.close()
            self._offered.clear()
            if self._in_use is not None:
                self._in_use[2].close()
                self._in_use = None
