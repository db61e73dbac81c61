"""Whether a TCP port can be listened on now, asked the way the gRPC servers listen (``SO_REUSEADDR``).

The launcher asks before embedding a coordinator (a taken port means another node's agent serves there, so this
one joins it), and the coordinator before its server tries (gRPC's own failure is a raw C++ log line on stderr).
A probe without ``SO_REUSEADDR`` took a port whose earlier server closed its connections first (a coordinator
stopped or killed while nodes were connected: its side holds them in TIME_WAIT for a minute) for one in use:
relaunched within that minute, the node on the endpoint's host joined a coordinator nobody ran and waited out
its join timeout. gRPC binds such a port without trouble, and a port another socket listens on is refused either
way. Imports nothing of trainguard, so the agent and the coordinator can both use it.
"""

from __future__ import annotations

import errno
import socket


def can_listen(host: str, port: int) -> bool:
    """Whether ``host:port`` (``[v6]`` hosts with or without brackets) is free of another listener now; port 0
    always is. Only a port in use counts as taken: a host that is not local or does not resolve counts as free,
    as the server's own error names it better.
    """
    if port == 0:
        return True
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return True  # no such family here (IPv6 disabled): the server's own error, or its fallback, decides
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            # Bound is not enough: with SO_REUSEADDR a bind can succeed beside another socket that bound without
            # listening yet; listen() is what a second listener fails at.
            s.listen(1)
        except OSError as exc:
            # Only "in use" is taken: an address not on this host (EADDRNOTAVAIL) or a name that does not resolve
            # is the server's to report, in its own words ("not local").
            return exc.errno != errno.EADDRINUSE
        return True
