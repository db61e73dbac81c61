"""A sample that raises partway still delivers the one-off events it raised before the failure, exactly once.

One-off events (an uncorrectable memory error, a fatal AER error, an uncorrectable GPU ECC error, a kernel log
match, a worker's exit) are raised once because the detector moves its remembered state past them (a counter's
last value, the log's read position) while it builds the sample. When a later read of the same sample raised,
the runner replaced the lost sample with an empty one: the counter had moved, so the event never came again (a
drain never asked for). The runner now delivers them, as it did the condition events of such a sample.

The readers turn unreadable or garbage files into read errors beside the readings, so what makes these samples
raise is a later step of the same sample failing in a way nothing catches: a detector subclass raises there
(standing for a bug or an error no reader expects); for the process detector it is a real input, a worker
snapshot the agent filled wrongly.
"""

from __future__ import annotations

import time
from dataclasses import replace

from trainguard.detectors.base import DETECTOR_ERROR_KIND, Detector
from trainguard.detectors.edac import EdacConfig, EdacDetector
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.kmsg import KmsgConfig, KmsgDetector
from trainguard.detectors.nvidia import GpuReading, NvidiaConfig, NvidiaDetector
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.detectors.process import ProcessConfig, ProcessDetector, WorkerSnapshot
from trainguard.detectors.runner import DetectorRunner
from trainguard.testing.kmsg import append_kmsg, write_kmsg
from trainguard.testing.nvml import GpuBackendDouble
from trainguard.testing.sysfs import GPU, ROOT_PORT, write_edac_mc, write_pci_device

XID79 = "6,1201,5123456789,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."
OOM = ("3,1203,5123456791,-;Out of memory: Killed process 23456 (python3) total-vm:98765432kB, "
       "anon-rss:87654321kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:180000kB oom_score_adj:0")


def _run_twice(det: Detector, fix: callable) -> tuple[list[HealthEvent], list[HealthEvent], list[HealthEvent]]:
    """Samples ``det`` through a runner (the faulty sample), lets ``fix`` remove the fault, samples again.

    Returns:
        The events of the first and second samples, and every event the runner's consumer received.
    """
    delivered: list[HealthEvent] = []
    runner = DetectorRunner([det], on_event=delivered.append)
    first = runner.run_once()
    # The sample must really have raised, or this proves nothing.
    assert [e.kind for e in first][-1] == DETECTOR_ERROR_KIND, [e.message for e in first]
    fix()
    second = runner.run_once()
    return first, second, delivered


def _kinds(events: list[HealthEvent]) -> list[tuple[str, str]]:
    return [(e.kind, e.subject) for e in events]


def test_an_uncorrectable_memory_error_read_before_the_sample_raised_is_delivered_once(tmp_path) -> None:
    """mc0 shows a new uncorrectable error; reading mc1 later in the same sample fails."""
    write_edac_mc(tmp_path, 0, ce=0, ue=0)
    write_edac_mc(tmp_path, 1, ce=0, ue=0)
    failing = {"on": False}

    class Edac(EdacDetector):
        def _dimms(self, s, mdir):  # type: ignore[no-untyped-def]
            if failing["on"] and mdir.endswith("mc1"):
                raise OSError("mc1 went away mid-read")
            return super()._dimms(s, mdir)

    det = Edac(EdacConfig(root=str(tmp_path)))
    assert det.sample().events == []
    write_edac_mc(tmp_path, 0, ce=0, ue=1)
    failing["on"] = True
    first, second, delivered = _run_twice(det, lambda: failing.update(on=False))
    assert _kinds(first) == [("hw.memory_ue", "mc0"), (DETECTOR_ERROR_KIND, "edac")]
    assert first[0].action == Action.DRAIN_NODE and first[0].severity == Severity.CRITICAL
    # not sent again by the next good sample: its counter had moved past it
    assert _kinds(second) == [(DETECTOR_ERROR_KIND + ".cleared", "")]
    assert delivered == first + second


def test_a_fatal_aer_error_read_before_the_sample_raised_is_delivered_once(tmp_path) -> None:
    """The GPU's fatal AER counter rises; its link read, later in the same sample, fails."""
    write_pci_device(tmp_path, ROOT_PORT, cls="0x060400")
    write_pci_device(tmp_path, GPU, above=ROOT_PORT)
    failing = {"on": False}

    class Pcie(PcieDetector):
        def _sample_link(self, s, dev, bdf, cls, port_dir=""):  # type: ignore[no-untyped-def]
            if failing["on"]:
                raise OSError("link status read failed")
            return super()._sample_link(s, dev, bdf, cls, port_dir)

    det = Pcie(PcieConfig(root=str(tmp_path)))
    assert det.sample().events == []
    write_pci_device(tmp_path, GPU, above=ROOT_PORT, fatal={"MalfTLP": 1}, nonfatal={"CmpltTO": 2})
    failing["on"] = True
    first, second, delivered = _run_twice(det, lambda: failing.update(on=False))
    assert _kinds(first) == [("pcie.aer_nonfatal", GPU), ("pcie.aer_fatal", GPU), (DETECTOR_ERROR_KIND, "pcie")]
    assert _kinds(second) == [(DETECTOR_ERROR_KIND + ".cleared", "")]
    assert delivered == first + second


def test_an_uncorrectable_gpu_ecc_error_read_before_the_sample_raised_is_delivered_once() -> None:
    """GPU 0 reports a new uncorrectable ECC error; judging GPU 1, later in the same sample, fails."""
    good = GpuReading(index=0, uuid="GPU-0", pci_bus_id="00000000:3B:00.0", ecc_volatile_uncorrected=0)
    backend = GpuBackendDouble([good, replace(good, index=1, uuid="GPU-1", pci_bus_id="00000000:5E:00.0")])
    failing = {"on": False}

    class Nvidia(NvidiaDetector):
        def _check(self, s, r):  # type: ignore[no-untyped-def]
            if failing["on"] and r.index == 1:
                raise RuntimeError("NVML answered out of spec")
            return super()._check(s, r)

    det = Nvidia(NvidiaConfig(), backend=backend)
    assert det.sample().events == []
    backend.readings[0] = replace(good, ecc_volatile_uncorrected=1)
    failing["on"] = True
    first, second, delivered = _run_twice(det, lambda: failing.update(on=False))
    assert _kinds(first) == [("gpu.ecc_uncorrected", "00000000:3B:00.0"), (DETECTOR_ERROR_KIND, "nvidia")]
    assert _kinds(second) == [(DETECTOR_ERROR_KIND + ".cleared", "")]
    assert delivered == first + second


def test_a_kernel_log_match_read_before_the_sample_raised_is_delivered_once(tmp_path) -> None:
    """An Xid 79 record is matched; matching the next record of the same read fails. Both records are consumed
    from the log, so neither comes again."""
    root = write_kmsg(tmp_path)
    failing = {"on": False}

    class Kmsg(KmsgDetector):
        def _match(self, s, record, now):  # type: ignore[no-untyped-def]
            if failing["on"] and "Out of memory" in record.message:
                raise RuntimeError("rule failed on this record")
            return super()._match(s, record, now)

    det = Kmsg(KmsgConfig(root=root))
    assert det.sample().events == []
    append_kmsg(tmp_path, XID79, OOM)
    failing["on"] = True
    first, second, delivered = _run_twice(det, lambda: failing.update(on=False))
    assert _kinds(first) == [("gpu.xid", "0000:3b:00"), (DETECTOR_ERROR_KIND, "kmsg")]
    assert first[0].action == Action.DRAIN_NODE
    assert _kinds(second) == [(DETECTOR_ERROR_KIND + ".cleared", "")]
    assert delivered == first + second


def test_a_worker_exit_reported_before_the_sample_raised_is_delivered_once(tmp_path) -> None:
    """Rank 0 was killed; rank 1's snapshot, judged later in the same sample, holds a step time that is no
    number (an agent bug), and the sample raises. The exit is reported once (the detector remembers it as
    reported), so it must reach the consumer from the failed sample."""
    now = time.monotonic()
    killed = WorkerSnapshot(rank=0, pid=4242, started_at=now, returncode=-9)
    broken = WorkerSnapshot(rank=1, pid=4243, started_at=now - 10, last_heartbeat=now - 1, last_step=3,
                            recent_step_times=(0.1, None))  # type: ignore[arg-type]
    stat = "4243 (python3) S " + " ".join(["0"] * 49) + "\n"
    (tmp_path / "proc" / "4243").mkdir(parents=True)
    (tmp_path / "proc" / "4243" / "stat").write_text(stat)
    workers = [killed, broken]

    class View:
        def workers(self) -> list[WorkerSnapshot]:
            return list(workers)

    det = ProcessDetector(ProcessConfig(root=str(tmp_path), stack_dump=False), worker_view=View())

    def fix() -> None:
        workers[1] = replace(broken, recent_step_times=(0.1,))

    first, second, delivered = _run_twice(det, fix)
    assert _kinds(first) == [("process.killed", "rank:0"), (DETECTOR_ERROR_KIND, "process")]
    assert "TypeError" in first[1].evidence["reason"]
    assert _kinds(second) == [(DETECTOR_ERROR_KIND + ".cleared", "")]
    assert delivered == first + second
