"""The coordinator's gRPC face: request validation, status codes, the server and its lease reaper.

The job logic lives in :class:`~trainguard.recovery.coordinator.JobCoordinator`; this module checks every
request's format *before* anything is touched (so bad input never changes state), calls the core, waits for
the durability the answer depends on, and maps refusals to precise gRPC status codes:

=================================  ======================  ==================================================
refusal                            status                  agent's reaction (trainguard.agent.node)
=================================  ======================  ==================================================
unknown job                        NOT_FOUND               registration fails with the message
bytes that are not the request     INVALID_ARGUMENT        (the shared guard, :mod:`trainguard.grpc_guard`)
malformed / out-of-range field     INVALID_ARGUMENT        fix the flag named in the message
request over 256 KiB               RESOURCE_EXHAUSTED      (gRPC itself, before any handler runs)
node not registered                NOT_FOUND               registers again
stale lease                        FAILED_PRECONDITION     registers again
duplicate node id (live agent)     ALREADY_EXISTS          registration fails with the message
as many node ids as it may keep    RESOURCE_EXHAUSTED      registration fails with the message
``replaces`` a live slot holder    FAILED_PRECONDITION     registration fails with the message
generation the job never had       OUT_OF_RANGE            logged
store down / fenced off            UNAVAILABLE             retries (the coordinator may be restarting)
=================================  ======================  ==================================================

Every refusal is logged with the peer address. Semantics of each RPC are in ``coordinator.proto`` and
:mod:`trainguard.recovery.coordinator`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from trainguard.grpc_guard import HEALTH_MAX_REQUEST_BYTES, HealthGuard, RequestGuard
from trainguard.proto import coordinator_pb2, coordinator_pb2_grpc
from trainguard.recovery import convert
from trainguard.recovery.coordinator import DURABLE_WAIT_S, JobCoordinator
from trainguard.recovery.failslow import validate_timings
from trainguard.recovery.job_records import LOST_RECORD_RE
from trainguard.recovery.qualification import refusal_message
from trainguard.recovery.refusal_log import RefusalLog
from trainguard.recovery.link_locator import validate_link_results
from trainguard.names import NODE_ID_RE
from trainguard.steps import MAX_STEP
from trainguard.ports import can_listen
from trainguard.recovery.spec import JOB_NAME_RE, MAX_LOCAL_WORKERS, JobSpec
from trainguard.recovery.errors import (CapacityError, CoordinatorError, DuplicateNodeError, InvalidRequestError, NodeRefusedError,
                                        NotServingError, RecoveryError, RequestError, SlotTakenError,
                                        StaleGenerationError, StaleLeaseError, UnknownJobError, UnknownNodeError)
from trainguard.recovery.store import Store

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.recovery.rpc_security import RpcSecurity

log = logging.getLogger(__name__)

__all__ = ["COORDINATOR_SERVICE", "CoordinatorServer", "CoordinatorService", "JobSpec", "MAX_MEMORY_HOLDINGS",
           "MAX_REQUEST_BYTES", "check_node_id",
           "STATUS_OF", "build_grpc_server"]

#: Full name of the gRPC service, as the guard and interceptors see it.
COORDINATOR_SERVICE = "trainguard.v1.Coordinator"

#: Largest request the server accepts, bytes; larger ones get RESOURCE_EXHAUSTED from gRPC.
MAX_REQUEST_BYTES = 256 * 1024

#: gRPC status of each refusal.
STATUS_OF: dict[type[RequestError], grpc.StatusCode] = {
    UnknownJobError: grpc.StatusCode.NOT_FOUND,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownNodeError: grpc.StatusCode.NOT_FOUND,
    StaleLeaseError: grpc.StatusCode.FAILED_PRECONDITION,
    DuplicateNodeError: grpc.StatusCode.ALREADY_EXISTS,
    SlotTakenError: grpc.StatusCode.FAILED_PRECONDITION,
    StaleGenerationError: grpc.StatusCode.OUT_OF_RANGE,
    NotServingError: grpc.StatusCode.UNAVAILABLE,
    NodeRefusedError: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

_MAX_TEXT = 255
_MAX_LABELS = 32
_MAX_EVENT_TEXT = 4096
#: Largest training step a request may name: a job-wide checkpoint is set steps beyond the furthest reported one,
#: and a step near 2**63 took that past int64, so every heartbeat answer of the generation failed to encode
#: (UNKNOWN) from one bad value on. 2**53 - 1 keeps far from that and exact as a JSON number, and admits steps
#: counted in samples or tokens (10**13 for a 10T-token run), which the disk tier names; a bound of 10**12 made
#: every heartbeat of such a job invalid and lost its node's lease.
_MAX_STEP = MAX_STEP
#: Most in-memory holdings one heartbeat may report: each is one step of the arena or of the replicas a node
#: keeps (a handful); the plan of every node's generation is computed over all of them.
MAX_MEMORY_HOLDINGS = 256
#: Largest world size a holding may name (far beyond any job; a bound, not a guess at the job's).
_MAX_HOLDING_WORLD = 1 << 24


def _bad(field: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field} {why}")


def _check_text(field: str, value: str, limit: int = _MAX_TEXT) -> None:
    if len(value) > limit:
        raise _bad(field, f"is {len(value)} characters long; at most {limit} are allowed")
    if any(ord(c) < 32 for c in value):
        raise _bad(field, "contains control characters")


def _check_job(job: str) -> None:
    if not job:
        raise _bad("job", "is required")
    if not JOB_NAME_RE.match(job):
        raise _bad("job", f"{job[:64]!r} is not a valid job name (1-128 of [A-Za-z0-9._:@-])")


def check_node_id(field: str, node_id: str) -> None:
    """Checks a node id as every coordinator request does (the launcher checks ``--node-id`` with it too).

    Raises:
        InvalidRequestError: empty, or not a node id (:data:`trainguard.names.NODE_ID_RE`); names ``field``.
    """
    if not node_id:
        raise _bad(field, "is required")
    if not NODE_ID_RE.match(node_id):
        raise _bad(field, f"{node_id[:64]!r} is not a valid node id (1-128 of [A-Za-z0-9._:@-], no spaces or '/')")


def _check_port(field: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise _bad(field, f"{port} is not a TCP port (0-65535)")


def validate_register(req: coordinator_pb2.RegisterNodeRequest) -> None:
    """Checks a RegisterNode request's format.

    Raises:
        InvalidRequestError: a field is missing or out of range; the message names it.
    """
    _check_job(req.job)
    n = req.node
    check_node_id("node.node_id", n.node_id)
    if n.replaces:
        check_node_id("node.replaces", n.replaces)
        if n.replaces == n.node_id:
            raise _bad("node.replaces", "names the node itself")
    t = n.topology
    _check_text("node.topology.pod_id", t.pod_id, 128)
    _check_text("node.topology.host", t.host)
    _check_text("node.address", n.address)
    _check_text("agent_instance", req.agent_instance, 64)
    if t.node_index < 0:
        raise _bad("node.topology.node_index", f"is {t.node_index}; it must be >= 0")
    if not 0 <= t.device_count <= MAX_LOCAL_WORKERS:
        raise _bad("node.topology.device_count", f"is {t.device_count}; use 1-{MAX_LOCAL_WORKERS} (0 means 1)")
    if len(t.labels) > _MAX_LABELS:
        raise _bad("node.topology.labels", f"has {len(t.labels)} entries; at most {_MAX_LABELS} are allowed")
    for k, v in t.labels.items():
        _check_text(f"node.topology.labels[{k[:32]!r}]", k + v, 2 * _MAX_TEXT)
    _check_port("node.agent_port", n.agent_port)
    _check_port("free_port", req.free_port)
    _check_qualification(req)


def _check_qualification(req: coordinator_pb2.RegisterNodeRequest | coordinator_pb2.NodeHeartbeatRequest) -> None:
    """Checks the size of a pre-flight verdict (fields 120+)."""
    if not req.HasField("qualification"):
        return
    q = req.qualification
    _check_text("qualification.reason", q.reason, _MAX_EVENT_TEXT)
    _check_port("qualification.echo_port", q.echo_port)
    if not 0 <= q.peer_s < 3600:
        raise _bad("qualification.peer_s", f"is {q.peer_s}; use seconds in [0, 3600)")
    if len(q.checks) > 32:
        raise _bad("qualification.checks", f"has {len(q.checks)} entries; at most 32 are allowed")
    for c in q.checks:
        _check_text("qualification.checks.detail", c.name + c.status + c.detail, _MAX_EVENT_TEXT)


def validate_heartbeat(req: coordinator_pb2.NodeHeartbeatRequest) -> None:
    """Checks a Heartbeat request's format.

    Raises:
        InvalidRequestError: a field is missing or out of range.
    """
    _check_job(req.job)
    check_node_id("node_id", req.node_id)
    if not req.lease_id or len(req.lease_id) > 64:
        raise _bad("lease_id", "is required (the one RegisterNode returned)")
    if req.generation < -1:
        raise _bad("generation", f"is {req.generation}; use -1 when no workers run")
    if req.workers_running < 0:
        raise _bad("workers_running", f"is {req.workers_running}; it must be >= 0")
    if not -1 <= req.last_step <= _MAX_STEP:
        raise _bad("last_step", f"is {req.last_step}; use a step in 0..{_MAX_STEP}, or -1 before the first")
    _check_port("free_port", req.free_port)
    # Relayed to other nodes in their replica targets and restore plans: unchecked, one node's 200 KB or
    # control characters went into every buddy's heartbeat answers and logs.
    _check_text("replica_address", req.replica_address)
    validate_timings(req.timings)
    _check_qualification(req)
    validate_link_results(req.link_results, req.link_probe_port)
    _check_memory(req.memory)


def _check_memory(memory: Sequence[coordinator_pb2.MemoryHolding]) -> None:
    """Checks a heartbeat's in-memory holdings: they were kept unchecked (a negative step, world size 0, ranks
    past the world, thousands of holdings), stored per node and walked for every node's restore plan.

    Raises:
        InvalidRequestError: too many holdings, or one out of range; the message names it.
    """
    if len(memory) > MAX_MEMORY_HOLDINGS:
        raise _bad("memory", f"has {len(memory)} holdings; at most {MAX_MEMORY_HOLDINGS} are allowed")
    for i, h in enumerate(memory):
        if not 0 <= h.step <= _MAX_STEP:
            raise _bad(f"memory[{i}].step", f"is {h.step}; use a step in 0..{_MAX_STEP}")
        if not 1 <= h.world_size <= _MAX_HOLDING_WORLD:
            raise _bad(f"memory[{i}].world_size", f"is {h.world_size}; it must be in 1..{_MAX_HOLDING_WORLD}")
        for name in ("ranks", "replica_ranks"):
            bad = [r for r in getattr(h, name) if not 0 <= r < h.world_size]
            if bad:
                raise _bad(f"memory[{i}].{name}", f"names rank {bad[0]}; a rank of the holding's world size "
                                                  f"{h.world_size} is in 0..{h.world_size - 1}")


def validate_report(req: coordinator_pb2.ReportEventRequest) -> None:
    """Checks a ReportEvent request's format.

    Raises:
        InvalidRequestError: a field is missing or out of range.
    """
    _check_job(req.job)
    check_node_id("node_id", req.node_id)
    if not req.lease_id or len(req.lease_id) > 64:
        raise _bad("lease_id", "is required (the one RegisterNode returned)")
    if req.generation < -1:
        raise _bad("generation", f"is {req.generation}; use -1 when no workers ran")
    if req.failed_rank < -1:
        raise _bad("failed_rank", f"is {req.failed_rank}; use -1 when not about one rank")
    if req.proposed_level not in coordinator_pb2.RecoveryLevel.values():
        raise _bad("proposed_level", f"{req.proposed_level} is not a RecoveryLevel")
    ev = req.event
    _check_text("event.message", ev.message, _MAX_EVENT_TEXT)
    _check_text("event.kind", ev.kind)
    if len(ev.evidence) > 64:
        raise _bad("event.evidence", f"has {len(ev.evidence)} entries; at most 64 are allowed")


def validate_node_health(req: coordinator_pb2.NodeHealthReportRequest) -> None:
    """Checks a ReportNodeHealth request's format.

    Raises:
        InvalidRequestError: a field is missing or out of range.
    """
    if req.job:
        _check_job(req.job)
    check_node_id("node_id", req.node_id)
    _check_text("host", req.host)
    _check_text("reason", req.reason, _MAX_EVENT_TEXT)
    _check_text("agent_instance", req.agent_instance, 64)
    if req.verdict not in coordinator_pb2.NodeHealthVerdict.values() \
            or req.verdict == coordinator_pb2.NODE_HEALTH_VERDICT_UNSPECIFIED:
        raise _bad("verdict", f"{req.verdict} is not a NodeHealthVerdict (HEALTHY, DEGRADED or FATAL)")
    if not 0.0 <= req.risk <= 1.0:
        raise _bad("risk", f"is {req.risk}; it must be in [0, 1]")


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """gRPC servicer for one job.

    Args:
        spec: the job's parameters.
        store: an opened store, or None to open ``spec.store``.
    """

    def __init__(self, spec: JobSpec, store: Store | None = None) -> None:
        self.spec = spec
        self.core = JobCoordinator(spec, store=store)
        self._wire = convert.ResponseCache()
        self._refusals = RefusalLog(log)

    @staticmethod
    def _wait_s(context: grpc.ServicerContext) -> float:
        """How long a call may wait for its write: a little less than its caller waits for the answer.

        A store that hangs (etcd unreachable, a stuck disk) held each handler thread for 30 s while its caller gave
        up after 5 s and retried: registrations and commits took every thread, and heartbeats, which write
        nothing, queued behind them until the leases ran out. Waiting out the caller's deadline whole, the caller's
        own DEADLINE_EXCEEDED came first and the reason ("could not be made durable (...)") never reached it.
        """
        # A servicer called in process (bench/bench_coordinator.py) gets a context without a deadline.
        remaining = getattr(context, "time_remaining", None)
        left = remaining() if remaining is not None else None
        return DURABLE_WAIT_S if left is None else max(0.0, left - min(1.0, left / 4))

    def _durable(self, context: grpc.ServicerContext, fut, what: str) -> None:
        """Waits for a call's write for :meth:`_wait_s`."""
        self.core.wait_durable(fut, what, self._wait_s(context))

    def _refuse(self, context: grpc.ServicerContext, method: str, exc: RecoveryError) -> None:
        code = STATUS_OF.get(type(exc), grpc.StatusCode.FAILED_PRECONDITION) if isinstance(exc, RequestError) \
            else grpc.StatusCode.UNAVAILABLE
        self._refusals.refused(method, code.name, type(exc).__name__,
                               f"refused {method} from {context.peer()}: {code.name}: {exc}")
        context.abort(code, str(exc))

    def RegisterNode(self, request, context):  # noqa: N802 (gRPC naming)
        """Adds (or re-adds) a node; answers once its record is durable."""
        try:
            validate_register(request)
            wait_s = self._wait_s(context)
            lease, gen, fut = self.core.register(request.job, convert.node_record(request.node),
                                                 request.free_port, request.agent_instance,
                                                 convert.qualification(request), hold_s=wait_s)
            self.core.wait_durable(fut, "the registration", wait_s)
            refused = self.core.refusal(request.node.node_id)
            if refused:  # cordoned durably above: a restarted coordinator refuses it the same way
                self.core.registration_refused(request.node.node_id)
                raise NodeRefusedError(refusal_message(request.node.node_id, refused))
            return coordinator_pb2.RegisterNodeResponse(generation=gen, lease_id=lease)
        except RecoveryError as exc:
            self._refuse(context, "RegisterNode", exc)

    def Heartbeat(self, request, context):  # noqa: N802
        """Records progress; answers with the node's command (START only once its generation is durable)."""
        try:
            validate_heartbeat(request)
            reply = self.core.answered(convert.beat(request), hold_s=self._wait_s(context))
            return self._wire.response(reply.response)
        except RecoveryError as exc:
            self._refuse(context, "Heartbeat", exc)

    def ReportEvent(self, request, context):  # noqa: N802
        """Decides the recovery for a reported event; duplicates of a handled fault change nothing."""
        try:
            validate_report(request)
            wait_s = self._wait_s(context)
            level, gen, msg, fut = self.core.report(convert.fault_report(request), hold_s=wait_s)
            self.core.wait_durable(fut, "the recovery decision", wait_s)
            return coordinator_pb2.ReportEventResponse(decided_level=int(level), new_generation=gen, message=msg)
        except RecoveryError as exc:
            self._refuse(context, "ReportEvent", exc)

    def QualifyPeers(self, request, context):  # noqa: N802
        """A few qualified peers for a qualifying node's timed exchange, and the reference time."""
        try:
            _check_job(request.job)
            check_node_id("node_id", request.node_id)
            if not 0 <= request.count <= 16:
                raise _bad("count", f"is {request.count}; use 0-16")
            peers, reference, history = self.core.qualify_peers(request.job, request.node_id, request.count)
            return coordinator_pb2.QualifyPeersResponse(
                peers=[coordinator_pb2.QualifyPeer(node_id=n, address=a, port=p) for n, a, p in peers],
                reference_s=reference, history=history)
        except RecoveryError as exc:
            self._refuse(context, "QualifyPeers", exc)

    def GetRankTable(self, request, context):  # noqa: N802
        """The current generation's full rank table (empty before the first generation forms)."""
        try:
            _check_job(request.job)
            table = self.core.rank_table(request.job)
            return self._wire.full_table(table) if table is not None else convert.rank_table(None, request.job)
        except RecoveryError as exc:
            self._refuse(context, "GetRankTable", exc)

    def CommitCheckpoint(self, request, context):  # noqa: N802
        """Records a node's committed checkpoint step; returns the step every node has committed."""
        try:
            _check_job(request.job)
            check_node_id("node_id", request.node_id)
            _check_text("lease_id", request.lease_id)
            if not 0 <= request.step <= _MAX_STEP:
                raise _bad("step", f"is {request.step}; use a step in 0..{_MAX_STEP}")
            step, fut = self.core.commit_checkpoint(request.job, request.node_id, request.step, request.lease_id)
            self._durable(context, fut, "the checkpoint commit")
            return coordinator_pb2.CommitCheckpointResponse(last_committed_step=step)
        except RecoveryError as exc:
            self._refuse(context, "CommitCheckpoint", exc)

    def ReportNodeHealth(self, request, context):  # noqa: N802
        """Records a node daemon's verdict; a FATAL one cordons the node (answered once that is durable)."""
        try:
            validate_node_health(request)
            cordoned, msg, fut = self.core.report_node_health(convert.node_health_report(request))
            self._durable(context, fut, "the cordon")
            return coordinator_pb2.NodeHealthReportResponse(cordoned=cordoned, message=msg,
                                                            interval_s=self.core.report_interval_s())
        except RecoveryError as exc:
            self._refuse(context, "ReportNodeHealth", exc)

    def UncordonNode(self, request, context):  # noqa: N802
        """An operator returns a cordoned node to service (answered once that is durable)."""
        try:
            _check_job(request.job)
            # A slot holder whose node record was lost is cordoned as ``?lost-record-<digest>`` (see job_records):
            # no node can register under that id, but the operator must be able to clear it from the cordon list.
            if not LOST_RECORD_RE.fullmatch(request.node_id):
                check_node_id("node_id", request.node_id)
            _check_text("reason", request.reason, _MAX_EVENT_TEXT)
            done, msg, fut = self.core.uncordon(request.job, request.node_id, request.reason)
            self._durable(context, fut, "the uncordon")
            return coordinator_pb2.UncordonNodeResponse(uncordoned=done, message=msg)
        except RecoveryError as exc:
            self._refuse(context, "UncordonNode", exc)

    def LeaveNode(self, request, context):  # noqa: N802
        """A node leaves: its lease ends now (answered once its record is durable)."""
        try:
            _check_job(request.job)
            check_node_id("node_id", request.node_id)
            _check_text("lease_id", request.lease_id)
            _check_text("reason", request.reason, _MAX_EVENT_TEXT)
            msg, fut = self.core.leave(request.job, request.node_id, request.lease_id, request.reason)
            self._durable(context, fut, "the leave")
            return coordinator_pb2.LeaveNodeResponse(message=msg)
        except RecoveryError as exc:
            self._refuse(context, "LeaveNode", exc)


def build_grpc_server(max_workers: int, interceptors: Sequence[grpc.ServerInterceptor] = (),
                      auth: Sequence[grpc.ServerInterceptor] = ()) -> grpc.Server:
    """The coordinator's gRPC server: ``auth`` first, then the shared request guards (the coordinator's service,
    the health service), then ``interceptors``.

    Authentication runs before the guard so an unauthenticated caller is refused (UNAUTHENTICATED) before any
    of its bytes are parsed.

    Args:
        max_workers: handler threads.
        interceptors: more server interceptors (metrics...), run after the guard.
        auth: authentication interceptors (the job token check), run before the guard.

    Returns:
        The server, with no service or port added yet.
    """
    guard = RequestGuard(COORDINATOR_SERVICE, MAX_REQUEST_BYTES)
    health = HealthGuard(HEALTH_MAX_REQUEST_BYTES)  # random bytes there: INVALID_ARGUMENT, not INTERNAL + traceback
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="coordinator"),
        interceptors=[*auth, guard, health, *interceptors],
        options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                 ("grpc.so_reuseport", 0)],
    )


class CoordinatorServer:
    """A coordinator for one job served over gRPC, with its lease reaper.

    Args:
        spec: the job's parameters (``spec.store`` picks the store unless ``store`` is given).
        listen: ``host:port`` to bind (port 0 picks a free one).
        store: an opened store to use instead of ``spec.store``.
        max_workers: gRPC handler threads (handlers wait on group commits, so more threads mean bigger batches).
        interceptors: server interceptors run after the token check and the shared request guard (see
            :func:`build_grpc_server`).
        security: TLS / mutual TLS and the job token (:mod:`trainguard.recovery.rpc_security`); None: plaintext,
            no token.

    Raises:
        CoordinatorError: the address cannot be bound.
        StoreError: the store cannot be opened or holds corrupt state.
        SecurityConfigError: a TLS file is unreadable or does not match its key.
    """

    def __init__(self, spec: JobSpec, listen: str = "127.0.0.1:0", store: Store | None = None,
                 max_workers: int = 256, interceptors: Sequence[grpc.ServerInterceptor] = (),
                 security: "RpcSecurity | None" = None) -> None:
        from trainguard.recovery.observe import CoordinatorWatch
        from trainguard.recovery.rpc_security import RpcSecurity

        security = security or RpcSecurity()
        host, _, port_text = listen.rpartition(":")
        if port_text.isdigit() and not can_listen(host, int(port_text)):
            # Said before gRPC tries: its own failure is a raw C++ log line on stderr ahead of this message.
            raise CoordinatorError(f"cannot listen on {listen}: address in use (another coordinator, or another "
                                   "program); pick another --listen address")
        self._server = build_grpc_server(max_workers, interceptors, auth=security.server_interceptors())
        # The port is bound before the store is opened: opening it takes the job's fence, and a second
        # coordinator started on a port in use took it before failing, so the running one stopped at its next
        # write ("another coordinator took over") and nobody owned the job.
        try:
            self.port = security.add_port(self._server, listen)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise CoordinatorError(f"cannot listen on {listen}: address in use or not local; pick another "
                                   "--listen address")
        try:
            self.service = CoordinatorService(spec, store=store)
        except BaseException:
            self._server.stop(None)  # release the port
            raise
        self.core = self.service.core
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.service, self._server)
        self.watch = CoordinatorWatch(self.core)  # grpc.health.v1, cordon events, recovery times
        self.watch.health.add_to_server(self._server)
        self.host = listen.rsplit(":", 1)[0]
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="coordinator-reaper", daemon=True)

    @property
    def target(self) -> str:
        """``host:port`` clients dial (an IPv6 literal in brackets: gRPC cannot dial ``::1:29400``)."""
        host = self.host.strip("[]")
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _reap(self) -> None:
        period = min(0.5, self.core.spec.lease_timeout_s / 4)
        while not self._stop.wait(period):
            try:
                self.core.reap()
            except RecoveryError as exc:
                log.error("lease reaper: %s", exc)

    def start(self) -> "CoordinatorServer":
        """Starts serving; returns self."""
        self._server.start()
        self._reaper.start()
        self.watch.start()
        return self

    def stop(self, grace_s: float = 0.5) -> None:
        """Stops serving, waits for in-flight calls up to ``grace_s`` seconds, flushes the store."""
        self._stop.set()
        self.watch.stop()
        self._server.stop(grace_s).wait()
        if self._reaper.is_alive():
            self._reaper.join(timeout=5)
        self.core.close()

