"""DetectorRunner: scheduling, failure isolation, listener threads, lifecycle, status conversion."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import pytest

import trainguard.detectors.runner as runner_mod
from trainguard.detectors.base import (
    Detector,
    DetectorConfig,
    DetectorState,
    ListeningDetector,
    Sample,
)
from trainguard.detectors.errors import DetectorConfigError
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.runner import DetectorRunner
from tg_testutil import until




class Counting(Detector):
    """Counts its samples; raises while ``broken`` is set."""

    name: ClassVar[str] = "counting"

    def __init__(self, name: str, interval_s: float) -> None:
        super().__init__(DetectorConfig(interval_s=interval_s))
        self.name = name  # type: ignore[misc]
        self.calls = 0
        self.broken = False
        self.closed = False

    def sample(self) -> Sample:
        self.calls += 1
        if self.broken:
            raise RuntimeError("sensor exploded")
        s = Sample(metrics={"calls": float(self.calls), "temp_c[gpu0]": 40.0})
        self.condition(s, "hot", self.calls == 2, "test.hot", Severity.WARNING, Action.WATCH, "hot")
        return s

    def close(self) -> None:
        self.closed = True


class Listening(ListeningDetector):
    """Emits one event per 10 ms from its listener thread until stopped; or fails ``failures`` times first."""

    name: ClassVar[str] = "listening"

    def __init__(self, failures: int = 0) -> None:
        super().__init__(DetectorConfig(interval_s=10.0))
        self.failures = failures
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def sample(self) -> Sample:
        return Sample()

    def listen(self, emit) -> None:
        self.thread = threading.current_thread()
        if self.failures:
            self.failures -= 1
            raise OSError("no such namespace")
        while not self.stop.wait(0.01):
            emit(self.event("test.tick", Severity.INFO, Action.NONE, "tick"))

    def stop_listening(self) -> None:
        self.stop.set()


def test_intervals_failure_isolation_and_recovery() -> None:
    fast, slow = Counting("fast", 0.02), Counting("slow", 60.0)
    events: list[HealthEvent] = []
    lock = threading.Lock()

    def on_event(ev: HealthEvent) -> None:
        with lock:
            events.append(ev)

    runner = DetectorRunner([fast, slow], on_event=on_event)
    runner.start()
    try:
        assert until(lambda: fast.calls >= 5)
        assert slow.calls == 1
        metrics = runner.latest_metrics()
        assert metrics["fast.calls"] >= 5 and metrics["slow.temp_c[gpu0]"] == 40.0
        fast.broken = True
        assert until(lambda: runner.statuses()[0].state == DetectorState.ERROR)
        st = {s.name: s for s in runner.statuses()}
        assert st["fast"].state == DetectorState.ERROR and "sensor exploded" in st["fast"].detail
        assert st["slow"].state == DetectorState.OK
        fast.broken = False
        assert until(lambda: any(e.kind == "detector.error.cleared" for e in list(events)))
    finally:
        runner.stop()
    kinds = [e.kind for e in events if e.source == "fast"]
    assert kinds.count("detector.error") == 1, "one event per distinct failure, not one per sample"
    err = next(e for e in events if e.kind == "detector.error")
    assert "RuntimeError: sensor exploded" in err.evidence["reason"] and "traceback" in err.evidence
    assert "detector.error.cleared" in kinds
    assert kinds.count("test.hot") == 1 and kinds.count("test.hot.cleared") == 1
    assert fast.closed and slow.closed


def test_on_event_exceptions_do_not_stop_detection() -> None:
    det = Counting("c", 0.02)

    def bad(ev: HealthEvent) -> None:
        raise ValueError("consumer bug")

    with DetectorRunner([det], on_event=bad):
        assert until(lambda: det.calls >= 4)  # "hot" at call 2 raised inside on_event


def ours() -> list[str]:
    """The detector threads alive in this process (a daemon test run before in this process has gRPC threads)."""
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("trainguard-") and "stackdump" not in t.name and "grpc" not in t.name)


def test_start_stop_idempotent_and_threads_joined() -> None:
    assert ours() == []
    runner = DetectorRunner([Counting("c", 0.05), Listening()])
    runner.stop()  # stop before start: nothing to join, and a later start is refused
    runner.start()
    assert ours() == []
    lis = Listening()
    runner = DetectorRunner([Counting("c", 0.05), lis], on_event=lambda e: None)
    runner.start()
    runner.start()
    assert ours() == ["trainguard-detectors", "trainguard-listening"]
    runner.stop()
    runner.stop()
    assert ours() == []
    assert lis.thread is not None and not lis.thread.is_alive()


def test_listener_events_and_failures(monkeypatch) -> None:
    monkeypatch.setattr(runner_mod, "LISTENER_RETRY_S", 0.05)
    events: list[HealthEvent] = []
    with DetectorRunner([Listening(failures=3)], on_event=events.append):
        deadline = time.monotonic() + 5
        while not any(e.kind == "test.tick" for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
    kinds = [e.kind for e in events]
    assert kinds.count("detector.error") == 1  # three identical failures, one event
    assert "test.tick" in kinds


def test_duplicate_names_and_status_proto() -> None:
    with pytest.raises(DetectorConfigError, match="twice"):
        DetectorRunner([Counting("a", 1.0), Counting("a", 1.0)])
    runner = DetectorRunner([Counting("a", 1.0)])
    runner.run_once()
    msg = runner.statuses()[0].to_proto()
    from trainguard.proto import agent_pb2

    assert msg.state == agent_pb2.DETECTOR_STATE_OK and msg.name == "a" and msg.metrics["calls"] == 1.0
    for state in DetectorState:
        assert agent_pb2.DetectorState.Name(int(state)) == f"DETECTOR_STATE_{state.name}"


def test_config_validation() -> None:
    @dataclass
    class Cfg(DetectorConfig):
        threshold: float = 1.0
        names: tuple[str, ...] = ()

    c = Cfg.from_dict({"threshold": 3, "names": ["a"], "root": "/tmp"})
    assert c.threshold == 3.0 and c.names == ("a",) and c.path("/sys/x") == "/tmp/sys/x"
    with pytest.raises(DetectorConfigError, match="must be of type float"):
        Cfg.from_dict({"threshold": "high"})
    with pytest.raises(DetectorConfigError, match="interval_s"):
        Cfg.from_dict({"interval_s": 0})


def test_a_stalled_sample_shows_as_error(monkeypatch) -> None:
    monkeypatch.setattr(runner_mod, "STALL_AFTER_S", 0.1)
    release = threading.Event()

    class Stuck(Counting):
        def sample(self) -> Sample:
            release.wait(5)
            return super().sample()

    runner = DetectorRunner([Stuck("nfs", 60.0), Counting("after", 60.0)])
    runner.start()
    try:
        assert until(lambda: runner.statuses()[0].state == DetectorState.ERROR)
        st = {s.name: s for s in runner.statuses()}
        assert st["nfs"].state == DetectorState.ERROR and "has not returned" in st["nfs"].detail
        assert st["after"].samples == 0
    finally:
        release.set()
        runner.stop()
    assert {s.name: s.state for s in runner.statuses()} == {"nfs": DetectorState.OK, "after": DetectorState.OK}


def test_a_read_error_raised_out_of_sample_is_reported_as_itself(tmp_path) -> None:
    """A detector's top folder that exists but cannot be listed: one read error naming the folder and the cause,
    not an OSError with a traceback, nor the error's text wrapped in its own class name."""
    from trainguard.detectors.edac import EdacConfig, EdacDetector

    mc = tmp_path / "sys/devices/system/edac/mc"
    mc.parent.mkdir(parents=True)
    mc.symlink_to("mc")  # ELOOP on listing (root reads past permissions)
    events: list = []
    runner = DetectorRunner([EdacDetector(EdacConfig(root=str(tmp_path)))], on_event=events.append)
    runner.run_once()
    (status,) = runner.statuses()
    assert status.state == DetectorState.ERROR
    assert status.detail.startswith(f"{mc}: cannot list (Too many levels of symbolic links)"), status.detail
    assert [e.subject for e in events if e.kind == "detector.error"] == [str(mc)]


@pytest.mark.parametrize("interval", [1e12, float("inf"), float("nan"), 86400.5, 0.0])
def test_a_detector_interval_beyond_a_day_or_not_finite_is_refused_naming_it(tmp_path, interval) -> None:
    """A per-detector ``interval_s`` of 1e12 passed (> 0) and ended the runner's sampling thread with an
    OverflowError traceback: the daemon then served stale states forever."""
    from trainguard.detectors.base import create_detectors

    with pytest.raises(DetectorConfigError, match=r"interval_s=.* must be > 0 and at most 86400 seconds"):
        create_detectors(["edac"], {"edac": {"interval_s": interval}}, root=str(tmp_path))


def test_the_sampling_thread_survives_a_wait_past_the_platforms_time_t(tmp_path) -> None:
    """Whatever the interval, the runner's thread keeps serving (here one set after validation)."""
    from trainguard.detectors.edac import EdacConfig, EdacDetector

    det = EdacDetector(EdacConfig(root=str(tmp_path)))
    det.config.interval_s = 1e12
    runner = DetectorRunner([det])
    runner.start()
    try:
        assert runner.sample_now(["edac"], timeout_s=10) is not None  # after the first sample's long wait
        assert runner.sample_now(["edac"], timeout_s=10) is not None
    finally:
        runner.stop()
