"""Node health: the event source, the predictor, the drain timer and the event bus of one node.

Events come from an :class:`~trainguard.agent.parts.EventSource`: :class:`DetectorEventSource` runs the local
detectors; a node daemon's event stream can stand in for it. Every event goes on the bus (``WatchEvents``,
metrics, logs) and to the predictor; those asking for a process restart or more are queued for the composition
to act on (:meth:`LocalNodeHealth.take_actionable`). The predictor scores the source's metrics every interval;
an alarm is published, handed to ``on_alarm`` (ask for a job-wide checkpoint) and starts the drain timer, which
comes due after the grace or as soon as the asked-for checkpoint is complete (:meth:`LocalNodeHealth.due_drain`).
States: :data:`~trainguard.agent.parts.HEALTH_TRANSITIONS` (diagram in :mod:`trainguard.agent.parts`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainguard.agent.event_bus import EventBus
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.node_faults import NodeReportLedger, hardware_cause, hardware_detector_names
from trainguard.agent.parts import HEALTH_TRANSITIONS, EventSource, HealthState, HealthTrigger
from trainguard.detectors.events import Action, HealthEvent, Severity

log = logging.getLogger(__name__)

#: Worker exits reach the supervisor through its own poll; the process detector's copies are only published.
SEEN_BY_SUPERVISOR = frozenset({"process.killed", "process.failed", "process.exited", "process.vanished"})

_T = HealthTrigger


class DetectorEventSource:
    """The local detectors as an :class:`~trainguard.agent.parts.EventSource` (a
    :class:`~trainguard.detectors.runner.DetectorRunner` samples them on its own threads).

    Args:
        detectors: the detector instances (see :func:`trainguard.detectors.base.create_detectors`).
    """

    def __init__(self, detectors: Sequence[Any]) -> None:
        self.detectors = list(detectors)
        #: The detectors watching the node's hardware (all but ``process``).
        self.hardware_names = hardware_detector_names(self.detectors)
        self.runner: Any = None

    @classmethod
    def create(cls, names: Sequence[str], settings: Mapping[str, Mapping[str, Any]],
               worker_view: Any = None) -> "DetectorEventSource":
        """Builds the named detectors with their settings.

        Args:
            names: detector names (``trainguard detect --list``).
            settings: name -> fields.
            worker_view: what the ``process`` detector watches (the supervisor).

        Raises:
            DetectorConfigError: unknown detector or bad settings.
        """
        from trainguard.detectors.base import create_detectors

        return cls(create_detectors(list(names), dict(settings), worker_view=worker_view))

    def start(self, on_event: Callable[[HealthEvent], None]) -> None:
        """Starts the runner's sampling threads."""
        from trainguard.detectors.runner import DetectorRunner

        self.runner = DetectorRunner(self.detectors, on_event=on_event)
        self.runner.start()

    def stop(self) -> None:
        """Stops the runner (closing the detectors)."""
        if self.runner is not None:
            self.runner.stop()

    def latest_metrics(self) -> dict[str, float]:
        """The newest value of every detector metric."""
        return self.runner.latest_metrics() if self.runner is not None else {}

    def statuses(self) -> list:
        """Per-detector statuses."""
        return list(self.runner.statuses()) if self.runner is not None else []

    def sample_now(self, names: Sequence[str], timeout_s: float) -> list | None:
        """An out-of-schedule sample of the named detectors (None: not finished within ``timeout_s``)."""
        return self.runner.sample_now(names, timeout_s=timeout_s) if self.runner is not None else []


def tick_time(wall: float, mono: float, last: tuple[float, float] | None) -> float:
    """The time stamp of one predictor tick: the wall clock while it moves forward; once it stepped back (NTP, an
    operator's ``date -s``), the previous stamp plus the monotonic time since it. The predictor refuses samples
    whose time does not increase, so stamping on the raw clock left it blind, rules tier included (a fatal AER
    error, Xid 79), for as long as the clock had stepped back.

    Args:
        wall: the wall clock now, Unix seconds.
        mono: the monotonic clock now, seconds.
        last: ``(stamp, mono)`` of the previous tick, or None for the first.

    Returns:
        The stamp, Unix seconds: after the previous one, and the wall clock itself whenever that is.
    """
    if last is None or wall > last[0]:
        return wall
    return last[0] + max(mono - last[1], 1e-6)


class LocalNodeHealth:
    """One node's health watch (implements :class:`~trainguard.agent.parts.NodeHealth`).

    Args:
        node_id: stamped on events without a node.
        bus: the event bus (a new one by default).
        generation: returns the generation the node runs now (a drain is about the generation of its alarm).
        on_alarm: called with the published alarm event (the composition asks for a job-wide checkpoint).
        on_actionable: called when an event needing action was queued (the composition wakes its loop).
        threshold: the operator's alarm threshold in [0, 1]; None (or NaN) uses the model's own, calibrated per
            node (see :attr:`threshold`).
        wall_clock: the time stamp source of the predictor's samples, Unix seconds (default ``time.time``); see
            :func:`tick_time` for a clock that steps back.
    """

    def __init__(self, node_id: str, bus: EventBus | None = None, generation: Callable[[], int] = lambda: -1,
                 on_alarm: Callable[[HealthEvent], None] | None = None,
                 on_actionable: Callable[[], None] | None = None, threshold: float | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.bus = bus if bus is not None else EventBus()
        self.source: EventSource | None = None
        self.predictor: Any = None  # PredictorMonitor once start_predictor() ran
        self.on_alarm = on_alarm
        self.alarms_per_day = float("nan")  # realised learned-tier alarm rate (vs the budget)
        self._generation = generation
        self._on_actionable = on_actionable
        self._life: Lifecycle[HealthState, HealthTrigger] = Lifecycle("node health", HEALTH_TRANSITIONS,
                                                                      HealthState.INIT)
        self._lock = threading.RLock()
        self._pending: list[HealthEvent] = []
        self._score = 0.0
        # Of the last score; before it, 1.0 (only a rule hit, score 1.0, reaches it): a 0 read as "alert at 0" and
        # fired `score >= threshold` alert rules on the metrics at start-up.
        self._threshold = 1.0
        self._configured: float | None = None
        self.threshold = threshold  # type: ignore[assignment]
        self._interval_s = 5.0
        self._next_tick = 0.0
        self.drain_grace_s = 30.0
        # (when, alarm, generation at the alarm) of the drain the predictor scheduled.
        self._drain_due: tuple[float, HealthEvent, int] | None = None
        self._drain_after_step: int | None = None  # the job-wide checkpoint a pending drain waits for
        self._wall_clock = wall_clock
        self._last_stamp: tuple[float, float] | None = None  # (stamp, monotonic time) of the last tick
        self._stepped_back = False
        self._ticks = 0  # predictor ticks so far
        # (tick count, generation) when the last node-level fault event (drain or more) came from the detectors
        self._fault: tuple[int, int] | None = None

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def state(self) -> HealthState:
        """The current lifecycle state."""
        return self._life.state

    @property
    def score(self) -> float:
        """The predictor's last risk score in [0, 1]."""
        return self._score

    @property
    def interval_s(self) -> float:
        """Seconds between two predictor scores (see :meth:`start_predictor`)."""
        return self._interval_s

    @property
    def threshold(self) -> float:
        """The alarm threshold in force: the configured one when set, else the model's own threshold of the last
        score (per node, calibrated online; 1.0 before the first score). Alarms, ``GetHealth`` and the metrics
        all use it.

        Setting it (a configuration reload) takes effect from the next score; None or NaN: the model's own.
        """
        return self._configured if self._configured is not None else self._threshold

    @threshold.setter
    def threshold(self, value: float | None) -> None:
        configured = None if value is None or math.isnan(value) else float(value)
        self._configured = configured
        if self.predictor is not None:
            self.predictor.threshold = configured

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self, source: EventSource | None) -> None:
        """Starts watching ``source`` (None: no events, the predictor only scores what it is given)."""
        self.source = source
        if source is not None:
            source.start(self.observe)
        self._next_tick = time.monotonic() + self._interval_s
        self._life.fire_if(_T.START)

    def stop(self) -> None:
        """Stops the event source (any state -> STOPPED)."""
        if self.source is not None:
            self.source.stop()
        self._life.fire(_T.STOP)

    # -- events --------------------------------------------------------------------------------------------
    def observe(self, event: HealthEvent) -> None:
        """Takes one event of the source: to the predictor, on the bus, and queued when it asks for action."""
        self.predictor_event(event)
        event = event.with_node(self.node_id) if not event.node_id else event
        self.bus.publish(event)
        if event.action >= Action.DRAIN_NODE and event.kind != "predictor.alarm":
            with self._lock:
                self._fault = (self._ticks, self._generation())
        if event.action >= Action.RESTART_PROCESS and event.kind not in SEEN_BY_SUPERVISOR:
            with self._lock:
                self._pending.append(event)
            if self._on_actionable is not None:
                self._on_actionable()

    def predictor_event(self, event: HealthEvent) -> None:
        """Feeds a detector event (XIDs, link flaps) to the predictor only; thread-safe."""
        if self.predictor is not None:
            self.predictor.observe_event(event)

    def take_actionable(self) -> list[HealthEvent]:
        """The queued events asking for a restart or more (the queue is emptied)."""
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def pending(self) -> list[HealthEvent]:
        """A copy of the queued events (the queue is kept)."""
        with self._lock:
            return list(self._pending)

    def hardware_cause(self, ledger: NodeReportLedger, generation: int) -> HealthEvent | None:
        """The node-level hardware event explaining a worker failure of ``generation`` now, if any (see
        :func:`trainguard.agent.node_faults.hardware_cause`)."""
        source = self.source
        names = getattr(source, "hardware_names", ())
        return hardware_cause(source, names, self.pending, ledger, generation, self.node_id)

    def record_failure(self, ts: float, kind: str) -> None:
        """Stores a hard failure of this node in the predictor's history (its training labels).

        Args:
            ts: failure time on the wall clock (``time.time()``), Unix seconds; stored on the samples' clock
                (see :meth:`on_sample_clock`).
            kind: failure kind, e.g. ``"process.exit"``.
        """
        if self.predictor is not None:
            self.predictor.record_failure(self.on_sample_clock(ts), kind)

    def on_sample_clock(self, ts: float) -> float:
        """A wall-clock time ``ts`` on the clock the predictor's samples are stamped on: ``ts`` itself, but after
        the wall clock stepped back (see :func:`tick_time`) shifted by what the samples run ahead of it. Failures
        stamped on the raw clock were labelled the step away from the samples they came with, so training and
        evaluation read the wrong samples as those before the failure."""
        last = self._last_stamp
        if last is None:
            return ts
        wall, mono = self._wall_clock(), time.monotonic()
        return ts + (tick_time(wall, mono, last) - wall)

    # -- predictor -----------------------------------------------------------------------------------------
    def start_predictor(self, model_path: str | None, history_path: str | None, interval_s: float = 5.0,
                        drain_grace_s: float = 30.0, interval_key: str = "--predictor-interval-s") -> None:
        """Scores failure risk from the source's metrics every ``interval_s`` seconds.

        Args:
            model_path: a trained predictor model file, or None for the rules tier only.
            history_path: SQLite file keeping the metric history (training data), or None.
            interval_s: seconds between scores.
            drain_grace_s: seconds from an alarm (checkpoint asked for) to the drain request.
            interval_key: the flag or config key setting ``interval_s``, named in the warning about a model trained
                at another interval.

        Raises:
            TrainguardError: the model or history file is unusable (named in the message).
        """
        from trainguard.predictor.online_feed import PredictorMonitor
        from trainguard.predictor.history import MetricHistory
        from trainguard.predictor.runtime import PredictorRuntime

        runtime = PredictorRuntime.load(model_path, missing="nan")
        trained_s = runtime.model.spec.config.interval_s if runtime.model is not None else interval_s
        if interval_s > 0 and abs(interval_s - trained_s) > 0.25 * trained_s:
            # The features count rows against the trained interval (coverage, gaps, the per-row baselines), so
            # scores at another interval are not those the model was trained and calibrated on.
            log.warning("predictor: the model %s was trained on samples every %g s but scores every %g s here; its "
                        "features and scores will differ from training: score every %g s "
                        "(%s) or retrain with --interval %g", model_path, trained_s, interval_s, trained_s,
                        interval_key, interval_s)
        history = MetricHistory(history_path) if history_path else None
        if history is not None:
            self._continue_history(history)
        self._interval_s = interval_s
        self.drain_grace_s = drain_grace_s
        self.predictor = PredictorMonitor(
            runtime, self.node_id, history=history,
            on_score=self._on_score, on_alarm=self._on_alarm, threshold=self._configured,
        )

    def _continue_history(self, history: Any) -> None:
        """Continues the samples' clock from the history's newest sample of this node when that is ahead of the
        wall clock (it stepped back while the agent was down): the history refuses samples at or before it, so it
        recorded nothing, the next model's training data, for as long as the step, while scoring went on."""
        from trainguard.predictor.errors import HistoryError

        try:
            stored = history.last_ts(self.node_id)
        except HistoryError as exc:  # a full disk: scoring goes on, and the appends say it (once)
            log.warning("predictor: %s", exc)
            return
        wall = self._wall_clock()
        if stored is None or stored < wall:
            return
        self._last_stamp = (stored, time.monotonic())
        self._stepped_back = True  # this warning is the one of this step
        log.warning("predictor: the metric history %s holds samples of node %r up to %.1f s ahead of the wall clock "
                    "(it stepped back since they were stored); samples are stamped on continued time from the newest "
                    "stored one until the clock catches up. If those stored times are wrong (a file from another "
                    "host), move the file aside to start a new history", history.path, self.node_id, stored - wall)

    def tick(self, step_time_s: float | None = None, metrics: Mapping[str, float] | None = None) -> None:
        """Scores one sample when an interval has passed (call from the owner's loop).

        Args:
            step_time_s: the node's newest training step time, seconds, or None.
            metrics: the sample; default the source's latest metrics.
        """
        if self.predictor is None or time.monotonic() < self._next_tick:
            return
        self._next_tick = time.monotonic() + self._interval_s
        if metrics is None:
            metrics = self.source.latest_metrics() if self.source is not None else {}
        wall, mono = self._wall_clock(), time.monotonic()
        ts = tick_time(wall, mono, self._last_stamp)
        if ts != wall and not self._stepped_back:  # once per step, not every tick
            log.warning("predictor: the wall clock stepped back %.1f s; samples are stamped on continued time "
                        "(%.1f s ahead of the clock) so the predictor keeps scoring", ts - wall, ts - wall)
        self._stepped_back = ts != wall
        self._last_stamp = (ts, mono)
        self.predictor.tick(ts, metrics, step_time_s)
        with self._lock:
            self._ticks += 1

    def _on_score(self, score: Any) -> None:
        self._score = score.score
        self._threshold = score.threshold
        if self.predictor is not None:
            self.alarms_per_day = self.predictor.realised_alarms_per_day()  # at the threshold in force

    def _on_alarm(self, score: Any) -> None:
        top = ", ".join(f"{name}={value:.3g}" for name, value in score.top_features[:3])
        event = HealthEvent(
            source="predictor", kind="predictor.alarm",
            severity=Severity.CRITICAL if score.source == "rules" else Severity.WARNING,
            action=Action.DRAIN_NODE,
            message=f"failure risk {score.score:.2f} >= {score.threshold:.2f} ({score.source}): {top}",
            evidence={"score": f"{score.score:.4f}", "threshold": f"{score.threshold:.4f}", "source": score.source,
                      **{f"feature.{n}": f"{v:.6g}" for n, v in score.top_features[:5]},
                      **{f"rule.{h.rule}": h.description for h in score.rule_hits}},
            node_id=self.node_id,
        )
        self.alarm(event)

    def alarm(self, event: HealthEvent) -> None:
        """A predicted failure (this predictor's, or a node daemon's ``predictor.alarm``): published, handed to
        ``on_alarm`` (ask for a job-wide checkpoint), and the drain timer started."""
        self.bus.publish(event)
        log.warning("predictor alarm: %s; asking for a checkpoint now, drain request in %.1f s",
                    event.message, self.drain_grace_s)
        if self.on_alarm is not None:
            self.on_alarm(event)
        with self._lock:
            self._life.fire_if(_T.ALARM)  # not after stop()
            if self._drain_due is None:
                self._drain_due = (time.monotonic() + self.drain_grace_s, event, self._alarm_generation(event))

    def _alarm_generation(self, event: HealthEvent) -> int:
        """The generation a drain for ``event`` is about. A rules-tier alarm reads the same sample as a detector's
        node-level fault event (a fatal AER error, Xid 79), one tick later: when such an event came since the tick
        before, the alarm is about that event's generation. Stamped with the generation now, it drained the node
        a second time after the coordinator had already restarted the job for the event (two restarts of the
        budget for one fault), as the drain only stands down for a report since the alarm's generation."""
        now = self._generation()
        fault = self._fault
        if event.evidence.get("source") == "rules" and fault is not None and fault[0] >= self._ticks - 1:
            return min(now, fault[1])
        return now

    # -- drain timer ---------------------------------------------------------------------------------------
    @property
    def drain_pending(self) -> bool:
        """Whether a predicted failure's drain is scheduled."""
        return self._drain_due is not None

    def drain_after(self, step: int) -> None:
        """The job-wide checkpoint the pending drain waits for is ``step`` (no-op without a pending drain)."""
        with self._lock:
            if self._drain_due is not None:
                self._drain_after_step = step

    def due_drain(self, step_complete: Callable[[int], bool]) -> tuple[HealthEvent, int] | None:
        """The scheduled drain, when it is due: the grace passed, or the job-wide checkpoint it waits for is
        complete (``step_complete(step)``). The timer is then cleared (ALARMED -> DRAINING: call
        :meth:`drained` once the drain was reported or found unneeded).

        Returns:
            (the alarm event, the generation at the alarm), or None when nothing is due.
        """
        with self._lock:
            due = self._drain_due
            if due is None:
                return None
            # Drain as soon as the job-wide checkpoint the alarm asked for is complete on disk (every rank's
            # commit marker), rather than train on for the rest of the grace only to lose those steps.
            if time.monotonic() < due[0] and not (self._drain_after_step is not None
                                                  and step_complete(self._drain_after_step)):
                return None
            self._drain_due = None
            self._drain_after_step = None
            self._life.fire_if(_T.DRAIN_DUE)
        return due[1], due[2]

    def drained(self) -> None:
        """The due drain was reported (or was already done): DRAINING -> WATCHING."""
        self._life.fire_if(_T.DRAINED)


__all__ = ["DetectorEventSource", "LocalNodeHealth", "SEEN_BY_SUPERVISOR", "tick_time"]
