"""PCIe detector on fake sysfs trees in both AER file formats the kernel has used."""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest

from trainguard.detectors.base import DetectorState
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.detectors.runner import DetectorRunner
from trainguard.testing.sysfs import AER_CORRECTABLE_4_19, GPU, ROOT_PORT, write_pci_device

@pytest.mark.parametrize("scope", ["paths", "all"])
def test_aer_counters_both_formats(tmp_path, scope) -> None:
    write_pci_device(tmp_path, ROOT_PORT, cls="0x060400", cor_names=AER_CORRECTABLE_4_19)  # root port, 4.19-style names
    write_pci_device(tmp_path, GPU, above=ROOT_PORT)  # GPU below it, current names
    write_pci_device(tmp_path, "0000:00:1c.0", cls="0x060400")  # a port with nothing watched below it
    det = PcieDetector(PcieConfig(root=str(tmp_path), correctable_per_s=5.0, aer_scope=scope))
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.OK
    assert s.metrics["aer_devices"] == (2.0 if scope == "paths" else 3.0) and s.metrics["links_watched"] == 1.0
    time.sleep(0.05)
    write_pci_device(tmp_path, GPU, nonfatal={"CmpltTO": 1}, fatal={"MalfTLP": 2}, above=ROOT_PORT)
    write_pci_device(tmp_path, ROOT_PORT, cls="0x060400", cor_names=AER_CORRECTABLE_4_19, cor={"Receiver Error": 40, "Bad TLP": 3})
    write_pci_device(tmp_path, "0000:00:1c.0", cls="0x060400", fatal={"DLP": 1})
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
    write_pci_device(tmp_path, "0000:3b:00.0", width=8)  # GPU at x8 of x16
    write_pci_device(tmp_path, "0000:5e:00.0", cls="0x020000", speed="16.0 GT/s PCIe")  # NIC at gen4 of gen5
    write_pci_device(tmp_path, "0000:86:00.0", speed="2.5 GT/s PCIe")  # idle GPU: speed not checked
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


def test_a_device_that_fell_off_the_bus_but_is_still_listed_is_down(tmp_path) -> None:
    """A GPU or NIC that fell off the bus (Xid 79, a NIC firmware hang) stays in sysfs, but its config space
    reads all ones: current_link_width prints 63 (the NLW field of 0xffff), current_link_speed "Unknown", and
    max_link_width, read live from the link capabilities, 63 too. Width 63 is no lane count (PCIe stops at
    x32) and was never below the maximum: a healthy link, no event. It is now the link down, until it answers."""
    write_pci_device(tmp_path, "0000:5e:00.0", cls="0x020000")
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    assert det.sample().events == []
    write_pci_device(tmp_path, "0000:5e:00.0", cls="0x020000", width=63, max_width=63, speed="Unknown",
                     max_speed="64.0 GT/s PCIe")
    s = det.sample()
    assert [(e.kind, e.severity, e.action) for e in s.events] == [
        ("pcie.link_down", Severity.CRITICAL, Action.DRAIN_NODE)]
    assert "does not answer" in s.events[0].message and s.events[0].subject == "0000:5e:00.0"
    assert s.state == DetectorState.FAILED and s.metrics["link_width[0000:5e:00.0]"] == 0.0
    write_pci_device(tmp_path, "0000:5e:00.0", cls="0x020000")  # reset and retrained
    assert [e.kind for e in det.sample().events] == ["pcie.link_down.cleared"]
    # Powered off on purpose (runtime PM, D3cold): it reads all ones too, and is no fault.
    d = write_pci_device(tmp_path, "0000:5e:00.0", cls="0x020000", width=63, max_width=63, speed="Unknown")
    (d / "power_state").write_text("D3cold\n")
    s = det.sample()
    assert (s.events, s.state) == ([], DetectorState.OK)


def test_a_link_at_the_limit_of_its_slot_is_not_degraded(tmp_path) -> None:
    """A Gen5 x16 NIC in a Gen4 x8 slot trains at 16 GT/s x8, the most that link can do (the kernel logs it as
    "limited by 16.0 GT/s PCIe x8 link at <port>"). Compared with the NIC's own maximum it read narrow and slow
    for good: a DEGRADED detector, and the predictor's rule on narrow links (already fatal) drained the node.
    Below the slot's limit it is degraded as before."""
    port, nic = "0000:00:01.0", "0000:01:00.0"
    write_pci_device(tmp_path, port, cls="0x060400", width=8, max_width=8, speed="16.0 GT/s PCIe",
                     max_speed="16.0 GT/s PCIe")
    write_pci_device(tmp_path, nic, cls="0x020000", above=port, width=8, max_width=16, speed="16.0 GT/s PCIe",
                     max_speed="32.0 GT/s PCIe")
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    s = det.sample()
    assert (s.events, s.state, s.metrics["links_degraded"]) == ([], DetectorState.OK, 0.0)
    write_pci_device(tmp_path, nic, cls="0x020000", above=port, width=4, max_width=16, speed="8.0 GT/s PCIe",
                     max_speed="32.0 GT/s PCIe")
    s = det.sample()
    assert sorted((e.kind, e.subject) for e in s.events) == [("pcie.link_narrow", nic), ("pcie.link_slow", nic)]
    narrow = next(e for e in s.events if e.kind == "pcie.link_narrow")
    assert narrow.evidence["max_width"] == "8" and "below its x8" in narrow.message


def test_aer_errors_of_the_port_above_an_nvme_drive_behind_vmd(tmp_path) -> None:
    """Intel VMD puts the NVMe drives behind it in PCI domains from 10000 up; the port above a drive there was no
    ancestor of it (a 4-digit domain was expected), so its AER errors went unread in the default scope."""
    vmd, port, drive = "0000:00:0e.0", "10000:e0:1d.0", "10000:e1:00.0"
    write_pci_device(tmp_path, vmd, cls="0x010400")
    write_pci_device(tmp_path, port, cls="0x060400", above=f"{vmd}/pci10000:e0")
    write_pci_device(tmp_path, drive, cls="0x010802", above=f"{vmd}/pci10000:e0/{port}")
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    assert det.sample().metrics["aer_devices"] == 3.0
    write_pci_device(tmp_path, port, cls="0x060400", above=f"{vmd}/pci10000:e0", fatal={"DLP": 1})
    assert [(e.kind, e.subject) for e in det.sample().events] == [("pcie.aer_fatal", port)]


def test_sriov_virtual_functions_have_no_link_of_their_own(tmp_path) -> None:
    """A VF's link status register is reserved and reads zero (lspci: "LnkSta: Speed unknown, Width x0"): every
    VF of an RDMA NIC with SR-IOV enabled read as a PCIe link down, critical with drain-node. The PF's link is
    watched; the VF's is not."""
    pf, vf = "0000:3b:00.0", "0000:3b:00.2"
    write_pci_device(tmp_path, pf, cls="0x020000", speed="16.0 GT/s PCIe", max_speed="16.0 GT/s PCIe")
    vf_dir = write_pci_device(tmp_path, vf, cls="0x020000", width=0, speed="Unknown", max_speed="16.0 GT/s PCIe")
    (vf_dir / "physfn").symlink_to(f"../{pf}")
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    s = det.sample()
    assert (s.events, s.state, s.metrics["links_watched"]) == ([], DetectorState.OK, 1.0)
    write_pci_device(tmp_path, pf, cls="0x020000", width=0, speed="Unknown", max_speed="16.0 GT/s PCIe")
    assert [(e.kind, e.subject) for e in det.sample().events] == [("pcie.link_down", pf)]


def test_a_device_back_on_the_bus_counts_its_errors_from_zero(tmp_path) -> None:
    """A GPU removed and rescanned is a new pci_dev whose AER counters start at zero. It had one fatal error
    before it left; back with one new fatal error, the total read the same (1) and the new error was lost."""
    write_pci_device(tmp_path, GPU, above=ROOT_PORT)
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    det.sample()
    write_pci_device(tmp_path, GPU, above=ROOT_PORT, fatal={"DLP": 1})
    assert [e.kind for e in det.sample().events] == ["pcie.aer_fatal"]
    (tmp_path / f"sys/bus/pci/devices/{GPU}").unlink()
    shutil.rmtree(tmp_path / f"sys/devices/pci0000:00/{ROOT_PORT}/{GPU}")
    assert [e.kind for e in det.sample().events] == ["pcie.device_lost"]
    write_pci_device(tmp_path, GPU, above=ROOT_PORT, fatal={"CmpltTO": 1})  # back, with one new fatal error
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["pcie.aer_fatal", "pcie.device_lost.cleared"]
    fatal = next(e for e in s.events if e.kind == "pcie.aer_fatal")
    assert fatal.evidence["delta"] == "1" and fatal.evidence["errors"] == "CmpltTO+1"


def test_malformed_and_truncated_aer_files(tmp_path) -> None:
    d = write_pci_device(tmp_path, "0000:3b:00.0")
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


def test_a_counter_of_absurd_length_is_a_read_error_beside_another_devices_event(tmp_path) -> None:
    """A corrupt AER table holding a 5000-digit count raised ValueError (int() refuses over 4300 digits) out of
    sample(), dropping the sample: the other device's fatal error in it was never reported."""
    write_pci_device(tmp_path, ROOT_PORT, cls="0x060400")
    write_pci_device(tmp_path, GPU, above=ROOT_PORT)
    events = []
    runner = DetectorRunner([PcieDetector(PcieConfig(root=str(tmp_path), aer_scope="all"))], on_event=events.append)
    runner.run_once()
    (tmp_path / "sys/bus/pci/devices" / ROOT_PORT / "aer_dev_correctable").write_text(f"RxErr {'9' * 5000}\n")
    write_pci_device(tmp_path, GPU, above=ROOT_PORT, fatal={"DLP": 1})
    runner.run_once()
    assert [e.subject for e in events if e.kind == "pcie.aer_fatal"] == [GPU]
    (bad,) = [e for e in events if e.kind == "detector.error"]
    assert bad.subject.endswith(f"{ROOT_PORT}/aer_dev_correctable") and "is not '<name> <count>'" in bad.message


def test_an_integrated_endpoint_without_a_link_is_not_a_link_down(tmp_path) -> None:
    """A root complex integrated endpoint (an integrated GPU at 0000:00:02.0, class 0x0300) has the link files in
    sysfs, but its link registers are not implemented and read zero: width 0 of a maximum 0, speeds Unknown. It
    read as a PCIe link down, critical with drain-node. A discrete device's link that goes down keeps its
    maximum width and is still reported."""
    write_pci_device(tmp_path, "0000:00:02.0", cls="0x030000", width=0, max_width=0, speed="Unknown",
                     max_speed="Unknown")
    write_pci_device(tmp_path, GPU)
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    s = det.sample()
    assert (s.events, s.errors, s.state) == ([], [], DetectorState.OK)
    write_pci_device(tmp_path, GPU, width=0, speed="Unknown")
    assert [(e.kind, e.subject) for e in det.sample().events] == [("pcie.link_down", GPU)]


def test_a_device_removed_while_its_files_are_read_is_lost_not_unreadable(tmp_path, monkeypatch) -> None:
    """A GPU hot-unplugged (or removed by its driver after falling off the bus) between the listing of the bus and
    the reading of its files: the read of an open attribute fails with ENODEV, the files opened after with ENOENT.
    Each was a detector.error (an unreadable input, the detector in ERROR) and the loss was said one sample later.
    It is the device lost now, in that sample, and no read error."""
    write_pci_device(tmp_path, ROOT_PORT, cls="0x060400")
    gpu_dir = write_pci_device(tmp_path, GPU, above=ROOT_PORT)
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    assert det.sample().events == []
    real_read = os.read

    def kernel_read(fd: int, n: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{GPU}/aer_dev_correctable"):
            # the device goes while this file is open: kernfs answers the read with ENODEV
            (tmp_path / "sys/bus/pci/devices" / GPU).unlink()
            shutil.rmtree(gpu_dir)
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    s = det.sample()
    assert s.errors == [], [str(e) for e in s.errors]
    assert [(e.kind, e.subject, e.action) for e in s.events] == [("pcie.device_lost", GPU, Action.DRAIN_NODE)]
    assert s.state == DetectorState.FAILED
    assert det.sample().events == []  # still lost: said once


def test_a_device_removed_and_found_again_between_two_samples_counts_from_zero(tmp_path) -> None:
    """A remove and rescan (or a hot-plug) within one interval: no sample sees the device gone, and the new
    pci_dev counts its AER errors from zero. The GPU had one fatal error before and one new after: the total read
    1 both times, no event. Its folder is a new one (kernfs numbers it anew), so its counts are new errors."""
    write_pci_device(tmp_path, ROOT_PORT, cls="0x060400")
    gpu_dir = write_pci_device(tmp_path, GPU, above=ROOT_PORT, fatal={"MalfTLP": 1})
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    assert det.sample().events == []
    assert det.sample().events == []  # the same folder: nothing new
    gpu_dir.rename(gpu_dir.with_name("removing"))  # still there while the new one is made: another inode
    write_pci_device(tmp_path, GPU, above=ROOT_PORT, fatal={"MalfTLP": 1})
    shutil.rmtree(gpu_dir.with_name("removing"))
    s = det.sample()
    assert [(e.kind, e.subject, e.evidence["delta"]) for e in s.events] == [("pcie.aer_fatal", GPU, "1")]
    assert det.sample().events == []  # the same error once


def test_the_only_device_with_a_garbled_class_is_a_read_error_not_no_hardware(tmp_path) -> None:
    """A node whose one GPU has a cut class file and no modalias: nothing was watched, and the sample read
    "no hardware" (exit 0 from `trainguard detect`), dropping the read error that says why."""
    write_pci_device(tmp_path, "0000:3b:00.0", cls="0x0302", width=4)
    s = PcieDetector(PcieConfig(root=str(tmp_path))).sample()
    assert s.state == DetectorState.ERROR and [os.path.basename(e.path) for e in s.errors] == ["class"], s


def test_a_garbled_class_is_a_read_error_and_the_device_is_still_judged_by_its_modalias(tmp_path) -> None:
    """A ``class`` file that is not what the kernel prints (``0x%06x``) matched no watched class: the device
    dropped out of the link checks without a word (a NIC at gen4 of gen5 never reported). It is a read error
    naming the file, every sample, and the class comes from ``modalias`` (printed from the same field) when it
    reads right; without it the device is not judged, but the error says why."""
    nic = write_pci_device(tmp_path, "0000:5e:00.0", cls="0x02z000", speed="16.0 GT/s PCIe")
    (nic / "modalias").write_text("pci:v000015B3d0000101Dsv000015B3sd00000016bc02sc00i00\n")
    write_pci_device(tmp_path, "0000:3b:00.0", cls="0x0302", width=8)  # cut; no modalias to tell
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    for _ in range(2):
        s = det.sample()
        assert sorted(os.path.relpath(e.path, tmp_path) for e in s.errors) == [
            "sys/bus/pci/devices/0000:3b:00.0/class", "sys/bus/pci/devices/0000:5e:00.0/class"]
        assert all("0x and 6 hex digits" in e.reason for e in s.errors)
        assert s.state == DetectorState.ERROR
    assert s.metrics["links_watched"] == 1.0 and s.metrics["link_speed_gts[0000:5e:00.0]"] == 16.0
    assert [(e.kind, e.subject) for e in det.active_conditions()] == [("pcie.link_slow", "0000:5e:00.0")]
    write_pci_device(tmp_path, "0000:5e:00.0", cls="0x020000", speed="16.0 GT/s PCIe")
    write_pci_device(tmp_path, "0000:3b:00.0", cls="0x030200", width=8)
    s = det.sample()
    assert s.errors == [] and [(e.kind, e.subject) for e in s.events] == [("pcie.link_narrow", "0000:3b:00.0")]
