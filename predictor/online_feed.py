"""Glue between the node detectors and the anomaly predictor: detector metrics in, predictor scores out.

The detectors name their metrics ``"<detector>.<metric>"`` with per-device values in brackets
(``"pcie.aer_correctable[0000:3b:00.0]"``); the predictor knows the catalog names of
:mod:`trainguard.predictor.catalog` (``pcie_aer_corrected_total``...) and the rule names of its
``rules.json`` (``gpu_xid_79_total``, ``pcie_aer_fatal_total``, ``pcie_link_width``, ``nic_up``). Four kinds of
translation, each a module-level table:

* :data:`CATALOG_MAPPINGS` - stateless, :func:`detector_metrics_to_catalog`: a catalog metric is an aggregate
  (sum, max or min) of detector metrics, e.g. the sum of every GPU's volatile corrected ECC counter.
* :data:`RATE_INTEGRALS` - stateful, :class:`RateIntegrator`: the RoCE detector exposes its RDMA counters as
  rates (``*_per_s``, summed over ports); the catalog wants cumulative counters, so the rate is integrated
  over the time between two ticks (sample and hold).
* :class:`EventCounters` - stateful, fed with the detectors' :class:`~trainguard.detectors.events.HealthEvent`
  stream: Xids are events only (``gpu.xid`` from ``nvidia`` and ``kmsg``, the code in ``evidence["xid"]``),
  carrier changes are the ``net.link_down``/``net.link_up`` events of ``roce`` (netlink, as they happen), and a
  PCIe link's maximum width is only in the evidence of ``pcie.link_narrow``.
* :func:`passthrough_metrics` - the node-level metrics of the host-side detectors (:data:`PASSTHROUGH_DETECTORS`:
  memory and CPU pressure, disk fill, kernel-log match counts...) under their own names, ``<detector>_<metric>``
  (``host_mem_available_pct``, ``kmsg_matches_oom_kill``): the predictor takes any numeric metric, and this way
  the agent's history records them and a model trained on them scores in the agent too.

Catalog metrics without a source on this node are absent from the sample (the predictor's missing policy
handles that): ``gpu_row_remap_pending`` (NVML pending remaps are a condition, not a metric),
``pcie_replay_total`` (no PCIe replay counter is read) and ``nic_fec_corrected_total`` (no FEC counter is read).
Other detector metrics (per-device values of the host-side detectors, the process detector's worker figures)
are dropped.

:class:`PredictorMonitor` embeds all of it with a :class:`~trainguard.predictor.runtime.PredictorRuntime`
and an optional :class:`~trainguard.predictor.history.MetricHistory`: one ``tick()`` per interval
maps, stores, scores and calls back on alarms.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from trainguard.detectors.events import HealthEvent
from trainguard.faultfacts.throttle import load_bad_throttle_reasons
from trainguard.predictor.calibration import AlarmLedger
from trainguard.predictor.catalog import BY_NAME, UNKNOWN_KIND
from trainguard.predictor.runtime import WARMING_UP, PredictorRuntime, Score

if TYPE_CHECKING:
    from trainguard.predictor.history import MetricHistory

log = logging.getLogger(__name__)

#: Catalog metrics the training workers report (through the hook's step heartbeats), not a detector: absent
#: until the first step of a generation, and never from a script that does not import trainguard.
WORKER_METRICS = frozenset({"step_time_s"})
#: Detectors whose node-level metrics (no device in brackets) reach the predictor under their own names. Not the
#: process detector: its figures count workers, which restarts change on purpose; not the hardware detectors the
#: catalog already maps (their per-device values are aggregated there).
PASSTHROUGH_DETECTORS = frozenset({"host", "disk", "kmsg", "thermal", "edac"})
#: Seconds after the first tick with detector metrics before the model's metrics are judged present or absent:
#: detectors sample at their own intervals (30 s for the slowest defaults), so the first tick sees only some.
MODEL_CHECK_SETTLE_S = 60.0


class Aggregate(enum.Enum):
    """How the values of several detector metrics (devices) become one catalog value."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


_BAD_THROTTLE_MASK = 0
for _bit in load_bad_throttle_reasons().values():
    _BAD_THROTTLE_MASK |= _bit


def _throttled(reasons: float) -> float:
    """1.0 when an NVML throttle-reason bitmask holds a reason that means trouble (not power policy)."""
    return 1.0 if int(reasons) & _BAD_THROTTLE_MASK else 0.0


@dataclass(frozen=True)
class MetricMapping:
    """One catalog (or rule) metric computed from detector metrics in the same sample.

    Attributes:
        target: predictor metric name.
        sources: detector metric names without the device suffix (``"nvidia.temp_c"``); a source matches the
            plain name and every ``name[device]``.
        aggregate: how the matched values combine.
        per_device_only: use only the bracketed per-device values (when the detector also publishes a node
            total under the plain name, it would otherwise be counted twice).
        transform: applied to each value before aggregating (e.g. a bitmask to 0/1).
        note: source unit and kind, for readers of the table.
    """

    target: str
    sources: tuple[str, ...]
    aggregate: Aggregate
    per_device_only: bool = True
    transform: Callable[[float], float] | None = None
    note: str = ""


#: Stateless mappings (see :func:`detector_metrics_to_catalog`).
CATALOG_MAPPINGS: tuple[MetricMapping, ...] = (
    MetricMapping("gpu_ecc_sbe_total", ("nvidia.ecc_volatile_corrected",), Aggregate.SUM,
                  note="NVML volatile corrected ECC count per GPU (counter since driver load), summed"),
    MetricMapping("gpu_ecc_dbe_total", ("nvidia.ecc_volatile_uncorrected",), Aggregate.SUM,
                  note="NVML volatile uncorrected ECC count per GPU (counter), summed"),
    MetricMapping("gpu_temp_c", ("nvidia.temp_c",), Aggregate.MAX, note="GPU core temperature, degC, hottest GPU"),
    MetricMapping("gpu_throttle_frac", ("nvidia.throttle_reasons",), Aggregate.MAX, transform=_throttled,
                  note="NVML throttle-reason bitmask per GPU -> 1 when any GPU has a bad reason (HW/thermal "
                       "slowdown, power brake) at the sample: a point estimate of the throttled fraction"),
    MetricMapping("pcie_aer_corrected_total", ("pcie.aer_correctable",), Aggregate.SUM,
                  note="sysfs aer_dev_correctable TOTAL_ERR_COR per device (counter), summed"),
    MetricMapping("pcie_aer_fatal_total", ("pcie.aer_fatal",), Aggregate.SUM,
                  note="sysfs aer_dev_fatal TOTAL_ERR_FATAL per device (counter), summed (rule aer-fatal)"),
    MetricMapping("nic_up", ("roce.link_up", "roce.port_active"), Aggregate.MIN,
                  note="netlink link state per watched netdev and RDMA port state (4: ACTIVE) per port, 1/0: "
                       "0 when any is down (rule nic-down)"),
)


@dataclass(frozen=True)
class RateIntegral:
    """A catalog counter rebuilt from detector rates.

    Attributes:
        target: catalog counter name.
        sources: detector rate metrics (per second, node totals) whose sum is integrated.
        note: what is counted.
    """

    target: str
    sources: tuple[str, ...]
    note: str = ""


#: Rates integrated into counters by :class:`RateIntegrator` (the RoCE detector sums them over ports).
RATE_INTEGRALS: tuple[RateIntegral, ...] = (
    RateIntegral("nic_symbol_errors_total", ("roce.symbol_error_per_s",),
                 "IB PortCounters symbol_error of the RDMA ports"),
    RateIntegral("rdma_retrans_total", ("roce.out_of_sequence_per_s", "roce.local_ack_timeout_err_per_s"),
                 "hw_counters out_of_sequence (peer retransmits) + local_ack_timeout_err (we retransmit)"),
    RateIntegral("rdma_cnp_total", ("roce.rp_cnp_handled_per_s",),
                 "hw_counters rp_cnp_handled: CNPs received and acted on by this node's senders"),
)

#: Xid codes that are fatal on their own (rules tier); every other code counts in ``gpu_xid_total``.
FATAL_XIDS: frozenset[int] = frozenset({48, 64, 74, 79, 95, 119, 120, 140})

#: Xid codes the shipped rules read; their counters are published (at 0) as soon as an Xid source runs, so the
#: rules are evaluable and the first occurrence is an increase.
RULE_XIDS: tuple[int, ...] = (48, 63, 64, 74, 79, 95, 119, 120, 140)

#: Counters of :class:`EventCounters`: they count the detectors' events since this agent started, from 0, so the
#: rules tier reads their first reading as an increase (a counter read from the node is a baseline at first).
EVENT_COUNTERS: tuple[str, ...] = ("gpu_xid_*_total", "nic_carrier_changes_total")

#: Detector metrics whose presence shows that an Xid source runs on this node.
XID_SOURCE_MARKERS: tuple[str, ...] = ("nvidia.gpus", "kmsg.matches_nvidia_xid")


def _finite(value: object) -> float | None:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def detector_metrics_to_catalog(metrics: Mapping[str, float], step_time_s: float | None = None) -> dict[str, float]:
    """Maps one flat detector sample to the predictor's metric names, statelessly (:data:`CATALOG_MAPPINGS`).

    Counters that the detectors expose only as rates, and metrics that come from events (Xids, carrier
    changes, link width), need state: :class:`CatalogFeed` adds them.

    Args:
        metrics: ``DetectorRunner.latest_metrics()``: ``"detector.metric[device]"`` -> value.
        step_time_s: duration of the last training step on this node, seconds (None when unknown).

    Returns:
        Predictor metric name -> value. A target whose sources are all absent is absent; one whose sources
        are present but none is a finite number is NaN (a missing reading).
    """
    by_source: dict[str, list[object]] = defaultdict(list)
    wanted = {s: m for m in CATALOG_MAPPINGS for s in m.sources}
    for key, value in metrics.items():
        base, bracket, _ = key.partition("[")
        m = wanted.get(base)
        if m is None or (m.per_device_only and not bracket):
            continue
        by_source[base].append(value)
    out: dict[str, float] = {}
    for m in CATALOG_MAPPINGS:
        raw = [v for s in m.sources for v in by_source.get(s, ())]
        if not raw:
            continue
        vals = [x for x in (_finite(v) for v in raw) if x is not None]
        if m.transform is not None:
            vals = [m.transform(v) for v in vals]
        if not vals:
            out[m.target] = math.nan
        elif m.aggregate is Aggregate.SUM:
            out[m.target] = float(sum(vals))
        elif m.aggregate is Aggregate.MAX:
            out[m.target] = float(max(vals))
        else:
            out[m.target] = float(min(vals))
    st = _finite(step_time_s) if step_time_s is not None else None
    if st is not None and st > 0:
        out["step_time_s"] = st
    return out


class RateIntegrator:
    """Rebuilds cumulative counters from the detectors' per-second rates (:data:`RATE_INTEGRALS`).

    Sample and hold: at each tick the counter grows by ``rate * (ts - previous tick ts)``, where ``rate`` is the
    rate the detector published last (over its own last sampling interval). When ticks and the detector run at
    the same interval the total equals the device counters' increase, one interval late; otherwise it matches it
    up to the rate changes within one detector interval. The first tick starts every counter at 0 (the
    predictor uses counter rates, never levels). A tick where no source rate is present leaves the counter out
    of the sample (missing) and does not integrate over that gap.
    """

    def __init__(self, table: tuple[RateIntegral, ...] = RATE_INTEGRALS) -> None:
        """Creates an integrator.

        Args:
            table: the rates to integrate.
        """
        self.table = table
        self._total: dict[str, float] = {}
        self._last_ts: dict[str, float] = {}

    def update(self, ts: float, metrics: Mapping[str, float]) -> dict[str, float]:
        """Integrates one tick.

        Args:
            ts: tick time, seconds (increasing).
            metrics: detector metrics of this tick.

        Returns:
            Catalog counter name -> cumulative value, for each counter with a source rate in ``metrics``.
        """
        out: dict[str, float] = {}
        for r in self.table:
            rates = [x for x in (_finite(metrics[s]) for s in r.sources if s in metrics) if x is not None]
            if not rates:
                self._last_ts.pop(r.target, None)  # do not integrate across the gap
                continue
            total = self._total.get(r.target, 0.0)
            last = self._last_ts.get(r.target)
            if last is not None and ts > last:
                total += max(0.0, sum(rates)) * (ts - last)
            self._total[r.target] = total
            self._last_ts[r.target] = ts
            out[r.target] = total
        return out


class EventCounters:
    """Predictor metrics that only the detectors' events carry; fed by :meth:`observe`, read by :meth:`metrics`.

    - ``gpu_xid_<N>_total``: Xid ``N`` events (``gpu.xid``). The ``nvidia`` (NVML) and ``kmsg`` (kernel log)
      detectors both report the same Xids, so each source is counted apart and the larger count is used (no
      double counting; a source that missed some is covered by the other). ``gpu_xid_total`` sums the codes not
      in :data:`FATAL_XIDS`.
    - ``nic_carrier_changes_total``: ``net.link_down`` + ``net.link_up`` events of ``roce`` (netlink).
    - ``pcie_link_width`` / ``pcie_link_width_max``: a ratio, ``min(width / max_width)`` over the links that
      ``pcie.link_narrow`` reports narrow (until ``pcie.link_narrow.cleared``), and 1.0; both 1.0 when no link
      is narrow. The rule ``pcie_link_width < pcie_link_width_max`` then fires while any link is narrow.

    Thread-safe (the runner calls ``on_event`` from its threads).
    """

    def __init__(self) -> None:
        """Creates empty counters."""
        self._lock = threading.Lock()
        self._xids: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._carrier_changes = 0
        self._narrow: dict[str, float] = {}

    def observe(self, event: HealthEvent) -> bool:
        """Counts one detector event.

        Args:
            event: any detector event (those not listed in the class docstring are ignored).

        Returns:
            True when the event was used.
        """
        kind = event.kind
        with self._lock:
            if kind == "gpu.xid":
                code = _finite(event.evidence.get("xid"))
                if code is None:
                    return False
                self._xids[event.source][int(code)] += 1
                return True
            if event.source == "roce" and kind in ("net.link_down", "net.link_up"):
                self._carrier_changes += 1
                return True
            if kind == "pcie.link_narrow":
                width, max_width = _finite(event.evidence.get("width")), _finite(event.evidence.get("max_width"))
                if width is None or not max_width:
                    return False
                self._narrow[event.subject] = width / max_width
                return True
            if kind == "pcie.link_narrow.cleared":
                return self._narrow.pop(event.subject, None) is not None
        return False

    def metrics(self, detector_metrics: Mapping[str, float]) -> dict[str, float]:
        """The event-derived metrics, published when their source runs on this node.

        Args:
            detector_metrics: this tick's detector metrics (say which sources run).

        Returns:
            Predictor metric name -> value.
        """
        out: dict[str, float] = {}
        with self._lock:
            if self._xids or any(k in detector_metrics for k in XID_SOURCE_MARKERS):
                codes: dict[int, int] = defaultdict(int)
                for counts in self._xids.values():
                    for code, n in counts.items():
                        codes[code] = max(codes[code], n)
                for code in RULE_XIDS:
                    codes.setdefault(code, 0)
                for code, n in sorted(codes.items()):
                    out[f"gpu_xid_{code}_total"] = float(n)
                out["gpu_xid_total"] = float(sum(n for c, n in codes.items() if c not in FATAL_XIDS))
            if self._carrier_changes or (_finite(detector_metrics.get("roce.links_watched")) or 0) > 0:
                out["nic_carrier_changes_total"] = float(self._carrier_changes)
            if _finite(detector_metrics.get("pcie.links_degraded")) == 0.0:
                self._narrow.clear()  # a missed ``.cleared`` event must not keep a link narrow forever
            if self._narrow or (_finite(detector_metrics.get("pcie.links_watched")) or 0) > 0:
                out["pcie_link_width"] = min(self._narrow.values(), default=1.0)
                out["pcie_link_width_max"] = 1.0
        return out


def passthrough_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The node-level metrics of :data:`PASSTHROUGH_DETECTORS`, named ``<detector>_<metric>``.

    Args:
        metrics: ``DetectorRunner.latest_metrics()``.

    Returns:
        Predictor metric name -> value (NaN for a reading that is not a finite number).
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        detector, dot, name = key.partition(".")
        if not dot or "[" in name or detector not in PASSTHROUGH_DETECTORS:
            continue
        v = _finite(value)
        out[f"{detector}_{name}"] = math.nan if v is None else v
    return out


class CatalogFeed:
    """All four translations together: one predictor sample per tick (see the module docstring)."""

    def __init__(self) -> None:
        """Creates a feed with empty state."""
        self.rates = RateIntegrator()
        self.events = EventCounters()

    def observe_event(self, event: HealthEvent) -> bool:
        """Forwards a detector event to :class:`EventCounters` (thread-safe).

        Returns:
            True when the event was used.
        """
        return self.events.observe(event)

    def sample(self, ts: float, metrics: Mapping[str, float], step_time_s: float | None = None) -> dict[str, float]:
        """Builds one predictor sample.

        Args:
            ts: tick time, Unix seconds (increasing).
            metrics: ``DetectorRunner.latest_metrics()``.
            step_time_s: last training step duration on this node, seconds, or None.

        Returns:
            Predictor metric name -> value.
        """
        out = passthrough_metrics(metrics)
        out.update(detector_metrics_to_catalog(metrics, step_time_s))
        out.update(self.rates.update(ts, metrics))
        out.update(self.events.metrics(metrics))
        return out


def with_threshold(score: Score, threshold: float | None) -> Score:
    """``score`` judged against a configured alarm threshold instead of the model's own (per-node calibrated)
    one: ``alarm`` becomes ``score >= threshold``, a rule hit stays an alarm. A rules-only runtime (no model)
    scores every quiet sample as ``source="rules"``, score 0: only a hit may alarm (keying on the source alarmed
    on every quiet tick). Nor may a model score that is no score yet (:data:`~.runtime.WARMING_UP`, read as 0):
    a threshold of 0 alarmed (and drained the node) on every such tick.

    Args:
        score: the runtime's score.
        threshold: the operator's threshold in [0, 1]; None or NaN leaves ``score`` as it is.
    """
    if threshold is None or math.isnan(threshold):
        return score
    return replace(score, threshold=threshold, alarm=bool(score.rule_hits) or _reaches(score, threshold))


def _reaches(score: Score, threshold: float) -> bool:
    """Whether a learned score reaches ``threshold`` (never a rules-only placeholder or a warming-up one)."""
    return score.source == "model" and WARMING_UP not in score.degraded and score.score >= threshold


class PredictorMonitor:
    """The predictor embedded in the node agent: call :meth:`tick` once per interval from the agent loop.

    Each tick maps the detector metrics (:class:`CatalogFeed`), appends the sample to the history (when given),
    scores it, calls ``on_score(score)``, and ``on_alarm(score)`` on the rising edge of ``score.alarm`` and again
    every ``realarm_s`` while it stays up. Feed the detectors' events to :meth:`observe_event` (Xids, carrier
    changes and link widths come only from events).

    Degradation, never an exception into the agent loop:

    - a bad tick (time not after the previous one, a value the predictor refuses, a history write that fails, a
      callback that raises) is logged once per distinct problem (later ones at debug level, all counted in
      :attr:`problems`) and the tick returns None (a history or callback failure still returns the score);
    - feature mismatch: ``settle_s`` after the first tick with detector metrics (the detectors sample at their
      own intervals, so the first tick sees only some of them), the model's detector metrics that no sample
      carried by then are named in one ERROR log and the monitor falls back to rules only for the rest of its
      life (a model trained elsewhere must not score with made-up inputs; retrain on this node's exported
      history or enable the detectors). Until then, and after it for a metric that comes and goes (a detector
      error), a missing model metric is passed as NaN: the predictor forward-fills it, as in training.
      Metrics the workers report (:data:`WORKER_METRICS`: ``step_time_s``) never cause the fallback: they are
      absent until a generation's first step, whatever the node produces (a model trained on this node's own
      history used to be dropped at the first tick, before any step).
    - a tick with no detector metrics at all (the runner has not sampled yet) is skipped (None).
    """

    def __init__(
        self,
        runtime: PredictorRuntime,
        node_id: str,
        *,
        history: MetricHistory | None = None,
        on_alarm: Callable[[Score], None] | None = None,
        on_score: Callable[[Score], None] | None = None,
        realarm_s: float = 300.0,
        threshold: float | None = None,
        settle_s: float = MODEL_CHECK_SETTLE_S,
    ) -> None:
        """Creates a monitor.

        Args:
            runtime: the predictor (``PredictorRuntime.load(None)`` for rules only).
            node_id: this node's name in the history and the scores.
            history: where samples and failures are stored; None to store nothing.
            on_alarm: called with the score when an alarm starts and every ``realarm_s`` while it lasts.
            on_score: called with every score.
            realarm_s: seconds between two ``on_alarm`` calls of one lasting alarm (default 300).
            threshold: alarm when the score reaches this (in [0, 1]) instead of the model's own threshold
                (see :func:`with_threshold`); None (default) keeps the model's. Settable later.
            settle_s: seconds from the first tick with detector metrics to the check of the model's metrics
                (default :data:`MODEL_CHECK_SETTLE_S`; 0 checks the first tick).

        Raises:
            ValueError: ``realarm_s`` is not positive or ``node_id`` is empty.
        """
        if not realarm_s > 0:
            raise ValueError(f"realarm_s={realarm_s} must be > 0 seconds")
        if not settle_s >= 0:
            raise ValueError(f"settle_s={settle_s} must be >= 0 seconds")
        if not node_id:
            raise ValueError("node_id must be a non-empty node name")
        self.runtime = runtime
        # An Xid counted before the first tick, or before an Xid source's marker made the counter appear, is new:
        # without this the rules tier took it as the counter's baseline and never alarmed on it.
        runtime.rules.count_from_zero(EVENT_COUNTERS)
        self.node_id = node_id
        self.history = history
        self.on_alarm = on_alarm
        self.on_score = on_score
        self.realarm_s = float(realarm_s)
        self.threshold = threshold
        self.feed = CatalogFeed()
        self.problems: dict[str, int] = {}
        self.last_score: Score | None = None
        self.last_sample: dict[str, float] = {}
        self.absent_model_metrics: list[str] = []
        self._lock = threading.RLock()
        self.settle_s = float(settle_s)
        self._checked = False
        self._first_ts: float | None = None  # first tick with detector metrics: the settle window's start
        self._seen: set[str] = set()  # metric names some sample carried before the check
        self._last_ts: float | None = None
        self._alarm_up = False
        self._last_alarm_ts = -math.inf
        # Learned-tier alarm events counted against the configured threshold (the runtime counts against the
        # model's own), and the threshold they were counted at: a new threshold starts a new count.
        self._configured_ledger: AlarmLedger | None = None
        self._ledger_threshold: float | None = None

    @property
    def rules_only(self) -> bool:
        """True when no learned model scores (none given, or dropped for a feature mismatch)."""
        return self.runtime.model is None

    def observe_event(self, event: HealthEvent) -> None:
        """Takes one detector event (pass the runner's ``on_event`` stream here; thread-safe, never raises).

        Args:
            event: the event.
        """
        try:
            self.feed.observe_event(event)
        except Exception as exc:  # noqa: BLE001 - a malformed event must not break the runner's callback
            self._problem(f"event:{type(exc).__name__}", f"cannot use detector event {event!r}: {exc}")

    def _problem(self, key: str, message: str, level: int = logging.WARNING) -> None:
        with self._lock:
            first = key not in self.problems
            self.problems[key] = self.problems.get(key, 0) + 1
        log.log(level if first else logging.DEBUG, "predictor monitor: %s%s", message,
                "" if first else f" (x{self.problems[key]})")

    def _check_model(self) -> None:
        self._checked = True
        model = self.runtime.model
        unevaluable = self.runtime.rules.unevaluable(self._seen)
        if unevaluable:
            log.info("predictor monitor: rules that cannot fire on this node (no source metric): %s", unevaluable)
        if model is None:
            return
        waiting = [m for m in model.spec.metrics if m not in self._seen and m in WORKER_METRICS]
        if waiting:
            log.info("predictor monitor: %s not reported yet (no training step on this node so far); scored as "
                     "missing until the workers report steps", waiting)
        absent = [m for m in model.spec.metrics if m not in self._seen and m not in WORKER_METRICS]
        if not absent:
            return
        self.absent_model_metrics = absent
        log.error(
            "predictor monitor: the model was trained on %s, which this node does not produce (%s); scoring with "
            "the rules tier only. Enable the detectors that produce them, or retrain on this node's history "
            "(trainguard predictor export / train)", absent,
            ", ".join(f"{m}: {BY_NAME[m].description}" for m in absent if m in BY_NAME) or "not in the catalog",
        )
        self.runtime = PredictorRuntime(None, self.runtime.rules, top_k=self.runtime.top_k)

    def tick(self, ts: float, detector_metrics: Mapping[str, float], step_time_s: float | None = None) -> Score | None:
        """Maps, stores and scores one interval of this node.

        Args:
            ts: tick time, Unix seconds; must increase from tick to tick.
            detector_metrics: ``DetectorRunner.latest_metrics()``.
            step_time_s: duration of the node's last training step, seconds (None when no worker reported).

        Returns:
            The score, or None when the tick could not be scored (logged, see the class docstring).
        """
        with self._lock:
            score = self._score(ts, detector_metrics, step_time_s)
            if score is None:
                return None
            self._count_configured(score)
            score = with_threshold(score, self.threshold)
            fire = score.alarm and (not self._alarm_up or ts - self._last_alarm_ts >= self.realarm_s)
            self._alarm_up = score.alarm
            if fire:
                self._last_alarm_ts = ts
            self.last_score = score
        self._call("on_score", self.on_score, score)
        if fire:
            self._call("on_alarm", self.on_alarm, score)
        return score

    def _configured(self) -> float | None:
        t = self.threshold
        return None if t is None or math.isnan(t) else float(t)

    def _count_configured(self, score: Score) -> None:
        """Accounts ``score`` (the runtime's) in the configured threshold's alarm ledger (no-op when unset)."""
        threshold = self._configured()
        model = self.runtime.model
        if threshold is None or model is None:
            return
        if self._configured_ledger is None or self._ledger_threshold != threshold:
            ev = model.eval_config
            self._configured_ledger = AlarmLedger(ev.cooldown_s, 10.0 * model.spec.config.interval_s)
            self._ledger_threshold = threshold
        self._configured_ledger.add(score.ts, _reaches(score, threshold))

    def realised_alarms_per_day(self) -> float:
        """Learned-tier alarm events per observed node-day at the threshold in force: counted against the configured
        threshold since it was set, else the runtime's count against the model's own (NaN before any time)."""
        with self._lock:
            if self._configured() is not None and self._configured_ledger is not None:
                return self._configured_ledger.per_day
        return self.runtime.realised_alarms_per_day()

    def _call(self, name: str, fn: Callable[[Score], None] | None, score: Score) -> None:
        if fn is None:
            return
        try:
            fn(score)
        except Exception as exc:  # noqa: BLE001 - the agent loop must go on
            self._problem(f"{name}:{type(exc).__name__}", f"{name} callback raised {type(exc).__name__}: {exc}",
                          logging.ERROR)

    def _score(self, ts: float, detector_metrics: Mapping[str, float], step_time_s: float | None) -> Score | None:
        t = _finite(ts)
        if t is None:
            self._problem("ts-invalid", f"tick time {ts!r} is not a finite number; tick skipped")
            return None
        if self._last_ts is not None and t <= self._last_ts:
            self._problem("ts-not-increasing",
                          f"tick time {t} is not after the previous {self._last_ts} (clock stepped back?); skipped")
            return None
        if not isinstance(detector_metrics, Mapping):
            self._problem("metrics-type", f"detector metrics are a {type(detector_metrics).__name__}, not a "
                          "mapping; tick skipped")
            return None
        if not detector_metrics:
            self._problem("metrics-empty", "no detector metrics yet (runner not sampled?); tick skipped",
                          logging.INFO)
            return None
        try:
            sample = self.feed.sample(t, detector_metrics, step_time_s)
        except Exception as exc:  # noqa: BLE001
            self._problem(f"map:{type(exc).__name__}", f"cannot map detector metrics ({exc}); tick skipped")
            return None
        self._last_ts = t
        if not self._checked:
            self._seen.update(sample)
            if self._first_ts is None:
                self._first_ts = t
            if t - self._first_ts >= self.settle_s:
                self._check_model()
        measured = dict(sample)  # the history keeps what was read, not the NaN placeholders scored below
        model = self.runtime.model
        if model is not None:
            for m in model.spec.metrics:
                if m not in sample:
                    # before the check, its detector may not have sampled yet: judged at the settle window's end
                    if not self._checked:
                        sample[m] = math.nan
                        continue
                    if m in WORKER_METRICS:
                        self._problem(f"missing:{m}", f"{m} missing from this sample (no training step reported "
                                      "in this generation yet); scored as a missing reading", logging.INFO)
                    else:
                        self._problem(f"missing:{m}", f"{m} missing from this sample (its detector failed?); "
                                      "scored as a missing reading")
                    sample[m] = math.nan
        self.last_sample = sample
        if self.history is not None:
            try:
                self.history.append(t, self.node_id, measured)
            except Exception as exc:  # noqa: BLE001 - losing history must not stop scoring
                self._problem(f"history:{type(exc).__name__}", f"cannot store the sample: {exc}")
        try:
            return self.runtime.observe(t, self.node_id, sample)
        except Exception as exc:  # noqa: BLE001
            self._problem(f"observe:{type(exc).__name__}", f"predictor refused the sample: {exc}; tick skipped")
            return None

    def record_failure(self, ts: float, kind: str) -> None:
        """Stores an observed hard failure of this node in the history (the training labels; never raises).

        Args:
            ts: failure time, Unix seconds.
            kind: failure kind, e.g. ``"GPU Lost"``.
        """
        model = self.runtime.model
        if model is not None and model.calibration is not None and math.isfinite(ts):
            # the hours before a failure are an incident, not the node's normal tail: they leave the history
            # its threshold is fitted on (an alarm up to early_s before a failure is not a false one either)
            with self._lock:
                self.runtime.record_incident(self.node_id, ts - model.eval_config.early_s, ts)
        if self.history is None:
            return
        if not isinstance(kind, str) or not kind.strip():
            # still a failure, and a label: the history refuses an empty kind, which would have lost it
            kind = UNKNOWN_KIND
        with self._lock:
            try:
                self.history.record_event(ts, self.node_id, kind)
            except Exception as exc:  # noqa: BLE001
                self._problem(f"failure:{type(exc).__name__}", f"cannot store failure {kind!r} at {ts}: {exc}")
