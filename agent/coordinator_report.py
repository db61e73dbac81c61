"""The node daemon's health reports to coordinators: the node's verdict, every interval, between jobs too.

The daemon (``trainguard agent``) runs the node's detectors and predictor whether a job runs or not. Each
coordinator it knows of, from its configuration (``[coordinator] address``/``addresses``) or from a job that
``trainguard run`` attached (``AttachJob``), gets the node's verdict on its own thread through
``Coordinator.ReportNodeHealth``; the coordinator cordons a node whose verdict is FATAL and never starts a
generation on it (:mod:`trainguard.recovery.node_health`).

The verdict (:class:`NodeVerdictLatch`): the first node-level fault event (action DRAIN_NODE or more, severity
ERROR or more: a fatal AER error, a GPU gone, a link down) latches FATAL with that event's message as the
reason, until the daemon restarts (an operator repairs the node, then restarts its daemon); a predictor score
at or above the configured threshold is DEGRADED (reported, never cordoned); else HEALTHY.

One reporter's states::

    CONNECTING --ok--> REPORTING --coordinator says cordoned--> CORDONED
        |  ^              |   ^  <--back in service (trainguard uncordon)--'
        |  ^              |   ^                                   |
        |  '---- ok ------+   '------------ ok ------ UNREACHABLE <'  (a call failing)
        '--fail--> UNREACHABLE          (REFUSED likewise: the coordinator answered with a refusal)
    any --stop()--> STOPPED

A coordinator that cannot be reached, or refuses the reports (bad credentials, a request it rejects), is retried
every interval and logged once per outage, naming the status code and what it means; it never stops the daemon.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from trainguard.agent.coordinator_link import (client_cert_refused, client_cert_refused_message, foreign_listener,
                                               foreign_listener_message, speaks_tls, tls_peer_message,
                                               untrusted_peer, untrusted_peer_message)
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import coordinator_pb2, coordinator_pb2_grpc
from trainguard.recovery.node_health import Verdict
from trainguard.recovery.rpc_security import RpcSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeVerdict:
    """The daemon's verdict on its node at one instant.

    Attributes:
        verdict: HEALTHY, DEGRADED or FATAL.
        reason: one line saying why ("" when healthy).
        risk: the predictor's score in [0, 1].
        cause: the event behind a FATAL verdict, if any.
    """

    verdict: Verdict
    reason: str = ""
    risk: float = 0.0
    cause: HealthEvent | None = None


class NodeVerdictLatch:
    """Turns the daemon's event stream and predictor score into the node's verdict; thread-safe."""

    def __init__(self) -> None:
        """Creates a latch that says HEALTHY until a node-level fault arrives."""
        self._lock = threading.Lock()
        self._fatal: HealthEvent | None = None

    @staticmethod
    def is_node_fault(event: HealthEvent) -> bool:
        """Whether ``event`` says the node itself is broken (the daemon's own events never are, and a prediction
        is a risk, reported as DEGRADED through the score, not a fault)."""
        return (event.source not in ("agent", "predictor") and event.action >= Action.DRAIN_NODE
                and event.severity >= Severity.ERROR)

    def observe(self, event: HealthEvent) -> bool:
        """Feeds one event; returns True when it latched the node FATAL (the first node-level fault)."""
        if not self.is_node_fault(event):
            return False
        with self._lock:
            if self._fatal is not None:
                return False
            self._fatal = event
        log.error("node verdict FATAL: %s: %s", event.kind, event.message)
        return True

    def verdict(self, risk: float = 0.0, threshold: float = 1.0) -> NodeVerdict:
        """The verdict now, given the predictor's latest score and the configured alarm threshold."""
        with self._lock:
            fatal = self._fatal
        if fatal is not None:
            return NodeVerdict(Verdict.FATAL, f"{fatal.kind}: {fatal.message}", risk, fatal)
        if threshold > 0 and risk >= threshold:  # a NaN threshold or risk (no score yet) compares False
            return NodeVerdict(Verdict.DEGRADED, f"predicted failure risk {risk:.2f} >= {threshold:.2f}", risk)
        return NodeVerdict(Verdict.HEALTHY, "", risk)


@dataclass(frozen=True)
class ReportTarget:
    """One coordinator the daemon reports to.

    Attributes:
        address: ``HOST:PORT`` of the coordinator.
        job: job name sent with each report; ``""`` means the job that coordinator serves.
        node_id: node id to report under; ``""`` means the daemon's own ``agent.node_id`` (a launcher that
            attached with its own ``--node-id`` is reported under that one).
        security: TLS files and job token of the connection.
        origin: what asked for it, for logs: ``"config"`` or ``"job <name>"``.
    """

    address: str
    job: str = ""
    node_id: str = ""
    security: RpcSecurity = field(default_factory=RpcSecurity)
    origin: str = "config"


class ReporterState(enum.Enum):
    """Where one reporter stands with its coordinator."""

    CONNECTING = "connecting"
    REPORTING = "reporting"
    CORDONED = "cordoned"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"  #: it answers, and refuses the reports (see :data:`REFUSALS`)
    STOPPED = "stopped"


#: Status codes by which a coordinator that answered refuses a report, and what each means to an operator
#: (any other failure is UNREACHABLE).
REFUSALS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAUTHENTICATED: "bad or missing credentials: check the job token (token_file) the coordinator "
                                     "requires",
    grpc.StatusCode.PERMISSION_DENIED: "credentials not allowed: check the token and client certificate",
    grpc.StatusCode.INVALID_ARGUMENT: "the coordinator refused the request: check the node id and job name",
    grpc.StatusCode.NOT_FOUND: "the coordinator does not know the job: check the job name",
    grpc.StatusCode.FAILED_PRECONDITION: "the coordinator refused the request in its present state",
    # A gRPC server answers there, but no coordinator's service: the coordinator's plaintext --health-listen port
    # or a node agent's are the usual wrong addresses; an old coordinator the rare cause.
    grpc.StatusCode.UNIMPLEMENTED: "no coordinator's ReportNodeHealth there: check the address (not the "
                                   "coordinator's --health-listen port, not a node agent's), or upgrade an older "
                                   "coordinator",
}


_S = ReporterState
#: Allowed moves; anything else is a bug in this module.
TRANSITIONS: dict[ReporterState, frozenset[ReporterState]] = {
    _S.CONNECTING: frozenset({_S.REPORTING, _S.CORDONED, _S.UNREACHABLE, _S.REFUSED, _S.STOPPED}),
    _S.REPORTING: frozenset({_S.REPORTING, _S.CORDONED, _S.UNREACHABLE, _S.REFUSED, _S.STOPPED}),
    # An operator may return the node to service while this daemon keeps reporting (trainguard uncordon).
    _S.CORDONED: frozenset({_S.CORDONED, _S.REPORTING, _S.UNREACHABLE, _S.REFUSED, _S.STOPPED}),
    _S.UNREACHABLE: frozenset({_S.UNREACHABLE, _S.REFUSED, _S.REPORTING, _S.CORDONED, _S.STOPPED}),
    _S.REFUSED: frozenset({_S.REFUSED, _S.UNREACHABLE, _S.REPORTING, _S.CORDONED, _S.STOPPED}),
    _S.STOPPED: frozenset({_S.STOPPED}),
}


class CoordinatorReporter:
    """Reports the node's verdict to one coordinator every interval, on its own thread.

    Args:
        target: the coordinator.
        verdict: returns the verdict now (called on the reporter's thread).
        node_id: the daemon's node id (used when ``target.node_id`` is empty).
        host: this host's name (the scheduler's node name, for the coordinator's cordon hooks).
        instance: random id of this daemon process.
        interval_s: seconds between reports (the coordinator may ask for another interval).
        timeout_s: deadline of each call, seconds.
    """

    def __init__(self, target: ReportTarget, verdict: Callable[[], NodeVerdict], node_id: str, host: str,
                 instance: str, interval_s: float = 2.0, timeout_s: float = 5.0) -> None:
        self.target = target
        self.node_id = target.node_id or node_id
        self._verdict = verdict
        self._host = host
        self._instance = instance
        self.interval_s = interval_s
        self.configured_interval_s = interval_s
        self._asked_interval_s = 0.0  # what the coordinator last asked for (it may stretch intervals)
        self.timeout_s = timeout_s
        self.state = ReporterState.CONNECTING
        self.message = ""
        self.reports = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._thread = threading.Thread(target=self._run, name=f"report-{target.address}", daemon=True)

    def _move(self, new: ReporterState, message: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            raise AssertionError(f"reporter {self.target.address}: {self.state.name} -> {new.name} is not allowed")
        if new is ReporterState.UNREACHABLE and self.state is not ReporterState.UNREACHABLE:
            log.warning("coordinator %s (%s) unreachable: %s; retrying every %.1f s", self.target.address,
                        self.target.origin, message, self.interval_s)
        elif new is ReporterState.REFUSED and self.state is not ReporterState.REFUSED:
            log.warning("coordinator %s (%s) refuses node %s's health reports: %s; retrying every %.1f s",
                        self.target.address, self.target.origin, self.node_id, message, self.interval_s)
        elif new is ReporterState.CORDONED and self.state is not ReporterState.CORDONED:
            log.warning("coordinator %s (%s) cordoned node %s: %s", self.target.address, self.target.origin,
                        self.node_id, message)
        elif new is ReporterState.REPORTING and self.state is ReporterState.CORDONED:
            log.warning("coordinator %s (%s) returned node %s to service", self.target.address, self.target.origin,
                        self.node_id)
        elif new is ReporterState.REPORTING and self.state is not ReporterState.REPORTING:
            log.info("reporting node %s health to coordinator %s (%s)", self.node_id, self.target.address,
                     self.target.origin)
        self.state, self.message = new, message

    def start(self) -> "CoordinatorReporter":
        """Starts the reporting thread; returns self.

        Raises:
            SecurityConfigError: a TLS file of the target is unreadable.
        """
        self._channel = self.target.security.channel(self.target.address)
        self._thread.start()
        return self

    def poke(self) -> None:
        """Reports now instead of at the next interval (the verdict just changed)."""
        self._wake.set()

    def set_timing(self, interval_s: float, timeout_s: float) -> None:
        """Applies reloaded settings now: the report waiting out the old interval (600 s, say) is sent at once
        and the next ones follow the new interval, still never shorter than the coordinator asked for."""
        self.configured_interval_s, self.timeout_s = interval_s, timeout_s
        self.interval_s = max(interval_s, self._asked_interval_s)
        self.poke()

    def stop(self) -> None:
        """Stops reporting and closes the channel (idempotent).

        The channel is closed before the thread is joined: closing cancels a report in flight, which a coordinator
        that accepted the call and never answers (its host frozen) held for ``timeout_s``; callers stop reporters
        from the main loop, a launcher's DetachJob and the daemon's SIGTERM, none of which may wait that long.
        """
        self._stop.set()
        self._wake.set()
        channel = self._channel
        if channel is not None:
            channel.close()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 2)
        self._channel = None
        if self.state is not ReporterState.STOPPED:
            self._move(ReporterState.STOPPED)

    def report_once(self) -> None:
        """Sends one report and updates the state from the answer (a refusal, :data:`REFUSALS`, becomes REFUSED;
        any other error UNREACHABLE)."""
        assert self._channel is not None, "start() first"
        v = self._verdict()
        req = coordinator_pb2.NodeHealthReportRequest(
            job=self.target.job, node_id=self.node_id, host=self._host, verdict=int(v.verdict),
            reason=v.reason[:4000], risk=min(max(v.risk, 0.0), 1.0) if v.risk == v.risk else 0.0,
            agent_instance=self._instance)
        if v.cause is not None:
            req.cause.CopyFrom(v.cause.to_proto())
        try:
            resp = coordinator_pb2_grpc.CoordinatorStub(self._channel).ReportNodeHealth(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if self._stop.is_set():
                return  # cancelled by stop(): the coordinator is not unreachable
            meaning = REFUSALS.get(exc.code())
            untrusted = untrusted_peer(exc.code(), exc.details() or "")
            tls_problem = self._tls_problem(exc.details() or "")
            foreign = foreign_listener(exc.code(), exc.details() or "") if meaning is None else None
            if foreign is not None:
                # Another program answers there (an HTTP server, a node agent): not an outage to wait out.
                self._move(ReporterState.REFUSED, foreign_listener_message(
                    self.target.address, foreign, exc.details() or "", "coordinator.address (or the job's "
                    "--coordinator)"))
            elif untrusted is not None:
                # Not an outage ("unreachable" with gRPC's whole error): this node's CA does not fit the
                # coordinator's certificate, and retrying will not change that; say what to do.
                self._move(ReporterState.REFUSED, untrusted_peer_message(self.target.address, untrusted))
            elif tls_problem:
                self._move(ReporterState.REFUSED, tls_problem)
            elif meaning is None:
                self._move(ReporterState.UNREACHABLE, f"{exc.code().name}: {exc.details()}")
            else:
                self._move(ReporterState.REFUSED, f"{exc.code().name} ({meaning}): {exc.details()}")
            return
        self.reports += 1
        # The coordinator may ask for a longer interval (it stretches intervals to bound its load), never shorter.
        self._asked_interval_s = resp.interval_s
        self.interval_s = max(self.configured_interval_s, resp.interval_s)
        self._move(ReporterState.CORDONED if resp.cordoned else ReporterState.REPORTING, resp.message)

    def _tls_problem(self, details: str) -> str:
        """What is wrong with TLS between this daemon and the coordinator when a call failed with gRPC's bare
        "Socket closed" (also what a coordinator killed mid-connection gives): it serves TLS and the daemon dials
        in plaintext, or it refuses the daemon's client certificate; "" when neither (an outage)."""
        if "Socket closed" not in details:
            return ""
        sec, address = self.target.security, self.target.address
        if not sec.client_tls:
            return tls_peer_message(address) if speaks_tls(address) else ""
        if client_cert_refused(address, sec.tls.cert_file, sec.tls.key_file):
            return client_cert_refused_message(address, bool(sec.tls.cert_file))
        return ""

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.report_once()
            except Exception:  # noqa: BLE001 (a reporter bug must never take the daemon down)
                if self._stop.is_set():
                    return  # stop() closed the channel under this report (a call on a closed channel raises)
                log.exception("reporting to coordinator %s failed", self.target.address)
            self._wake.wait(self.interval_s)
            self._wake.clear()


__all__ = ["REFUSALS", "CoordinatorReporter", "NodeVerdict", "NodeVerdictLatch", "ReportTarget", "ReporterState",
           "TRANSITIONS"]
