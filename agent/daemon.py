"""``trainguard agent``: the long-lived node agent daemon.

It serves the NodeAgent gRPC service (health, events) on a unix socket and optionally TCP, whether or not a job
runs, so health probes and ``trainguard status`` always answer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from trainguard.agent.errors import AgentError
from trainguard.agent.local_server import serve
from trainguard.agent.node import NodeAgent, NodeConfig, install_signal_handlers

log = logging.getLogger(__name__)


def run_daemon(socket_path: str, grpc_listen: str | None) -> int:
    """Serves until SIGTERM/SIGINT.

    Args:
        socket_path: unix socket for local clients (its folder is created).
        grpc_listen: optional ``host:port`` for remote clients.

    Returns:
        0 after a clean stop.

    Raises:
        AgentError: the socket folder cannot be created or the address cannot be bound.
    """
    try:
        os.makedirs(os.path.dirname(os.path.abspath(socket_path)), exist_ok=True)
    except OSError as exc:
        raise AgentError(f"cannot create the folder of --socket {socket_path}: {exc.strerror}; "
                         "pick another path") from exc
    agent = NodeAgent(NodeConfig(job="", coordinator="", argv=[], node_id=socket.gethostname()))
    try:
        server, port = serve(agent, socket_path, grpc_listen)
    except RuntimeError as exc:
        raise AgentError(f"cannot listen on {grpc_listen or socket_path}: {exc}") from exc
    log.info("agent serving on unix:%s%s", socket_path, f" and port {port}" if grpc_listen else "")
    stopped = threading.Event()
    agent.request_stop = stopped.set  # type: ignore[method-assign]
    restore = install_signal_handlers(agent)
    try:
        stopped.wait()
    finally:
        restore()
        server.stop(1.0).wait()
        if os.path.exists(socket_path):
            os.unlink(socket_path)
    return 0
