"""The node agent daemon's gRPC service: the NodeAgent service of a ``trainguard run`` node
(:class:`~trainguard.agent.local_server.NodeAgentService`) with the daemon's additions (detector states in
``GetHealth``, checkpoint reports in the metrics, AttachJob/DetachJob of the launchers on this node), and the
server options the daemon serves it with.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import grpc

from trainguard.agent.arena_keeper import ArenaRootError
from trainguard.agent.config import AgentConfig
from trainguard.agent.daemon_jobs import REFUSED_METADATA_KEY, JobHeldElsewhere, JobTlsPathRefused
from trainguard.agent.launcher_lock import LOCK_NAME_RE
from trainguard.agent.local_server import NodeAgentService, local_only
from trainguard.proto import agent_pb2

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.agentd import AgentDaemon


def grpc_options(config: AgentConfig) -> list[tuple[str, Any]]:
    """The gRPC server options of the daemon's ``[grpc]`` settings."""
    g = config.grpc
    return [
        ("grpc.max_receive_message_length", g.max_message_bytes),
        ("grpc.max_send_message_length", 16 * 1024 * 1024),
        # Fail on a port another process holds instead of silently sharing it (grpc's default is SO_REUSEPORT).
        ("grpc.so_reuseport", 0),
        # No grpc.max_concurrent_streams and no maximum_concurrent_rpcs: both refuse cheap calls (a burst of
        # health probes got REFUSED_STREAM / RESOURCE_EXHAUSTED) where they must queue for a handler thread.
        # The bound that matters is on the expensive calls: open WatchEvents streams (RequestGuard, max_watchers).
        # Find dead peers of long WatchEvents streams; accept keep-alive pings from clients every 10 s.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class DaemonService(NodeAgentService):
    """The node service with the daemon's detector states added to ``GetHealth`` and checkpoint reports
    recorded in the metrics."""

    def __init__(self, daemon: "AgentDaemon") -> None:
        super().__init__(daemon.node)
        self._daemon = daemon
        self._lock = threading.Lock()
        self._detectors_key: tuple = ()
        self._detectors = agent_pb2.NodeHealth()

    def _detector_part(self) -> agent_pb2.NodeHealth:
        # Statuses change once per sample interval while health checkers may ask hundreds of times a second:
        # convert them once per change (the runner hands out a new status object on each sample).
        statuses = self._daemon.detector_statuses()
        with self._lock:
            # Identity, not equality: the cache holds the status objects, so their ids cannot be reused.
            same = len(statuses) == len(self._detectors_key) and all(
                a is b for a, b in zip(statuses, self._detectors_key))
            if not same or not statuses:
                key = tuple(statuses)
                part = agent_pb2.NodeHealth(detectors=[s.to_proto() for s in statuses])
                if self._daemon.detector_gap:
                    part.detectors.add(name="detectors", state=agent_pb2.DETECTOR_STATE_ERROR,
                                       detail=self._daemon.detector_gap)
                self._detectors_key, self._detectors = key, part
            return self._detectors

    def GetHealth(self, request, context):  # noqa: N802 (gRPC naming)
        health = super().GetHealth(request, context)
        if not health.detectors:
            health.MergeFrom(self._detector_part())
        health.subsystem_details.update(self._daemon.subsystem_details())
        return health

    def AttachJob(self, request, context):  # noqa: N802 (gRPC naming)
        """A `trainguard run` on this node attaches its job (local socket only)."""
        from trainguard.recovery.rpc_security import SecurityConfigError
        from trainguard.recovery.spec import JOB_NAME_RE

        local_only(context, "AttachJob")
        if not JOB_NAME_RE.match(request.job):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job[:64]!r} is not a job name")
        if request.launcher_pid <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "launcher_pid must be the launcher's pid (> 0)")
        if request.launcher_lock and not LOCK_NAME_RE.match(request.launcher_lock):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"launcher_lock {request.launcher_lock[:64]!r} is not a "
                                                            "lock file name in the daemon's launchers folder")
        if request.coordinator:
            from trainguard.agent.config import parse_hostport

            try:
                parse_hostport(request.coordinator)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"coordinator: {exc}")
        try:
            return self._daemon.attach_job(request)
        except ArenaRootError as exc:
            # Marked, so the launcher retries without the arena only when the arena was what was refused.
            context.set_trailing_metadata(((REFUSED_METADATA_KEY, "arena"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except JobTlsPathRefused as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except JobHeldElsewhere as exc:
            context.set_trailing_metadata(((REFUSED_METADATA_KEY, "held"),))  # the launcher retries a while
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except SecurityConfigError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the job's coordinator TLS files, as this daemon "
                                                               f"reads them: {exc}")

    def DetachJob(self, request, context):  # noqa: N802 (gRPC naming)
        """A launcher leaves its job; ``ended`` removes the job's arena now (local socket only)."""
        from trainguard.recovery.spec import JOB_NAME_RE

        local_only(context, "DetachJob")
        # The job name becomes a path under the daemon's folders (its TLS files, its arena): a name that is not
        # one plain path element ("/etc", "../..") would have the daemon delete a folder of someone else's.
        if not JOB_NAME_RE.match(request.job):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job[:64]!r} is not a job name")
        if request.launcher_lock and not LOCK_NAME_RE.match(request.launcher_lock):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"launcher_lock {request.launcher_lock[:64]!r} is not a "
                                                            "lock file name in the daemon's launchers folder")
        return agent_pb2.DetachJobResponse(arena_removed=self._daemon.detach_job(request))

    def ReportCheckpoint(self, request, context):  # noqa: N802 (gRPC naming)
        reply = super().ReportCheckpoint(request, context)
        if self._daemon.metrics is not None:
            self._daemon.metrics.observe_checkpoint(request.tier, request.bytes, request.stall_s, request.persist_s,
                                                    request.step)
        return reply


__all__ = ["DaemonService", "grpc_options"]
