"""Guards in front of the NodeAgent gRPC methods: request size, well-formedness, field ranges, stream count.

The shared server interceptor (:mod:`trainguard.grpc_guard`, also in front of the coordinator) re-wraps each
guarded method so that the handler receives the request *bytes* first:

1. more than ``max_request_bytes`` -> INVALID_ARGUMENT, before anything is parsed (gRPC's own transport cap,
   ``max_message_bytes``, still drops far larger messages with RESOURCE_EXHAUSTED before they are read);
2. bytes that do not parse as the request message -> INVALID_ARGUMENT;
3. a field out of range (negative rank, unknown severity, absurd replay count...) -> INVALID_ARGUMENT naming it;
4. more than ``max_watchers`` concurrent server streams -> RESOURCE_EXHAUSTED, so watchers cannot take every
   serving thread away from health checks. Server reflection streams (grpcurl) count against the same bound:
   each holds a serving thread while it is open, idle or not.

Each call is counted in the agent's metrics by method and status code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from trainguard.grpc_guard import (
    HEALTH_SERVICE,
    CallObserver,
    HealthGuard,
    RequestGuard as SharedRequestGuard,
    Validator,
)
from trainguard.proto import agent_pb2, common_pb2
from trainguard.recovery.rpc_security import SecurityConfigError, check_token
from trainguard.steps import MAX_STEP

#: Service whose methods are guarded.
GUARDED_SERVICE = "trainguard.v1.NodeAgent"
#: Largest ``max_events`` a GetHealth may ask for.
MAX_HEALTH_EVENTS = 1000
#: Largest ``replay`` a WatchEvents may ask for.
MAX_REPLAY = 10_000
#: Most advisory ids one WorkerHeartbeat may acknowledge (the hook sends those of its latest answers: a few).
MAX_ACKED_ADVISORIES = 64
#: Checkpoint tiers a worker may report ("snapshot": copied out of the model, not yet in any tier).
CHECKPOINT_TIERS = ("snapshot", "memory", "disk", "remote")
#: Largest AttachJob request, whatever ``max_request_bytes`` says: it carries the launcher's coordinator TLS files'
#: contents, up to 1 MiB each (``health_source.MAX_PEM_BYTES``: a CA bundle of a few hundred certificates, like a
#: system bundle of 200 KiB, must fit), and the daemon serves it on its unix socket only.
ATTACH_MAX_REQUEST_BYTES = 3 * (1 << 20) + 64 * 1024
#: Method prefixes of the server reflection services, whose bidirectional streams count as watchers.
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")

def _finite_nonneg(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _check_get_health(req: agent_pb2.GetHealthRequest) -> str | None:
    if not 0 <= req.max_events <= MAX_HEALTH_EVENTS:
        return f"max_events={req.max_events} is outside [0, {MAX_HEALTH_EVENTS}]"
    return None


def _check_watch(req: agent_pb2.WatchEventsRequest) -> str | None:
    if not 0 <= req.replay <= MAX_REPLAY:
        return f"replay={req.replay} is outside [0, {MAX_REPLAY}]"
    if req.min_severity not in common_pb2.Severity.values():
        return f"min_severity={req.min_severity} is not a Severity value"
    return None


def _check_heartbeat(req: agent_pb2.WorkerHeartbeatRequest) -> str | None:
    if req.rank < 0:
        return f"rank={req.rank} is negative"
    if req.pid <= 0:
        return f"pid={req.pid} is not a process id"
    if req.generation < 0:
        return f"generation={req.generation} is negative"
    # The coordinator's bound: a step past it, taken here, made every heartbeat of the node to the coordinator
    # invalid, and the node lost its lease and its slot in the job.
    if not -1 <= req.step <= MAX_STEP:
        return f"step={req.step} is outside -1..{MAX_STEP} (2**53-1)"
    if not _finite_nonneg(req.step_time_s):
        return f"step_time_s={req.step_time_s} is not a finite non-negative number"
    if len(req.section_s) > 16:
        return f"section_s has {len(req.section_s)} entries; at most 16 section names are allowed"
    for name, value in req.section_s.items():
        if not _finite_nonneg(value):
            return f"section_s[{name[:32]!r}]={value} is not a finite non-negative number"
    if len(req.acked_advisory_ids) > MAX_ACKED_ADVISORIES:
        return (f"acked_advisory_ids has {len(req.acked_advisory_ids)} entries; "
                f"at most {MAX_ACKED_ADVISORIES} are allowed")
    if any(len(i) > 64 for i in req.acked_advisory_ids):
        return "acked_advisory_ids entries must be at most 64 characters"
    return None


def _check_checkpoint(req: agent_pb2.CheckpointReport) -> str | None:
    if req.rank < 0:
        return f"rank={req.rank} is negative"
    if not 0 <= req.step <= MAX_STEP:  # kept as the node's last checkpoint step: one past it hid every later one
        return f"step={req.step} is outside 0..{MAX_STEP} (2**53-1)"
    if req.tier not in CHECKPOINT_TIERS:
        return f"tier={req.tier[:40]!r} is not one of {', '.join(CHECKPOINT_TIERS)}"
    if req.bytes < 0:
        return f"bytes={req.bytes} is negative"
    if not (_finite_nonneg(req.stall_s) and _finite_nonneg(req.persist_s)):
        return "stall_s and persist_s must be finite non-negative numbers"
    return None


#: Longest text fields of an AttachJob, in characters: host names, HOST:PORT, a token, file paths. Only the PEM
#: contents need the method's larger size bound; the rest go into logs, events and every health report.
ATTACH_FIELD_LIMITS = {"node_id": 253, "coordinator": 512, "token": 4096, "tls_server_name": 253,
                       "tls_ca_file": 4096, "tls_cert_file": 4096, "tls_key_file": 4096, "arena_root": 4096}


def _check_attach(req: agent_pb2.AttachJobRequest) -> str | None:
    for name, limit in ATTACH_FIELD_LIMITS.items():
        value = getattr(req, name)
        if len(value) > limit:
            return f"{name} is {len(value)} characters; at most {limit}"
        # Accepted, a NUL cut the coordinator's dial target short and went raw into the daemon's log, and a
        # newline in the token failed every report later with "Invalid metadata", long after the attach said OK.
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            return f"{name} contains control characters"
    if req.token:
        try:
            check_token(req.token, "token")  # the coordinator's rule: a short token is refused there, every report
        except SecurityConfigError as exc:
            return str(exc)
    return None


#: Method full name -> range check of its decoded request (returns a problem, or None).
VALIDATORS: dict[str, Validator] = {
    f"/{GUARDED_SERVICE}/GetHealth": _check_get_health,
    f"/{GUARDED_SERVICE}/WatchEvents": _check_watch,
    f"/{GUARDED_SERVICE}/WorkerHeartbeat": _check_heartbeat,
    f"/{GUARDED_SERVICE}/ReportCheckpoint": _check_checkpoint,
    f"/{GUARDED_SERVICE}/AttachJob": _check_attach,
}

class RequestGuard(SharedRequestGuard):
    """The shared request guard (:mod:`trainguard.grpc_guard`) on the NodeAgent service, with its checks."""

    def __init__(
        self,
        max_request_bytes: int,
        max_watchers: int,
        observer: CallObserver | None = None,
        validators: Mapping[str, Validator] | None = None,
    ) -> None:
        """Creates the guard.

        Args:
            max_request_bytes: largest accepted request, in bytes.
            max_watchers: concurrent server-streaming calls allowed, half of them at most from TCP peers.
            observer: called once per finished call (e.g. ``AgentMetrics.observe_request``).
            validators: per-method checks; default :data:`VALIDATORS`.
        """
        # Half the streams at most to TCP peers, which need no credentials: the other half stays for launchers
        # (unix socket), whose stream carries the node's hardware and predictor events to their jobs.
        super().__init__(GUARDED_SERVICE, max_request_bytes, max_watchers, observer,
                         VALIDATORS if validators is None else validators,
                         max_remote_watchers=max(1, max_watchers // 2))
        # The same checks on AttachJob with its own size bound (see ATTACH_MAX_REQUEST_BYTES).
        self._attach = SharedRequestGuard(GUARDED_SERVICE, max(max_request_bytes, ATTACH_MAX_REQUEST_BYTES), 0,
                                          observer, VALIDATORS if validators is None else validators)
        # Size and well-formedness on the health service too: gRPC's own deserializer answered random bytes there
        # with INTERNAL and an ERROR traceback in the daemon's log per request, from anyone reaching the TCP port.
        self._health = HealthGuard(max_request_bytes)

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        """Guards the NodeAgent methods (see the module docstring) and bounds the reflection streams."""
        if details.method == f"/{GUARDED_SERVICE}/AttachJob":
            return self._attach.intercept_service(continuation, details)
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return self._health.intercept_service(continuation, details)
        if not details.method.startswith(REFLECTION_PREFIXES):
            return super().intercept_service(continuation, details)
        handler = continuation(details)
        if handler is None or handler.stream_stream is None:
            return handler
        return grpc.stream_stream_rpc_method_handler(
            self._bounded_stream(handler.stream_stream, handler.request_deserializer),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )

    def _bounded_stream(self, behavior: Callable, deserialize: Callable) -> Callable:
        # A reflection stream holds a serving thread for as long as the client keeps it open: unbounded, a few
        # idle grpcurl sessions (or anyone who can connect) would leave no thread for health checks, and the
        # daemon's own self-check would then withhold the systemd watchdog pings. Its messages arrive as bytes
        # and are checked as every guarded request is (size, then well-formedness: INVALID_ARGUMENT).
        streams = self._streams

        def guarded(raw_requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            if streams is not None and not streams.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "too many concurrent streams; retry later or raise grpc.max_watchers")
            try:
                requests = (self._decode(raw, deserialize, None, context) for raw in raw_requests)
                yield from behavior(requests, context)
            finally:
                if streams is not None:
                    streams.release()

        return guarded
