"""PCIe detector on fake sysfs trees in both AER file formats the kernel has used."""

from __future__ import annotations

import shutil
import time

import pytest

from trainguard.detectors.base import DetectorState
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.detectors.runner import DetectorRunner

# Kernel >= 5.x names (drivers/pci/pcie/aer.c) ...
COR_NEW = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]
# ... and the names of the 4.19 ABI document's sample, with spaces.
COR_OLD = ["Receiver Error", "Bad TLP", "Bad DLLP", "RELAY_NUM Rollover", "Replay Timer Timeout",
           "Advisory Non-Fatal", "Corrected Internal Error", "Header Log Overflow"]
UNCOR = ["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
         "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
         "PoisonTLPBlocked"]


def table(names, total_key, values=None) -> str:
    values = values or {}
    lines = [f"{n} {values.get(n, 0)}" for n in names]
    return "\n".join(lines + [f"{total_key} {sum(values.values())}"]) + "\n"


def make_device(root, bdf, cls="0x030200", cor=None, nonfatal=None, fatal=None, names=COR_NEW,
                width=16, max_width=16, speed="32.0 GT/s PCIe", max_speed="32.0 GT/s PCIe", above=""):
    """A device laid out as sysfs does: the real directory under /sys/devices/pci<dom>:<bus>/<ports...>/<bdf>,
    and /sys/bus/pci/devices/<bdf> a symlink to it. ``above`` is the chain of ports above, "a/b"."""
    d = root / "sys/devices/pci0000:00" / above / bdf
    d.mkdir(parents=True, exist_ok=True)
    link = root / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(d)
    (d / "class").write_text(cls + "\n")
    (d / "aer_dev_correctable").write_text(table(names, "TOTAL_ERR_COR", cor))
    (d / "aer_dev_nonfatal").write_text(table(UNCOR, "TOTAL_ERR_NONFATAL", nonfatal))
    (d / "aer_dev_fatal").write_text(table(UNCOR, "TOTAL_ERR_FATAL", fatal))
    (d / "current_link_width").write_text(f"{width}\n")
    (d / "max_link_width").write_text(f"{max_width}\n")
    (d / "current_link_speed").write_text(speed + "\n")
    (d / "max_link_speed").write_text(max_speed + "\n")
    return d


ROOT_PORT = "0000:00:03.0"
GPU = "0000:3b:00.0"


@pytest.mark.parametrize("scope", ["paths", "all"])
def test_aer_counters_both_formats(tmp_path, scope) -> None:
    make_device(tmp_path, ROOT_PORT, cls="0x060400", names=COR_OLD)  # root port, 4.19-style names
    make_device(tmp_path, GPU, above=ROOT_PORT)  # GPU below it, current names
    make_device(tmp_path, "0000:00:1c.0", cls="0x060400")  # a port with nothing watched below it
    det = PcieDetector(PcieConfig(root=str(tmp_path), correctable_per_s=5.0, aer_scope=scope))
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.OK
    assert s.metrics["aer_devices"] == (2.0 if scope == "paths" else 3.0) and s.metrics["links_watched"] == 1.0
    time.sleep(0.05)
    make_device(tmp_path, GPU, nonfatal={"CmpltTO": 1}, fatal={"MalfTLP": 2}, above=ROOT_PORT)
    make_device(tmp_path, ROOT_PORT, cls="0x060400", names=COR_OLD, cor={"Receiver Error": 40, "Bad TLP": 3})
    make_device(tmp_path, "0000:00:1c.0", cls="0x060400", fatal={"DLP": 1})
    s = det.sample()
    if scope == "all":
        assert ("pcie.aer_fatal", "0000:00:1c.0") in {(e.kind, e.subject) for e in s.events}
        return
    kinds = {(e.kind, e.subject): e for e in s.events}
    fatal = kinds[("pcie.aer_fatal", "0000:3b:00.0")]
    assert fatal.severity == Severity.CRITICAL and fatal.action == Action.DRAIN_NODE
    assert fatal.evidence["errors"] == "MalfTLP+2"
    nonfatal = kinds[("pcie.aer_nonfatal", "0000:3b:00.0")]
    assert nonfatal.action == Action.CHECKPOINT_NOW and nonfatal.evidence["errors"] == "CmpltTO+1"
    cor = kinds[("pcie.aer_correctable", "0000:00:03.0")]
    assert "Receiver Error+40" in cor.evidence["errors"] and cor.severity == Severity.WARNING
    assert s.metrics["aer_fatal_total"] == 2.0 and s.metrics["aer_correctable[0000:00:03.0]"] == 43.0
    assert len(s.events) == 3  # the unwatched port's fatal error is out of scope
    assert s.state == DetectorState.FAILED


def test_degraded_link_width_speed_and_lost_device(tmp_path) -> None:
    make_device(tmp_path, "0000:3b:00.0", width=8)  # GPU at x8 of x16
    make_device(tmp_path, "0000:5e:00.0", cls="0x020000", speed="16.0 GT/s PCIe")  # NIC at gen4 of gen5
    make_device(tmp_path, "0000:86:00.0", speed="2.5 GT/s PCIe")  # idle GPU: speed not checked
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    s = det.sample()
    assert sorted((e.kind, e.subject) for e in s.events) == [
        ("pcie.link_narrow", "0000:3b:00.0"), ("pcie.link_slow", "0000:5e:00.0")]
    assert s.metrics["links_degraded"] == 2.0 and s.state == DetectorState.DEGRADED
    (tmp_path / "sys/bus/pci/devices/0000:86:00.0").unlink()
    shutil.rmtree(tmp_path / "sys/devices/pci0000:00/0000:86:00.0")
    s = det.sample()
    assert [(e.kind, e.subject, e.severity) for e in s.events] == [
        ("pcie.device_lost", "0000:86:00.0", Severity.CRITICAL)]


def test_malformed_and_truncated_aer_files(tmp_path) -> None:
    d = make_device(tmp_path, "0000:3b:00.0")
    (d / "aer_dev_correctable").write_text("RxErr 0\nBadTLP\n")  # truncated mid-line
    (d / "aer_dev_fatal").write_text("Undefined 0\nDLP 0\n")  # truncated before the TOTAL line
    (d / "current_link_speed").write_text("fast\n")
    events = []
    runner = DetectorRunner([PcieDetector(PcieConfig(root=str(tmp_path)))], on_event=events.append)
    runner.run_once()
    errors = sorted(e.evidence["reason"] for e in events if e.kind == "detector.error")
    assert len(errors) == 3
    assert any("TOTAL_ERR_FATAL" in r for r in errors) and any("GT/s" in r for r in errors)
    assert runner.statuses()[0].state == DetectorState.ERROR


def test_no_pcie_status_files_is_no_hardware(tmp_path) -> None:
    (tmp_path / "sys/bus/pci/devices/0000:00:00.0").mkdir(parents=True)  # a host bridge: no AER, no link files
    (tmp_path / "sys/bus/pci/devices/0000:00:00.0/class").write_text("0x060000\n")
    s = PcieDetector(PcieConfig(root=str(tmp_path))).sample()
    assert s.state == DetectorState.NO_HARDWARE
