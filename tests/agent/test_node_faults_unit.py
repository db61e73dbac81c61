"""hardware_cause and NodeReportLedger with a real DetectorRunner and PCIe detector on a fake sysfs tree."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from trainguard.agent.node_faults import NodeReportLedger, hardware_cause, hardware_detector_names
from trainguard.detectors.base import create_detectors
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.runner import DetectorRunner
from trainguard.proto import coordinator_pb2
from trainguard.testing.sysfs import GPU, write_gpu


class Pending:
    """What the agent keeps of the detector events: those asking for an action, until its loop handles them."""

    def __init__(self) -> None:
        self.events: list[HealthEvent] = []
        self.lock = threading.Lock()

    def __call__(self, ev: HealthEvent) -> None:
        if ev.action >= Action.RESTART_PROCESS:
            with self.lock:
                self.events.append(ev)

    def snapshot(self) -> list[HealthEvent]:
        with self.lock:
            return list(self.events)

    def handled(self) -> None:
        with self.lock:
            self.events.clear()


def start(tree: Path, pending: Pending) -> tuple[DetectorRunner, tuple[str, ...]]:
    dets = create_detectors(["process", "pcie"], {"pcie": {"root": str(tree), "interval_s": 3600.0}})
    runner = DetectorRunner(dets, on_event=pending)
    runner.start()
    deadline = time.monotonic() + 10
    while not all(s.samples for s in runner.statuses()):  # the first round reads the healthy tree
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return runner, hardware_detector_names(dets)


@pytest.fixture
def rig(tmp_path: Path):
    """A healthy fake GPU tree, a started runner over it, the pending-event view and a report ledger."""
    tree = tmp_path / "fake"
    write_gpu(tree)
    pending = Pending()
    runner, names = start(tree, pending)
    try:
        yield tree, pending, runner, names, NodeReportLedger()
    finally:
        runner.stop()


def test_fresh_round_then_active_condition_then_nothing(rig) -> None:
    tree, pending, runner, names, ledger = rig
    assert names == ("pcie",)
    assert hardware_cause(runner, names, pending.snapshot, ledger, 1, "n1") is None  # healthy: a process fault
    write_gpu(tree, nonfatal={"CmpltTO": 1})
    assert hardware_cause(runner, names, pending.snapshot, ledger, 1, "n1") is None  # CHECKPOINT_NOW only
    pending.handled()
    (tree / "sys/bus/pci/devices" / GPU).unlink()  # the GPU fell off the bus
    ev = hardware_cause(runner, names, pending.snapshot, ledger, 1, "n1")
    assert ev is not None and ev.kind == "pcie.device_lost" and ev.action == Action.DRAIN_NODE
    pending.handled()  # the agent's loop handled (and reported) the event; the condition lasts
    ev = hardware_cause(runner, names, pending.snapshot, ledger, 2, "n1")
    assert ev is not None and ev.kind == "pcie.device_lost" and ev.node_id == "n1"
    write_gpu(tree)  # back on the bus: the condition clears
    assert hardware_cause(runner, names, pending.snapshot, ledger, 2, "n1") is None


def test_a_fault_reported_a_moment_before_the_death_is_its_cause(rig) -> None:
    tree, pending, runner, names, ledger = rig
    fatal = HealthEvent(source="pcie", kind="pcie.aer_fatal", severity=Severity.CRITICAL,
                        action=Action.DRAIN_NODE, message="fatal", node_id="n1")
    assert ledger.record(fatal, 3) == coordinator_pb2.RECOVERY_LEVEL_NODE
    assert hardware_cause(runner, names, pending.snapshot, ledger, 3, "n1") is fatal
    assert hardware_cause(runner, names, pending.snapshot, ledger, 4, "n1") is None  # another generation
    # Without hardware detectors nothing is sampled or waited for.
    t0 = time.monotonic()
    assert hardware_cause(runner, (), pending.snapshot, ledger, 3, "n1") is None
    assert time.monotonic() - t0 < 0.05


def test_ledger_one_report_per_generation_and_level() -> None:
    ledger = NodeReportLedger()
    node = HealthEvent(source="pcie", kind="pcie.aer_fatal", severity=Severity.CRITICAL, action=Action.DRAIN_NODE,
                       message="fatal")
    job = HealthEvent(source="kmsg", kind="kmsg.panic", severity=Severity.CRITICAL, action=Action.RESTART_JOB,
                      message="panic")
    assert not ledger.covers(node, 1) and ledger.reported_since(0) is None
    ledger.record(node, 1)
    assert ledger.covers(node, 1) and not ledger.covers(job, 1), "a job-level fault still goes out after a node one"
    assert not ledger.covers(node, 2)
    assert ledger.reported_since(1) == 1 and ledger.reported_since(2) is None
    assert ledger.record(job, 1) == coordinator_pb2.RECOVERY_LEVEL_JOB
    assert ledger.covers(node, 1) and ledger.covers(job, 1)
