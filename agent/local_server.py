"""The node agent's gRPC service (``trainguard.v1.NodeAgent``) for local workers and operators.

Workers reach it over a unix socket (path in ``TRAINGUARD_AGENT_SOCKET``); every call is cheap and never
blocks on the coordinator, so a training step is never slowed by the control plane.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Protocol

import grpc

from trainguard.proto import agent_pb2, agent_pb2_grpc

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.event_bus import EventBus

log = logging.getLogger(__name__)

#: Largest request a worker or operator may send; health calls are tiny, so anything larger is garbage.
MAX_REQUEST_BYTES = 64 * 1024


def local_only(context: grpc.ServicerContext, method: str) -> None:
    """Worker methods feed the supervisor (heartbeats decide hangs, reports decide drains): only processes on
    this node may call them, over the unix socket; a TCP peer gets PERMISSION_DENIED."""
    if not context.peer().startswith("unix:"):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      f"{method} is served to local workers on the agent's unix socket only")


class ServedNode(Protocol):
    """What the service reads and feeds: a ``trainguard run`` node (:class:`~trainguard.agent.node.NodeAgent`) or
    the daemon's (:class:`~trainguard.agent.daemon_node.DaemonNode`)."""

    bus: "EventBus"
    stopping: bool
    generation: int

    def health_snapshot(self, max_events: int = 20) -> agent_pb2.NodeHealth:
        """The node's health now."""

    def on_worker_heartbeat(self, rank: int, pid: int, generation: int, step: int, step_time_s: float,
                            finished: bool = False, sections: Mapping[str, float] | None = None,
                            acked: Sequence[str] | None = None) -> list:
        """Records a local worker's step; returns the advisories pending for it (``acked``: the ids the worker
        acknowledges, None when it does not acknowledge)."""

    def on_checkpoint_report(self, report: agent_pb2.CheckpointReport) -> None:
        """Records a durable checkpoint step."""


class NodeAgentService(agent_pb2_grpc.NodeAgentServicer):
    """Answers health queries and worker heartbeats from the agent's live state.

    Args:
        agent: the running node (a ``trainguard run`` node agent or the daemon's node).
    """

    def __init__(self, agent: ServedNode) -> None:
        self._agent = agent

    def GetHealth(self, request, context):  # noqa: N802 (gRPC naming)
        """A snapshot of the node: workers, recent events, generation, predictor score."""
        if request.max_events < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_events must be >= 0")
        return self._agent.health_snapshot(request.max_events or 20)

    def WatchEvents(self, request, context):  # noqa: N802
        """Streams health events (after replaying ``replay`` recent ones) until the client goes away."""
        if request.replay < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replay must be >= 0")
        sub = self._agent.bus.subscribe()
        try:
            for ev in self._agent.bus.recent(request.replay):
                if ev.severity >= request.min_severity:
                    yield ev.to_proto()
            while context.is_active() and not self._agent.stopping:
                ev = sub.get(timeout=0.5)
                if ev is not None and ev.severity >= request.min_severity:
                    yield ev.to_proto()
        finally:
            sub.close()

    def WorkerHeartbeat(self, request, context):  # noqa: N802
        """Records a worker's step and hands back the advisories pending for it."""
        local_only(context, "WorkerHeartbeat")
        if request.rank < 0 or request.step < -1 or request.step_time_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank >= 0, step >= -1 and step_time_s >= 0 required")
        advisories = self._agent.on_worker_heartbeat(
            rank=request.rank, pid=request.pid, generation=request.generation, step=request.step,
            step_time_s=request.step_time_s, finished=request.finished, sections=request.section_s,
            acked=list(request.acked_advisory_ids) if request.acks_advisories else None,
        )
        return agent_pb2.WorkerHeartbeatResponse(advisories=advisories, generation=self._agent.generation)

    def ReportCheckpoint(self, request, context):  # noqa: N802
        """Records that a worker's checkpoint step is durable in a tier."""
        local_only(context, "ReportCheckpoint")
        if request.step < 0 or request.rank < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "step and rank must be >= 0")
        self._agent.on_checkpoint_report(request)
        return agent_pb2.CheckpointReportResponse()

    def AttachJob(self, request, context):  # noqa: N802
        """Only the node daemon keeps jobs (:class:`~trainguard.agent.daemon_service.DaemonService`)."""
        self._not_a_daemon(context, "AttachJob")

    def DetachJob(self, request, context):  # noqa: N802
        """Only the node daemon keeps jobs (:class:`~trainguard.agent.daemon_service.DaemonService`)."""
        self._not_a_daemon(context, "DetachJob")

    @staticmethod
    def _not_a_daemon(context: grpc.ServicerContext, method: str) -> None:
        # The generated servicer's default raised NotImplementedError: UNIMPLEMENTED with a traceback in the
        # launcher's log for every such call.
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method}: this socket is a trainguard run launcher's, not the "
                                                     "node daemon's (trainguard-agent.service); attach jobs there")


def serve(agent: ServedNode, unix_socket: str | None, tcp_listen: str | None = None) -> tuple[grpc.Server, int]:
    """Starts the NodeAgent service on a unix socket and/or a TCP address.

    Args:
        agent: the node agent whose state is served.
        unix_socket: path of the unix socket (created with mode 0600), or None.
        tcp_listen: ``host:port`` for remote callers, or None.

    Returns:
        The started server and the TCP port bound (0 when no TCP listener).
    """
    import os

    from trainguard.agent.rpc_limits import RequestGuard

    # Oversized, malformed or out-of-range requests get INVALID_ARGUMENT from the guard; only messages above
    # the transport cap (16x larger) are dropped by gRPC itself, unread, with RESOURCE_EXHAUSTED.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=[RequestGuard(MAX_REQUEST_BYTES, max_watchers=4)],
        options=[("grpc.max_receive_message_length", 16 * MAX_REQUEST_BYTES), ("grpc.so_reuseport", 0)],
    )
    agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService(agent), server)
    port = 0
    if unix_socket:
        if os.path.exists(unix_socket):
            os.unlink(unix_socket)
        server.add_insecure_port(f"unix:{unix_socket}")
    if tcp_listen:
        port = server.add_insecure_port(tcp_listen)
    old = os.umask(0o077)  # the socket file is created at start(): owner-only
    try:
        server.start()
    finally:
        os.umask(old)
    return server, port


__all__ = ["NodeAgentService", "ServedNode", "local_only", "serve", "MAX_REQUEST_BYTES"]
