"""Runs the configured detectors on their intervals in one background thread and keeps their latest state.

The agent embeds one :class:`DetectorRunner`. Polled detectors share a single thread, sampled in due-time order;
each :class:`~trainguard.detectors.base.ListeningDetector` (netlink link state) additionally gets its own thread
that blocks on its event source. A detector that raises, or reports unreadable inputs, is isolated: the runner
records state ERROR and yields one ``detector.error`` event per distinct problem (and one ``detector.error.cleared``
when it reads cleanly again); the other detectors keep running. The condition and one-off events a ``sample()``
raised before it raised are delivered all the same: the detector already holds those conditions as started (or
ended), and its counters have moved past those one-off events.

Lifecycle::

    created --start()--> running --stop()--> stopped
       |                                       ^
       +---------------stop()------------------+

``start()`` and ``stop()`` are idempotent; ``stop()`` joins every thread it started and closes the detectors.
A stopped runner is not restarted.

Out-of-schedule samples. :meth:`DetectorRunner.sample_now` wakes the sampling thread to sample some detectors at
once and lets the caller wait, bounded, for that round: the agent uses it when a worker dies, to learn whether
the hardware failed with it, without sampling a detector from a second thread.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.detectors.base import (
    DETECTOR_ERROR_KIND,
    Detector,
    DetectorState,
    ListeningDetector,
    Sample,
)
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.text import printable, transmittable

log = logging.getLogger(__name__)

#: Seconds a listener that crashed waits before listening again.
LISTENER_RETRY_S = 5.0
#: A sample() running longer than this many seconds shows its detector as stalled (state ERROR).
STALL_AFTER_S = 30.0

EventCallback = Callable[[HealthEvent], None]
# Longest single wait of the sampling thread; it re-checks what is due after each.
_MAX_WAIT_S = 3600.0


@dataclass(frozen=True)
class DetectorStatus:
    """What the runner knows about one detector.

    Attributes:
        name: detector name.
        state: state after its latest sample (OK before the first one).
        detail: one line explaining the state.
        metrics: latest metrics, names local to the detector.
        sampled_at: Unix time of the latest sample, 0.0 before the first.
        sample_s: seconds the latest sample took.
        samples: number of samples taken.
        conditions: start events of the detector's conditions active after its latest sample (edge-triggered
            conditions send no new event while they last; this is how a consumer learns they still hold).
    """

    name: str
    state: DetectorState
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    sampled_at: float = 0.0
    sample_s: float = 0.0
    samples: int = 0
    conditions: tuple[HealthEvent, ...] = ()

    def __post_init__(self) -> None:
        # the detail quotes what was read (a device path, a kernel log line): one printable line
        object.__setattr__(self, "detail", printable(self.detail))

    def to_proto(self) -> Any:
        """Converts to a ``trainguard.v1.DetectorStatus`` message."""
        from trainguard.proto import agent_pb2

        return agent_pb2.DetectorStatus(
            name=self.name, state=int(self.state), detail=self.detail,
            metrics={transmittable(k): v for k, v in self.metrics.items()},  # a metric may name a device
        )


@dataclass
class _SampleRequest:
    """One :meth:`DetectorRunner.sample_now` call waiting for its round."""

    names: frozenset[str]
    done: threading.Event = field(default_factory=threading.Event)
    events: list[HealthEvent] = field(default_factory=list)
    served: bool = False


class DetectorRunner:
    """Samples detectors on their intervals and forwards their events.

    Args:
        detectors: the detectors to run; names must be unique. The runner owns them and closes them on stop.
        on_event: called for every event, from the runner thread or a listener thread; must be quick and
            thread-safe. Exceptions it raises are logged and swallowed.
    """

    def __init__(self, detectors: Sequence[Detector], on_event: EventCallback | None = None) -> None:
        names = [d.name for d in detectors]
        if len(set(names)) != len(names):
            raise DetectorConfigError(f"detectors {names} include a name twice; each detector runs once")
        self._detectors = list(detectors)
        self._on_event = on_event
        self._lock = threading.Lock()
        self._statuses: dict[str, DetectorStatus] = {
            d.name: DetectorStatus(d.name, DetectorState.OK) for d in detectors
        }
        self._errors: dict[str, set[str]] = {d.name: set() for d in detectors}
        self._stop = threading.Event()
        # Wakes the sampling thread early: a sample_now() request, or stop().
        self._kick = threading.Event()
        self._requests: list[_SampleRequest] = []
        self._threads: list[threading.Thread] = []
        self._started = False
        self._stopped = False
        self._current: tuple[str, float] | None = None

    @property
    def detectors(self) -> list[Detector]:
        """The detectors, in configuration order."""
        return list(self._detectors)

    def start(self) -> None:
        """Starts the sampling thread and one thread per listening detector (no-op if already started)."""
        with self._lock:
            if self._started or self._stopped:
                return
            self._started = True
        sampler = threading.Thread(target=self._sample_loop, name="trainguard-detectors", daemon=True)
        self._threads.append(sampler)
        for det in self._detectors:
            if isinstance(det, ListeningDetector):
                t = threading.Thread(target=self._listen_loop, args=(det,), name=f"trainguard-{det.name}", daemon=True)
                self._threads.append(t)
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops and joins every thread, then closes the detectors (idempotent).

        Args:
            timeout_s: seconds to wait for each thread.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        self._kick.set()
        for det in self._detectors:
            if isinstance(det, ListeningDetector):
                try:
                    det.stop_listening()
                except Exception:  # noqa: BLE001 - stopping must go on for the others
                    log.exception("detector %s failed to stop listening", det.name)
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                log.warning("detector thread %s did not stop within %.1f s", t.name, timeout_s)
        for det in self._detectors:
            try:
                det.close()
            except Exception:  # noqa: BLE001
                log.exception("detector %s failed to close", det.name)

    def __enter__(self) -> "DetectorRunner":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run_once(self) -> list[HealthEvent]:
        """Samples every detector once, now, in the caller's thread (``trainguard detect``, tests).

        Not to be called while the runner is started: a detector is sampled from one thread at a time.

        Returns:
            The events raised (also passed to ``on_event``).
        """
        events: list[HealthEvent] = []
        for det in self._detectors:
            events.extend(self._sample(det))
        return events

    def sample_now(self, names: Iterable[str] | None = None, timeout_s: float = 1.0) -> list[HealthEvent] | None:
        """Has the sampling thread sample ``names`` at once, out of schedule, and waits for that round.

        The samples are taken in the runner's own thread, so a detector is never sampled by two threads at
        once; their events reach ``on_event`` before this returns, as for scheduled samples. A sample already
        in progress finishes first. Each detector sampled gets its next scheduled sample one interval later.
        Concurrent calls are served together in one round.

        Args:
            names: detectors to sample, by name; None samples every detector.
            timeout_s: seconds to wait at most for the round to finish.

        Returns:
            The events the round raised (in configuration order), or None when the runner is not running
            (never started, or stopped) or the round did not finish within ``timeout_s``; the round still
            happens then, its events still reach ``on_event``.

        Raises:
            DetectorConfigError: a name is not one of this runner's detectors.
        """
        known = {d.name for d in self._detectors}
        wanted = frozenset(known if names is None else names)
        unknown = sorted(wanted - known)
        if unknown:
            raise DetectorConfigError(
                f"sample_now: no detector named {unknown} in this runner; it runs {sorted(known)}")
        request = _SampleRequest(wanted)
        with self._lock:
            if not self._started or self._stopped:
                return None
            self._requests.append(request)
        self._kick.set()
        if not request.done.wait(max(0.0, timeout_s)):
            return None
        return list(request.events) if request.served else None

    def latest_metrics(self) -> dict[str, float]:
        """The latest metrics of every detector, flattened as ``"<detector>.<metric>"`` -> value."""
        with self._lock:
            return {f"{s.name}.{k}": v for s in self._statuses.values() for k, v in s.metrics.items()}

    def statuses(self) -> list[DetectorStatus]:
        """The status of every detector, in configuration order.

        A detector whose ``sample()`` has been running for longer than :data:`STALL_AFTER_S` (a filesystem that
        hangs ``statvfs``, a wedged driver) is shown in state ERROR, since it also holds up the detectors
        sampled after it.
        """
        with self._lock:
            out = [self._statuses[d.name] for d in self._detectors]
            current = self._current
        if current is not None:
            name, started = current
            stuck = time.monotonic() - started
            if stuck > STALL_AFTER_S:
                out = [replace(st, state=DetectorState.ERROR,
                               detail=f"sample() has not returned for {stuck:.0f} s; the detectors after it wait")
                       if st.name == name else st for st in out]
        return out

    def _sample_loop(self) -> None:
        due = [(time.monotonic(), i) for i in range(len(self._detectors))]
        heapq.heapify(due)
        try:
            while not self._stop.is_set():
                # Cleared before the requests are taken, so a request arriving after that sets it again and
                # the wait below returns at once.
                self._kick.clear()
                self._serve_requests(due)
                wait = due[0][0] - time.monotonic() if due else None
                if wait is None or wait > 0:
                    # Bounded: a wait beyond the platform's time_t raises OverflowError and ends this thread.
                    self._kick.wait(min(wait, _MAX_WAIT_S) if wait is not None else None)
                    continue
                when, index = heapq.heappop(due)
                det = self._detectors[index]
                self._sample(det)
                # Schedule from the planned time so intervals do not drift, but never catch up in a burst.
                nxt = max(when + det.config.interval_s, time.monotonic())
                heapq.heappush(due, (nxt, index))
        finally:
            # Callers still waiting get None at once instead of sitting out their timeout.
            with self._lock:
                left, self._requests = self._requests, []
            for request in left:
                request.done.set()

    def _serve_requests(self, due: list[tuple[float, int]]) -> None:
        """Samples the detectors that pending :meth:`sample_now` calls asked for, once each, and reschedules them."""
        with self._lock:
            requests, self._requests = self._requests, []
        if not requests:
            return
        wanted = frozenset().union(*(r.names for r in requests))
        raised: dict[str, list[HealthEvent]] = {}
        for det in self._detectors:
            if det.name in wanted and not self._stop.is_set():
                raised[det.name] = self._sample(det)
        now = time.monotonic()
        due[:] = [(now + self._detectors[i].config.interval_s if self._detectors[i].name in raised else when, i)
                  for when, i in due]
        heapq.heapify(due)
        for request in requests:
            request.events = [ev for det in self._detectors if det.name in request.names
                              for ev in raised.get(det.name, ())]
            request.served = request.names <= raised.keys()
            request.done.set()

    def _sample(self, det: Detector) -> list[HealthEvent]:
        started = time.monotonic()
        with self._lock:
            self._current = (det.name, started)
        changed: list[HealthEvent] = []
        try:
            with det.recording_events() as changed:
                sample = det.sample()
            if not isinstance(sample, Sample):
                raise TypeError(f"sample() returned {type(sample).__name__}, not Sample")
        except Exception as exc:  # noqa: BLE001 - a broken detector must not take the agent down
            log.debug("detector %s raised", det.name, exc_info=True)
            # A read error says what it is itself; anything else is named by its type (a bug in the detector).
            err = exc if isinstance(exc, DetectorReadError) else DetectorReadError(det.name,
                                                                                  f"{type(exc).__name__}: {exc}")
            # The conditions it started or ended before raising are already marked so in the detector, and the
            # counters behind its one-off events (an uncorrectable error, a fatal AER error, an Xid) already moved
            # past them; their events went with the lost sample and would never come again (a drain never sent).
            # Delivered here; the state machine is left as it is, so nothing races a listener thread's conditions.
            sample = Sample(events=list(changed))
            sample.error(err)
            sample.detail = str(err)
            tb = "".join(traceback.format_exception(exc, limit=-3)).strip()
            sample.errors[-1].traceback = tb  # type: ignore[attr-defined]
        elapsed = time.monotonic() - started
        conditions = tuple(det.active_conditions())
        with self._lock:
            self._current = None
        events = list(sample.events) + self._error_events(det.name, sample.errors)
        with self._lock:
            prev = self._statuses[det.name]
            self._statuses[det.name] = DetectorStatus(
                name=det.name,
                state=sample.state,
                detail=sample.detail,
                metrics=dict(sample.metrics),
                sampled_at=time.time(),
                sample_s=elapsed,
                samples=prev.samples + 1,
                conditions=conditions,
            )
        for ev in events:
            self._emit(ev)
        return events

    def _error_events(self, name: str, errors: list[DetectorReadError]) -> list[HealthEvent]:
        current = {str(e): e for e in errors}
        with self._lock:
            known = self._errors[name]
            new = [current[k] for k in current if k not in known]
            cleared = bool(known) and not current
            self._errors[name] = set(current)
        events = []
        for err in new:
            evidence = {"path": err.path, "reason": err.reason}
            tb = getattr(err, "traceback", "")
            if tb:
                evidence["traceback"] = tb
            events.append(
                HealthEvent(
                    source=name,
                    kind=DETECTOR_ERROR_KIND,
                    severity=Severity.WARNING,
                    action=Action.WATCH,
                    message=f"detector {name} cannot read its input: {err}",
                    subject=err.path,
                    evidence=evidence,
                )
            )
        if cleared:
            events.append(
                HealthEvent(
                    source=name,
                    kind=DETECTOR_ERROR_KIND + ".cleared",
                    severity=Severity.INFO,
                    action=Action.NONE,
                    message=f"detector {name} reads its inputs again",
                )
            )
        return events

    def _emit(self, event: HealthEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # noqa: BLE001 - a consumer bug must not stop detection
            log.exception("on_event callback failed for %s", event.kind)

    def _listen_loop(self, det: ListeningDetector) -> None:
        last_error = ""
        while not self._stop.is_set():
            try:
                det.listen(self._emit)
                return
            except Exception as exc:  # noqa: BLE001
                if self._stop.is_set():
                    return
                reason = f"listener failed: {type(exc).__name__}: {exc}"
                log.warning("detector %s: %s; retrying in %.0f s", det.name, printable(reason), LISTENER_RETRY_S)
                if reason != last_error:  # one event per distinct failure, not one per retry
                    last_error = reason
                    self._emit(HealthEvent(
                        source=det.name, kind=DETECTOR_ERROR_KIND, severity=Severity.WARNING, action=Action.WATCH,
                        message=f"detector {det.name} cannot listen for events: {reason}", subject=det.name,
                        evidence={"path": det.name, "reason": reason},
                    ))
                self._stop.wait(LISTENER_RETRY_S)
