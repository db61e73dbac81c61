"""DetectorRunner.sample_now: out-of-schedule rounds taken by the runner's own thread, waited for with a bound."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest

from trainguard.detectors.base import Detector, DetectorConfig, Sample
from trainguard.detectors.errors import DetectorConfigError
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.runner import DetectorRunner
from tg_testutil import until




class Fault(Detector):
    """Reports a one-shot fatal event when ``fatal`` rose since the last sample, and a lasting ``lost`` condition.

    Records the thread of every sample and fails the test if two samples ever overlap.
    """

    name: ClassVar[str] = "fault"

    def __init__(self, name: str, interval_s: float = 60.0) -> None:
        super().__init__(DetectorConfig(interval_s=interval_s))
        self.name = name  # type: ignore[misc]
        self.calls = 0
        self.fatal = 0
        self.lost = False
        self.gate: threading.Event | None = None  # when set, sample() waits on it
        self.threads: set[int] = set()
        self.overlap = False
        self._busy = threading.Lock()
        self._seen = 0

    def sample(self) -> Sample:
        if not self._busy.acquire(blocking=False):
            self.overlap = True
            return Sample()
        try:
            self.threads.add(threading.get_ident())
            if self.gate is not None:
                self.gate.wait(10)
            self.calls += 1
            s = Sample()
            if self.fatal > self._seen:
                s.events.append(self.event("test.fatal", Severity.CRITICAL, Action.DRAIN_NODE, "fatal error"))
            self._seen = self.fatal
            self.condition(s, "lost", self.lost, "test.lost", Severity.CRITICAL, Action.DRAIN_NODE, "device lost")
            return s
        finally:
            self._busy.release()


class Recorder:
    def __init__(self) -> None:
        self.events: list[HealthEvent] = []
        self.lock = threading.Lock()

    def __call__(self, ev: HealthEvent) -> None:
        with self.lock:
            self.events.append(ev)

    def kinds(self) -> list[str]:
        with self.lock:
            return [e.kind for e in self.events]


def test_sample_now_samples_named_detectors_in_the_runner_thread() -> None:
    hw, other = Fault("hw"), Fault("other")
    rec = Recorder()
    runner = DetectorRunner([hw, other], on_event=rec)
    runner.start()
    try:
        assert until(lambda: hw.calls == 1 and other.calls == 1)  # the first scheduled round; next in 60 s
        hw.fatal = 1
        events = runner.sample_now(["hw"], timeout_s=5.0)
        assert events is not None and [e.kind for e in events] == ["test.fatal"]
        assert events[0].action == Action.DRAIN_NODE
        assert "test.fatal" in rec.kinds(), "on_event saw the event before sample_now returned"
        assert hw.calls == 2 and other.calls == 1, "only the named detector was sampled"
        assert threading.get_ident() not in hw.threads and len(hw.threads) == 1, "sampled by the runner thread only"
        # A lasting condition shows in the status after the round, though its event was sent only once.
        hw.lost = True
        events = runner.sample_now(timeout_s=5.0)  # None: every detector
        assert [e.kind for e in events] == ["test.lost"] and other.calls == 2
        status = {s.name: s for s in runner.statuses()}
        assert [e.kind for e in status["hw"].conditions] == ["test.lost"] and status["other"].conditions == ()
        assert runner.sample_now(["hw"], timeout_s=5.0) == []  # still lost: no new event, condition kept
        assert [e.kind for e in runner.statuses()[0].conditions] == ["test.lost"]
        hw.lost = False
        assert [e.kind for e in runner.sample_now(["hw"], timeout_s=5.0)] == ["test.lost.cleared"]
        assert runner.statuses()[0].conditions == ()
        time.sleep(0.2)
        assert hw.calls == 5, "a forced round moves the detector's schedule; nothing else sampled it"
    finally:
        runner.stop()
    assert not hw.overlap and not other.overlap


def test_sample_now_waits_bounded_and_the_round_still_happens() -> None:
    slow = Fault("slow", interval_s=60.0)
    rec = Recorder()
    runner = DetectorRunner([slow], on_event=rec)
    runner.start()
    try:
        assert until(lambda: slow.calls == 1)
        slow.gate = threading.Event()
        slow.fatal = 1
        t0 = time.monotonic()
        assert runner.sample_now(["slow"], timeout_s=0.2) is None  # the sample hangs: the caller does not
        assert 0.15 <= time.monotonic() - t0 < 2.0
        slow.gate.set()
        assert until(lambda: "test.fatal" in rec.kinds()), "the round finished later and its event was sent"
    finally:
        slow.gate.set()
        runner.stop()


def test_concurrent_callers_share_rounds_and_never_overlap_samples() -> None:
    det = Fault("hw", interval_s=0.01)  # the schedule keeps sampling too
    runner = DetectorRunner([det])
    runner.start()
    results: list[list[HealthEvent] | None] = []
    lock = threading.Lock()

    def call() -> None:
        for _ in range(20):
            r = runner.sample_now(["hw"], timeout_s=5.0)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=call) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        runner.stop()
    assert len(results) == 80 and all(r == [] for r in results)
    assert not det.overlap and len(det.threads) == 1


def test_not_running_unknown_names_and_stop_release_callers() -> None:
    det = Fault("hw", interval_s=0.3)
    runner = DetectorRunner([det])
    assert runner.sample_now(["hw"], timeout_s=5.0) is None  # never started: no wait
    with pytest.raises(DetectorConfigError, match="no detector named \\['gpu'\\]"):
        runner.sample_now(["gpu"])
    det.gate = threading.Event()  # the first scheduled sample hangs
    runner.start()
    assert until(lambda: bool(det.threads))
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(runner.sample_now(["hw"], timeout_s=30.0)))
    waiter.start()
    time.sleep(0.1)  # the request waits behind the hung sample
    stopper = threading.Thread(target=runner.stop)
    stopper.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    det.gate.set()  # the hung sample returns; the loop sees stop and releases the caller without sampling
    waiter.join(10)
    stopper.join(10)
    assert not waiter.is_alive() and got == [None] and time.monotonic() - t0 < 5.0
    assert det.calls == 1, "no forced round after stop"
    t0 = time.monotonic()
    assert runner.sample_now(["hw"], timeout_s=5.0) is None and time.monotonic() - t0 < 0.5  # stopped: no wait
