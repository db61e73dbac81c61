"""The agent's Prometheus ``/metrics`` endpoint.

Names follow the Prometheus conventions: the ``trainguard_`` prefix, base units in the name (``_seconds``,
``_bytes``), ``_total`` on counters, and labels with a bounded set of values only (detector names come from
the configuration, event kinds from detector code, checkpoint tiers from a fixed list; never ranks, steps,
pids, subjects or messages). Exported series:

================================================  =======  ==============================================
name                                              type     meaning
================================================  =======  ==============================================
trainguard_agent_info{version,node}               gauge    1; identity of the agent
trainguard_agent_start_time_seconds               gauge    Unix time the agent started
trainguard_detector_state{detector,state}         gauge    1 for the detector's current state, else 0
trainguard_health_events_total{source,kind,sev}   counter  health events emitted
trainguard_predictor_score                        gauge    failure risk in [0, 1]
trainguard_predictor_threshold                    gauge    risk above which workers are told to checkpoint
trainguard_predictor_alarms_per_day               gauge    realised predictor alarm rate (vs its budget)
trainguard_workers{state}                         gauge    local workers per state
trainguard_worker_restarts_total                  counter  worker-group restarts (new generations)
trainguard_checkpoint_stall_seconds{tier}         histo    training-loop time blocked by a checkpoint
trainguard_checkpoint_persist_seconds{tier}       histo    background persist time of a checkpoint
trainguard_checkpoint_size_bytes{tier}            histo    bytes of a checkpoint (one rank)
trainguard_checkpoint_last_step                   gauge    newest step reported durable
trainguard_grpc_requests_total{method,code}       counter  NodeAgent calls served
trainguard_grpc_request_duration_seconds{method}  histo    NodeAgent unary call latency
trainguard_watchdog_pings_total                   counter  systemd watchdog keep-alives sent
trainguard_failslow_slow_ranks{scope}             gauge    ranks the coordinator flags as stragglers: in the
                                                           job (scope="job") / on this node (scope="node")
trainguard_failslow_worst_ratio{scope}            gauge    largest flagged ratio (1 when none flagged)
trainguard_failslow_node_slow{basis}              gauge    1 when this node is flagged (basis "compute",
                                                           "wait" own work, or "link": its links probed slow)
trainguard_failslow_job_slowdown                  gauge    job step time over its own baseline (0: unknown)
trainguard_failslow_job_step_seconds              gauge    median step time of the job (0: unknown)
================================================  =======  ==============================================
"""

from __future__ import annotations

import errno
import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from trainguard._version import __version__
from trainguard.agent.config import AgentConfigError, parse_hostport

log = logging.getLogger(__name__)

#: Values of the ``state`` label of ``trainguard_detector_state`` (``trainguard.v1.DetectorState`` names).
DETECTOR_STATES = ("ok", "degraded", "failed", "no_hardware", "error")
#: Values of the ``state`` label of ``trainguard_workers`` (``trainguard.v1.WorkerState`` names).
WORKER_STATES = ("starting", "running", "succeeded", "failed", "stopped", "hung")
#: Values of the ``tier`` label of checkpoint metrics; anything else is counted as ``other``.
CHECKPOINT_TIERS = ("snapshot", "memory", "disk", "remote")
#: Values of the ``basis`` label of ``trainguard_failslow_node_slow`` (``SlowRank.basis``).
FAILSLOW_BASES = ("compute", "wait", "step", "link")
#: Largest number of distinct event kinds kept as label values; later new kinds are counted as ``other`` so a
#: buggy detector cannot explode the series count.
MAX_EVENT_KINDS = 200

_SEVERITIES = ("info", "warning", "error", "critical")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PERSIST_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_SIZE_BUCKETS = tuple(float(2**p) for p in range(20, 42, 2))  # 1 MiB .. 2 TiB


class AgentMetrics:
    """Every metric the agent exports, in a registry of its own (no process-global state)."""

    def __init__(self, node_id: str) -> None:
        """Creates the metrics.

        Args:
            node_id: this node's identity (the ``node`` label of ``trainguard_agent_info``).
        """
        # The `_created` series prometheus_client adds to every counter and histogram double the series count
        # for a timestamp nobody queries (and the agent's start time is exported once, below).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._lock = threading.Lock()
        self._kinds: set[tuple[str, str]] = set()
        self._detectors: set[str] = set()
        info = Gauge("trainguard_agent_info", "Identity of the trainguard node agent (always 1).",
                     ["version", "node"], registry=r)
        info.labels(__version__, node_id).set(1)
        Gauge("trainguard_agent_start_time_seconds", "Unix time the agent started.", registry=r).set(time.time())
        self.detector_state = Gauge("trainguard_detector_state",
                                    "1 for the detector's current state, 0 for the others.",
                                    ["detector", "state"], registry=r)
        self.events = Counter("trainguard_health_events", "Health events emitted by detectors and the predictor.",
                              ["source", "kind", "severity"], registry=r)
        self.predictor_score = Gauge("trainguard_predictor_score", "Predicted failure risk in [0, 1].", registry=r)
        self.predictor_threshold = Gauge("trainguard_predictor_threshold",
                                         "Risk above which workers are told to checkpoint now (NaN before the "
                                         "first score).", registry=r)
        # NaN, not 0, until the first score: an alert rule "score >= threshold" fired on 0 >= 0 at start-up
        self.predictor_threshold.set(float("nan"))
        self.predictor_alarms_per_day = Gauge(
            "trainguard_predictor_alarms_per_day",
            "Learned-tier predictor alarms per observed day so far (NaN before any), to compare with its budget.",
            registry=r)
        self.workers = Gauge("trainguard_workers", "Local training workers per state.", ["state"], registry=r)
        for state in WORKER_STATES:
            self.workers.labels(state).set(0)
        self.worker_restarts = Counter("trainguard_worker_restarts",
                                       "Restarts of the local worker group (new generations).", registry=r)
        self.ckpt_stall = Histogram("trainguard_checkpoint_stall_seconds",
                                    "Time the training loop was blocked by one checkpoint.", ["tier"],
                                    buckets=_STALL_BUCKETS, registry=r)
        self.ckpt_persist = Histogram("trainguard_checkpoint_persist_seconds",
                                      "Background time to make one checkpoint durable.", ["tier"],
                                      buckets=_PERSIST_BUCKETS, registry=r)
        self.ckpt_size = Histogram("trainguard_checkpoint_size_bytes", "Size of one rank's checkpoint.", ["tier"],
                                   buckets=_SIZE_BUCKETS, registry=r)
        self.ckpt_last_step = Gauge("trainguard_checkpoint_last_step", "Newest step reported durable (-1: none).",
                                    registry=r)
        self.ckpt_last_step.set(-1)
        self.grpc_requests = Counter("trainguard_grpc_requests", "NodeAgent calls served, by method and status.",
                                     ["method", "code"], registry=r)
        self.grpc_latency = Histogram("trainguard_grpc_request_duration_seconds",
                                      "Server-side latency of unary NodeAgent calls.", ["method"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.watchdog_pings = Counter("trainguard_watchdog_pings", "systemd watchdog keep-alives sent.", registry=r)
        self.failslow_slow_ranks = Gauge("trainguard_failslow_slow_ranks",
                                         "Ranks flagged as stragglers by the coordinator, in the job or on this node.",
                                         ["scope"], registry=r)
        self.failslow_worst_ratio = Gauge("trainguard_failslow_worst_ratio",
                                          "Largest flagged straggler ratio (1 when none is flagged).", ["scope"],
                                          registry=r)
        self.failslow_node_slow = Gauge("trainguard_failslow_node_slow",
                                        "1 when the coordinator flags this node, by basis (link: its links).",
                                        ["basis"], registry=r)
        self.failslow_job_slowdown = Gauge("trainguard_failslow_job_slowdown",
                                           "Job step time over the job's own baseline (0: unknown).", registry=r)
        self.failslow_job_step = Gauge("trainguard_failslow_job_step_seconds",
                                       "Median step time of the job (0: unknown).", registry=r)
        self.set_failslow([], 0.0, 0.0, "")

    # -- updates ------------------------------------------------------------------------------------------

    def set_detector_states(self, states: Mapping[str, str]) -> None:
        """Sets each detector's current state (one-hot over :data:`DETECTOR_STATES`).

        Args:
            states: detector name -> state name (case-insensitive; unknown names count as ``error``).
        """
        with self._lock:
            for name, state in states.items():
                state = state.lower()
                if state not in DETECTOR_STATES:
                    state = "error"
                for candidate in DETECTOR_STATES:
                    self.detector_state.labels(name, candidate).set(1 if candidate == state else 0)
                self._detectors.add(name)

    def count_event(self, source: str, kind: str, severity: str) -> None:
        """Counts one health event (severity name, e.g. ``"warning"``)."""
        with self._lock:
            key = (source, kind)
            if key not in self._kinds:
                if len(self._kinds) >= MAX_EVENT_KINDS:
                    kind = "other"
                else:
                    self._kinds.add(key)
        severity = severity.lower() if severity.lower() in _SEVERITIES else "other"
        self.events.labels(source, kind, severity).inc()

    def set_predictor(self, score: float, threshold: float, alarms_per_day: float = float("nan")) -> None:
        """Sets the latest risk score, the threshold in use and the realised alarm rate."""
        self.predictor_score.set(score)
        self.predictor_threshold.set(threshold)
        self.predictor_alarms_per_day.set(alarms_per_day)

    def set_worker_states(self, states: Iterable[str]) -> None:
        """Sets the worker-per-state gauges from the current state of every worker (names, lowercase)."""
        counts = dict.fromkeys(WORKER_STATES, 0)
        for state in states:
            state = state.lower()
            if state in counts:
                counts[state] += 1
        for state, n in counts.items():
            self.workers.labels(state).set(n)

    def count_worker_restart(self) -> None:
        """Counts one restart of the worker group."""
        self.worker_restarts.inc()

    def observe_checkpoint(self, tier: str, size_bytes: int, stall_s: float, persist_s: float, step: int) -> None:
        """Records one durable checkpoint as reported by a worker.

        Args:
            tier: ``snapshot``, ``memory``, ``disk`` or ``remote`` (others are recorded as ``other``).
            size_bytes: bytes written for this rank.
            stall_s: seconds the training loop was blocked.
            persist_s: seconds the persist took.
            step: training step of the checkpoint.
        """
        tier = tier if tier in CHECKPOINT_TIERS else "other"
        self.ckpt_size.labels(tier).observe(size_bytes)
        self.ckpt_stall.labels(tier).observe(stall_s)
        self.ckpt_persist.labels(tier).observe(persist_s)
        with self._lock:
            if step > self.ckpt_last_step._value.get():  # noqa: SLF001 - read back the gauge's own value
                self.ckpt_last_step.set(step)

    def set_failslow(self, slow: Iterable, job_slowdown: float, job_step_s: float, node_id: str) -> None:
        """Sets the fail-slow gauges from the coordinator's latest findings as this node received them.

        Args:
            slow: the flagged entries (``SlowRank`` messages or alike: ``rank``, ``node_id``, ``ratio``, ``basis``;
                rank -1 is a node finding, e.g. a slow link).
            job_slowdown: the job's step time over its own baseline (0: unknown).
            job_step_s: the job's median step time, seconds (0: unknown).
            node_id: this node (its share of the findings is the ``node`` scope).
        """
        v = failslow_values(slow, node_id)
        with self._lock:
            for scope in ("job", "node"):
                self.failslow_slow_ranks.labels(scope).set(v[f"slow_ranks_{scope}"])
                self.failslow_worst_ratio.labels(scope).set(v[f"worst_ratio_{scope}"])
            for basis in FAILSLOW_BASES:
                self.failslow_node_slow.labels(basis).set(v[f"node_slow_{basis}"])
            self.failslow_job_slowdown.set(job_slowdown)
            self.failslow_job_step.set(job_step_s)

    def observe_request(self, method: str, code: str, seconds: float | None) -> None:
        """Counts one gRPC call (method short name, status code name) and its latency when unary."""
        self.grpc_requests.labels(method, code).inc()
        if seconds is not None:
            self.grpc_latency.labels(method).observe(seconds)


def failslow_values(slow: Iterable, node_id: str) -> dict[str, float]:
    """The fail-slow gauge values of one node from the coordinator's flagged entries (see
    :meth:`AgentMetrics.set_failslow`): ``slow_ranks_job|node``, ``worst_ratio_job|node``, ``node_slow_<basis>``."""
    slow = list(slow)
    ranks = [s for s in slow if s.rank >= 0]
    mine = [s for s in ranks if s.node_id == node_id]
    out: dict[str, float] = {}
    for scope, rows in (("job", ranks), ("node", mine)):
        out[f"slow_ranks_{scope}"] = len(rows)
        out[f"worst_ratio_{scope}"] = max((s.ratio for s in rows), default=1.0)
    flagged = {s.basis for s in slow if s.node_id == node_id}
    for basis in FAILSLOW_BASES:
        out[f"node_slow_{basis}"] = 1.0 if basis in flagged else 0.0
    return out


def failslow_families(status, node_id: str) -> list:
    """The fail-slow gauges as prometheus-client metric families, for collectors that read state at scrape time
    (``trainguard run``'s :class:`~trainguard.agent.run_deploy.RunMetrics`); same names as :class:`AgentMetrics`.

    Args:
        status: the coordinator's latest ``FailSlowStatus`` as this node received it.
        node_id: this node.
    """
    from prometheus_client.core import GaugeMetricFamily

    v = failslow_values(status.slow, node_id)
    ranks = GaugeMetricFamily("trainguard_failslow_slow_ranks",
                              "Ranks flagged as stragglers by the coordinator, in the job or on this node.",
                              labels=["scope"])
    ratio = GaugeMetricFamily("trainguard_failslow_worst_ratio",
                              "Largest flagged straggler ratio (1 when none is flagged).", labels=["scope"])
    for scope in ("job", "node"):
        ranks.add_metric([scope], v[f"slow_ranks_{scope}"])
        ratio.add_metric([scope], v[f"worst_ratio_{scope}"])
    node = GaugeMetricFamily("trainguard_failslow_node_slow",
                             "1 when the coordinator flags this node, by basis (link: its links).", labels=["basis"])
    for basis in FAILSLOW_BASES:
        node.add_metric([basis], v[f"node_slow_{basis}"])
    return [ranks, ratio, node,
            GaugeMetricFamily("trainguard_failslow_job_slowdown", "Job step time over the job's own baseline "
                              "(0: unknown).", value=status.job_slowdown),
            GaugeMetricFamily("trainguard_failslow_job_step_seconds", "Median step time of the job (0: unknown).",
                              value=status.job_step_s)]


def _log_request_error(request: object, client_address: object) -> None:
    """``handle_error`` of the metrics HTTP server: one log record instead of a traceback on stderr (called inside
    the failed request's ``except``, so the exception is current)."""
    exc = sys.exc_info()[1]
    if isinstance(exc, (ConnectionError, TimeoutError)):
        # The client went away before or while it was answered: nothing the agent can or need fix.
        log.debug("metrics: client %s went away (%s)", client_address, exc)
    else:
        log.warning("metrics: request from %s failed: %s: %s", client_address, type(exc).__name__, exc)


class MetricsServer:
    """The HTTP server exposing ``/metrics`` from an :class:`AgentMetrics` registry."""

    def __init__(self, metrics: AgentMetrics, listen: str, setting: str = "metrics.listen") -> None:
        """Starts serving at once in a daemon thread.

        Args:
            metrics: what to expose.
            listen: ``HOST:PORT``; port 0 picks a free one (see :attr:`port`).
            setting: what gave ``listen`` (its first word starts the error; the whole of it says what to change).

        Raises:
            AgentConfigError: the address cannot be bound.
        """
        host, port = parse_hostport(listen)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        except OSError as exc:
            hint = (f"; the port is in use by another process (another agent?): stop it or pick a free port with "
                    f"{setting}" if exc.errno == errno.EADDRINUSE else "")
            raise AgentConfigError(f"{setting.split(' ', 1)[0]}: cannot listen on {listen} ({exc.strerror}){hint}"
                                   ) from exc
        # socketserver's default prints a traceback to stderr, past the log format (json, journal), whenever a
        # client resets its connection: a TCP probe, a port scan, a scrape given up on its timeout.
        self._server.handle_error = _log_request_error
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and closes the listening socket."""
        server: WSGIServer = self._server
        server.shutdown()
        server.server_close()
        self._thread.join(timeout=5)
