"""A sample that raises partway: the condition events it raised before the failure still reach the consumer.

Detector.condition() marks a condition active as it returns its start event in the sample; when sample() then
raised, the runner replaced the sample with an empty one, so the start event (a restart, a drain) was lost while
the condition stayed active, and being edge-triggered it was never sent again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import ClassVar

from trainguard.detectors.base import DETECTOR_ERROR_KIND, Detector, DetectorConfig, Sample
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.process import ProcessConfig, ProcessDetector, WorkerSnapshot
from trainguard.detectors.runner import DetectorRunner

PID = 4242
STAT = f"{PID} (python3) S " + " ".join(["0"] * 49) + "\n"


def test_a_condition_started_before_the_sample_raised_is_delivered_once(tmp_path) -> None:
    """A real process detector over a fake /proc: rank 0 is hung (process.hung starts), then judging rank 1 in
    the same sample meets a step time that is no number (an agent bug) and raises out of sample()."""
    proc = tmp_path / "proc" / str(PID)
    (proc / "task" / str(PID)).mkdir(parents=True)
    (proc / "stat").write_text(STAT)
    (proc / "task" / str(PID) / "stat").write_text(STAT)
    other = tmp_path / "proc" / str(PID + 1)
    other.mkdir(parents=True)
    (other / "stat").write_text(STAT.replace(str(PID), str(PID + 1), 1))
    now = time.monotonic()
    snap = WorkerSnapshot(rank=0, pid=PID, started_at=now - 10, last_step=5, last_heartbeat=now - 5,
                          recent_step_times=(0.1,))
    broken = WorkerSnapshot(rank=1, pid=PID + 1, started_at=now - 10, last_step=5, last_heartbeat=now,
                            recent_step_times=(0.1, None))  # type: ignore[arg-type]
    workers = [snap, broken]

    class View:
        def workers(self) -> list[WorkerSnapshot]:
            return list(workers)

    det = ProcessDetector(ProcessConfig(root=str(tmp_path), hang_floor_s=1.0, hang_multiplier=2.0,
                                        stack_dump=False), worker_view=View())
    delivered: list[HealthEvent] = []
    runner = DetectorRunner([det], on_event=delivered.append)

    first = runner.run_once()
    errors = [e for e in first if e.kind == DETECTOR_ERROR_KIND]
    # The sample must really have raised, or this test proves nothing: if the detector stops raising on such a
    # snapshot, make a later step of the sample fail another way.
    assert errors and "TypeError" in errors[0].evidence["reason"], [e.message for e in first]
    hung = [e for e in first if e.kind == "process.hung"]
    assert len(hung) == 1 and hung[0].action == Action.RESTART_PROCESS and hung[0].subject == "rank:0"
    assert delivered == first
    assert [c.kind for c in runner.statuses()[0].conditions] == ["process.hung"]

    # The condition holds: the next (clean) sample does not send it again, it only says the detector reads again.
    workers[1] = replace(broken, recent_step_times=(0.1,))
    second = runner.run_once()
    assert [e.kind for e in second] == [DETECTOR_ERROR_KIND + ".cleared"], [e.message for e in second]
    assert [c.kind for c in runner.statuses()[0].conditions] == ["process.hung"]


class _Split(Detector):
    """Starts a condition in its sampling thread and, meanwhile, has another thread (as the RoCE link listener
    does) start one too; then raises."""

    name: ClassVar[str] = "split"

    def __init__(self) -> None:
        super().__init__(DetectorConfig(interval_s=60.0))
        self.from_listener: list[HealthEvent] = []

    def sample(self) -> Sample:
        s = Sample()
        self.condition(s, "mine", True, "test.mine", Severity.CRITICAL, Action.DRAIN_NODE, "mine")

        def listener() -> None:
            other = Sample()
            self.condition(other, "theirs", True, "test.theirs", Severity.ERROR, Action.NONE, "theirs")
            self.from_listener.extend(other.events)

        t = threading.Thread(target=listener)
        t.start()
        t.join(10.0)
        raise OSError("the next read failed")


def test_only_the_sampling_threads_own_condition_events_are_delivered_for_a_failed_sample() -> None:
    det = _Split()
    events = DetectorRunner([det]).run_once()
    # the listener delivers its own events; the failed sample must not send them a second time
    assert [e.kind for e in events] == ["test.mine", DETECTOR_ERROR_KIND]
    assert [e.kind for e in det.from_listener] == ["test.theirs"]
    assert "OSError: the next read failed" in events[1].message


class _Both(Detector):
    """Passes a condition's start event to one_off() too (as the RoCE detector does with link events built with
    a flap condition inside), then raises."""

    name: ClassVar[str] = "both"

    def __init__(self) -> None:
        super().__init__(DetectorConfig(interval_s=60.0))

    def sample(self) -> Sample:
        s = Sample()
        self.condition(s, "flap", True, "test.flap", Severity.CRITICAL, Action.DRAIN_NODE, "flapping")
        self.one_off(s, s.events[-1])
        self.one_off(s, self.event("test.down", Severity.ERROR, Action.CHECKPOINT_NOW, "down"))
        raise OSError("the next read failed")


def test_an_event_recorded_both_as_condition_and_one_off_is_delivered_once() -> None:
    events = DetectorRunner([_Both()]).run_once()
    assert [e.kind for e in events] == ["test.flap", "test.down", DETECTOR_ERROR_KIND]
