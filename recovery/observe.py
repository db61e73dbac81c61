"""What the coordinator shows the outside: ``grpc.health.v1``, Prometheus ``/metrics`` and cordon events.

A :class:`CoordinatorWatch` thread samples the coordinator every :data:`WATCH_PERIOD_S` seconds through its
read-only views (``state``, ``members()``, ``fenced``), so none of this adds a line to the decision code:

- health: ``""`` and ``trainguard.v1.Coordinator`` are SERVING while the coordinator owns its job's store, and
  NOT_SERVING once another coordinator fenced it off or it is stopping;
- cordons: a node newly in the policy's cordon list is handed to the cordon listeners (the scheduler hooks of
  :mod:`trainguard.recovery.cordon`); after a restart every node already cordoned is handed over once again
  (hooks are idempotent, and a crash between the decision and the hook must not lose the cordon);
- recovery times: from the failure report that started a restart (the policy keeps each report's time) to the
  first sample where the job runs the new generation (resolution one watch period). The node agents' own
  ``trainguard_run_recovery_seconds`` runs to the first resumed training step.

Metrics (all read at scrape time, except the recovery histogram):

=============================================  =======  ====================================================
name                                           type     meaning
=============================================  =======  ====================================================
trainguard_coordinator_info{version,job}       gauge    1
trainguard_job_phase{phase}                    gauge    1 for the current phase (forming, running, ...)
trainguard_job_generation                      gauge    current generation (0 before the first one)
trainguard_job_restarts_total                  counter  restarts spent
trainguard_job_max_restarts                    gauge    restart budget
trainguard_job_nodes{state}                    gauge    members alive / lost / cordoned
trainguard_job_nodes_required                  gauge    nodes the job needs
trainguard_job_recovery_seconds                histo    failure report -> the next generation running
trainguard_coordinator_fenced                  gauge    1 once another coordinator took the job over
trainguard_cordon_hook_runs_total{hook,result} counter  scheduler cordon attempts (ok / error)
trainguard_node_daemons{verdict}               gauge    nodes by their daemon's latest verdict, and ``silent``
                                                        (no report for 3 report intervals; never cordoned)
=============================================  =======  ====================================================
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainguard._version import __version__
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from trainguard.recovery.cordon import CordonTarget
from trainguard.recovery.node_health import Verdict
from trainguard.recovery.policy import Phase

if TYPE_CHECKING:  # pragma: no cover
    import grpc

    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.cordon import CordonDispatcher

log = logging.getLogger(__name__)

#: Full name of the coordinator's gRPC service (a health service name too).
COORDINATOR_SERVICE = "trainguard.v1.Coordinator"
#: Seconds between two samples of the coordinator's state.
WATCH_PERIOD_S = 0.25
_RECOVERY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class _ListingServicer(health.HealthServicer):
    """The stock servicer plus ``List``, which it leaves unimplemented: each ``List`` (no token needed) was
    answered UNIMPLEMENTED with a traceback in the coordinator's log."""

    def __init__(self, owner: "ServingStatus") -> None:
        super().__init__(experimental_non_blocking=True)
        self._owner = owner

    def List(self, request, context):  # noqa: N802 (gRPC naming)
        reply = health_pb2.HealthListResponse()
        status = self._owner.status()
        for name in self._owner.services:
            reply.statuses[name].status = status
        return reply


class ServingStatus:
    """A ``grpc.health.v1`` servicer with one SERVING / NOT_SERVING flag for a fixed set of service names.

    Args:
        services: the names served (``""`` is the whole server).
    """

    def __init__(self, services: tuple[str, ...]) -> None:
        self.servicer = _ListingServicer(self)
        self.services = services
        self._lock = threading.Lock()
        self._serving: bool | None = None
        self._stopped = False
        self.set(False)

    def set(self, serving: bool) -> None:
        """Sets every service's status; ignored after :meth:`shutdown`."""
        with self._lock:
            if self._stopped or serving == self._serving:
                return
            self._serving = serving
            status = self.status()
            for name in self.services:
                self.servicer.set(name, status)

    @property
    def serving(self) -> bool:
        """The current status."""
        return bool(self._serving)

    def status(self) -> int:
        """The current status as a ``HealthCheckResponse`` value."""
        return health_pb2.HealthCheckResponse.SERVING if self._serving else health_pb2.HealthCheckResponse.NOT_SERVING

    def shutdown(self) -> None:
        """NOT_SERVING for good (a graceful stop)."""
        self.set(False)
        with self._lock:
            self._stopped = True
        self.servicer.enter_graceful_shutdown()

    def add_to_server(self, server) -> None:
        """Registers the health service on a gRPC server (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)


def serve_health_only(status: ServingStatus, listen: str, name: str) -> tuple["grpc.Server", int]:
    """Starts a plaintext gRPC server that serves only ``grpc.health.v1`` (Kubernetes' gRPC probes cannot speak
    TLS, and health answers carry no job data).

    Args:
        status: the health servicer to expose.
        listen: ``host:port`` to bind.
        name: thread-name prefix of the server's handlers.

    Returns:
        The started server and its port.

    Raises:
        UsageError: ``listen`` has no port in 0-65535 or cannot be bound (in use or not local), naming
            ``--health-listen``.
    """
    import grpc
    from concurrent import futures

    from trainguard.errors import UsageError

    _, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:  # gRPC binds 99999 to another port, silently
        raise UsageError(f"--health-listen {listen!r}: give HOST:PORT with a port in 0-65535")
    from trainguard.grpc_guard import HEALTH_MAX_REQUEST_BYTES, HealthGuard

    # Probes and anyone else reach this port: random bytes get INVALID_ARGUMENT, not INTERNAL and a traceback.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=name),
                         interceptors=[HealthGuard(HEALTH_MAX_REQUEST_BYTES)],
                         options=[("grpc.so_reuseport", 0)])
    status.add_to_server(server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if not port:
        raise UsageError(f"--health-listen {listen}: cannot listen there (in use or not local); pick another "
                         "address")
    server.start()
    return server, port


class CoordinatorWatch:
    """Samples a coordinator: health statuses, cordon events, recovery durations.

    Args:
        core: the coordinator.
        period_s: sampling period, seconds.
    """

    def __init__(self, core: "JobCoordinator", period_s: float = WATCH_PERIOD_S) -> None:
        self.core = core
        self.period_s = period_s
        self.health = ServingStatus(("", COORDINATOR_SERVICE))
        self.recovery = Histogram("trainguard_job_recovery_seconds",
                                  "Seconds from a failure report to the next generation running.",
                                  buckets=_RECOVERY_BUCKETS, registry=None)
        self.recoveries: list[float] = []
        self._listeners: list[Callable[[CordonTarget], None]] = []
        self._back_listeners: list[Callable[[str], None]] = []
        self._cordoned: set[str] = set()
        self._gen_seen: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="coordinator-watch", daemon=True)

    def add_cordon_listener(self, fn: Callable[[CordonTarget], None]) -> None:
        """Calls ``fn`` for every node the coordinator cordons (on the watch thread; keep it quick)."""
        self._listeners.append(fn)

    def add_uncordon_listener(self, fn: Callable[[str], None]) -> None:
        """Calls ``fn(node_id)`` for every node the coordinator returns to service (on the watch thread)."""
        self._back_listeners.append(fn)

    def start(self) -> "CoordinatorWatch":
        """Takes a first sample (so health answers at once) and starts the thread."""
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Marks everything NOT_SERVING and stops sampling."""
        self.health.shutdown()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 (an observer must never take the coordinator down)
                log.exception("coordinator watch: sampling failed")

    def sample(self) -> None:
        """Takes one sample: updates health, fires cordon listeners, times recoveries."""
        core = self.core
        self.health.set(not core.fenced)
        # Read before the state: a node registering in between is then in one or the other (or both), never in
        # neither, which would fire the uncordon listeners and then the cordon hooks again.
        held = core.held_cordons()
        st = core.state
        phase, generation = st.phase, st.generation
        if self._gen_seen is None:
            self._gen_seen = generation  # a restarted coordinator: generations before now are not ours to time
        elif generation > self._gen_seen and phase is Phase.RUNNING:
            if generation > 1:  # generation 1 is the formation; every later one is a restart
                # Restarts are decided on failure reports the policy keeps with their (wall) times; the newest one
                # before now started this recovery.
                times = [t for ts in dict(st.process_failures).values() for t in ts] + list(st.node_failures)
                wall = time.time()
                fault = max((t for t in times if t <= wall), default=None)
                if fault is not None:
                    took = wall - fault
                    self.recovery.observe(took)
                    self.recoveries.append(took)
            self._gen_seen = generation
        cordoned = set(st.cordoned) | set(held)  # held: kept out before registering (see daemon_reports)
        new = sorted(n for n in cordoned if n not in self._cordoned)
        if new and self._listeners:
            members = core.members()
            for node in new:
                m = members.get(node)
                seen = core.node_health.get(node)  # a daemon reports its host before its node registers
                host = _host_of(m.info) if m is not None else (seen.report.host if seen and seen.report.host else node)
                # A failed qualification or a daemon's report names the node's own fault; else the job's message.
                reason = (m.refused if m is not None else "") or core.cordon_reason(node) or st.message
                target = CordonTarget(node=node, host=host, job=core.spec.job, reason=reason)
                for fn in self._listeners:
                    fn(target)
        self._cordoned.update(new)
        # A node back in service (its daemon restarted after a repair) is forgotten, so that cordoning it again
        # fires the hooks again.
        for node in self._cordoned - cordoned:
            self._cordoned.discard(node)
            for back in self._back_listeners:
                back(node)


def _host_of(info) -> str:
    """The host a member registered (``info`` is the proto ``NodeInfo`` or a domain record with ``host``)."""
    host = getattr(info, "host", "") or getattr(getattr(info, "topology", None), "host", "")
    return host or info.node_id


class CoordinatorMetrics:
    """The coordinator's metrics registry (a collector reading live state plus the recovery histogram).

    Args:
        watch: the coordinator's watch (state, recovery histogram).
        dispatcher: the cordon dispatcher whose attempts are counted, or None.
    """

    def __init__(self, watch: CoordinatorWatch, dispatcher: "CordonDispatcher | None" = None) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self._watch = watch
        self._dispatcher = dispatcher
        self.registry.register(self)
        self.registry.register(watch.recovery)

    def collect(self):
        """Yields every metric family from the coordinator's current state (prometheus-client collector API)."""
        core = self._watch.core
        st = core.state
        info = GaugeMetricFamily("trainguard_coordinator_info", "Identity of the coordinator (always 1).",
                                 labels=["version", "job"])
        info.add_metric([__version__, core.spec.job], 1)
        yield info
        phase = GaugeMetricFamily("trainguard_job_phase", "1 for the job's current phase.", labels=["phase"])
        for p in Phase:
            phase.add_metric([p.name.lower()], 1 if p is st.phase else 0)
        yield phase
        yield GaugeMetricFamily("trainguard_job_generation", "Current generation (0 before the first).",
                                value=st.generation)
        yield CounterMetricFamily("trainguard_job_restarts", "Restarts spent so far.", value=st.restart_count)
        yield GaugeMetricFamily("trainguard_job_max_restarts", "The job's restart budget.",
                                value=core.spec.max_restarts)
        members = core.members()
        cordoned = set(st.cordoned)
        nodes = GaugeMetricFamily("trainguard_job_nodes", "Members by state.", labels=["state"])
        nodes.add_metric(["alive"], sum(1 for m in members.values() if m.alive and m.info.node_id not in cordoned))
        nodes.add_metric(["lost"], sum(1 for m in members.values() if not m.alive))
        nodes.add_metric(["cordoned"], len(cordoned))
        yield nodes
        yield GaugeMetricFamily("trainguard_job_nodes_required", "Nodes the job needs.", value=core.spec.nnodes)
        yield GaugeMetricFamily("trainguard_coordinator_fenced", "1 once another coordinator took the job over.",
                                value=1 if core.fenced else 0)
        runs = CounterMetricFamily("trainguard_cordon_hook_runs", "Scheduler cordon attempts.",
                                   labels=["hook", "result"])
        counts: dict[tuple[str, str], int] = {}
        for hook, _node, outcome in list(self._dispatcher.results if self._dispatcher else []):
            key = (hook, "ok" if outcome == "ok" else "error")
            counts[key] = counts.get(key, 0) + 1
        for (hook, result), n in sorted(counts.items()):
            runs.add_metric([hook, result], n)
        yield runs
        rows = core.node_health.snapshot()
        daemons = GaugeMetricFamily("trainguard_node_daemons", "Nodes by their daemon's latest verdict; silent: no "
                                    "report for 3 report intervals.", labels=["verdict"])
        for v in Verdict:
            daemons.add_metric([v.name.lower()], sum(1 for e in rows.values() if e.report.verdict is v))
        daemons.add_metric(["silent"], len(core.silent_daemons()))
        yield daemons


__all__ = ["COORDINATOR_SERVICE", "CoordinatorMetrics", "CoordinatorWatch", "ServingStatus", "WATCH_PERIOD_S"]
