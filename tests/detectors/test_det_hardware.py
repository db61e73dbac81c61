"""Host, disk, thermal and EDAC detectors on fake trees in the kernel's formats (and real paths for disk)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time

import pytest

from trainguard.detectors.base import DetectorState
from trainguard.detectors.disk import DiskConfig, DiskDetector
from trainguard.detectors.edac import EdacConfig, EdacDetector
from trainguard.detectors.errors import DetectorConfigError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.host import HostConfig, HostDetector
from trainguard.detectors.runner import DetectorRunner
from trainguard.detectors.thermal import ThermalConfig, ThermalDetector
from trainguard.testing.sysfs import write_edac_mc, write_file, write_thermal_zone

MEMINFO = """MemTotal:       65536000 kB
MemFree:         1000000 kB
MemAvailable:    {avail} kB
Buffers:          100000 kB
Cached:          2000000 kB
SwapTotal:       8000000 kB
SwapFree:        8000000 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""
PSI = "some avg10={some} avg60=1.00 avg300=0.50 total=123456\nfull avg10={full} avg60=0.80 avg300=0.20 total=98765\n"


def test_host_memory_and_pressure(tmp_path) -> None:
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    write_file(tmp_path, "proc/pressure/memory", PSI.format(some="0.00", full="0.00"))
    write_file(tmp_path, "proc/pressure/io", PSI.format(some="4.50", full="2.25"))
    write_file(tmp_path, "proc/pressure/cpu", "some avg10=12.00 avg60=3.00 avg300=1.00 total=42\n")  # before 5.13
    det = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0))  # the shared CI machine may be busy
    s = det.sample()
    assert s.events == [] and s.metrics["mem_available_pct"] == pytest.approx(50.0)
    assert 0.0 <= s.metrics["cpu_percent"] <= 100.0
    assert s.metrics["io_pressure_full_avg10"] == 2.25 and s.metrics["cpu_pressure_some_avg10"] == 12.0
    assert "cpu_pressure_full_avg10" not in s.metrics
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=1000000))
    write_file(tmp_path, "proc/pressure/memory", PSI.format(some="60.00", full="35.50"))
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["host.memory_low", "host.memory_pressure"]
    assert all(e.action == Action.CHECKPOINT_NOW for e in s.events)
    assert s.metrics["mem_pressure_full_avg10"] == 35.5 and s.state == DetectorState.DEGRADED


def test_psi_disabled_at_boot_is_no_pressure_not_an_error(tmp_path, monkeypatch) -> None:
    """RHEL 8 (CONFIG_PSI_DEFAULT_DISABLED=y) without psi=1: /proc/pressure/* exist and reading them fails with
    EOPNOTSUPP. That was a detector.error, the host detector in ERROR for good and ``trainguard detect`` exiting
    1 on every such node. A regular file cannot fail so, so the read syscall answers as that kernel does for
    the pressure files only; any other read error is still one."""
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    for resource in ("memory", "io", "cpu"):
        write_file(tmp_path, f"proc/pressure/{resource}", PSI.format(some="1.00", full="0.50"))
    real_read = os.read

    def kernel_read(fd: int, n: int) -> bytes:
        if "/proc/pressure/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert s.errors == [] and s.state == DetectorState.OK, s.detail
    assert s.metrics["mem_available_pct"] == pytest.approx(50.0)
    assert not any("pressure" in k for k in s.metrics)


def test_an_unreadable_pressure_file_is_a_read_error_not_a_kernel_without_psi(tmp_path) -> None:
    """os.path.exists() is False for a file it cannot stat (EACCES for a user who may not read /proc/pressure,
    a symlink loop): that read as a kernel without PSI, no pressure metric and the detector OK while memory
    thrashed. A missing file is still no PSI; one that cannot be reached is a read error naming it."""
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    (tmp_path / "proc/pressure").mkdir(parents=True)
    os.symlink("memory", tmp_path / "proc/pressure/memory")  # a loop: stat() fails with ELOOP
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert s.state == DetectorState.ERROR and [os.path.basename(e.path) for e in s.errors] == ["memory"], s.detail
    assert "cannot be read" in s.errors[0].reason


def test_host_malformed_files(tmp_path) -> None:
    write_file(tmp_path, "proc/meminfo", "MemTotal:       65536000 kB\nMemFree: lots\n")
    write_file(tmp_path, "proc/pressure/memory", "some avg10\n")
    events = []
    runner = DetectorRunner([HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0))],
                            on_event=events.append)
    runner.run_once()
    assert sorted(os.path.basename(e.subject) for e in events if e.kind == "detector.error") == ["meminfo", "memory"]
    write_file(tmp_path, "proc/meminfo", "MemTotal:       65536000 kB\n")  # truncated: no MemAvailable
    os.remove(tmp_path / "proc/pressure/memory")  # no PSI support: silently skipped
    events.clear()
    runner.run_once()
    assert [e.evidence["reason"] for e in events if e.kind == "detector.error"] == ["no MemAvailable line (truncated?)"]


def test_thermal_trip_points(tmp_path) -> None:
    trips = {"passive": 85000, "hot": 95000, "critical": 105000}
    write_thermal_zone(tmp_path, 0, 45000, trips)
    write_thermal_zone(tmp_path, 1, 30000, {}, "acpitz")
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    s = det.sample()
    assert s.events == [] and s.metrics["max_temp_c"] == 45.0 and s.metrics["zones"] == 2.0
    write_thermal_zone(tmp_path, 0, 101000, trips)
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["hw.temp_critical", "hw.temp_hot", "hw.temp_throttling"]
    crit = next(e for e in s.events if e.kind == "hw.temp_critical")
    assert crit.action == Action.CHECKPOINT_NOW and crit.subject == "thermal_zone0:x86_pkg_temp"
    assert s.state == DetectorState.FAILED
    write_thermal_zone(tmp_path, 0, 50000, trips)
    assert sorted(e.kind for e in det.sample().events) == [
        "hw.temp_critical.cleared", "hw.temp_hot.cleared", "hw.temp_throttling.cleared"]


def test_a_zone_removed_with_its_driver_ends_its_conditions(tmp_path) -> None:
    """NIC and NVMe drivers register thermal zones of their own, removed when the driver reloads or the device
    goes. A zone removed while hot kept its conditions active for good (listed among the node's active
    conditions for a zone that no longer exists); they now end with it, and a removal is no read error."""
    trips = {"passive": 85000, "hot": 95000, "critical": 105000}
    write_thermal_zone(tmp_path, 0, 45000, trips)
    write_thermal_zone(tmp_path, 3, 101000, trips, "mlx5")
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    assert len(det.sample().events) == 3 and len(det.active_conditions()) == 3
    shutil.rmtree(tmp_path / "sys/class/thermal/thermal_zone3")
    s = det.sample()
    assert sorted(e.kind for e in s.events) == [
        "hw.temp_critical.cleared", "hw.temp_hot.cleared", "hw.temp_throttling.cleared"]
    assert {e.subject for e in s.events} == {"thermal_zone3:mlx5"} and "gone" in s.events[0].message
    assert (s.errors, s.state, det.active_conditions()) == ([], DetectorState.OK, [])
    # Listed, then removed before its files are read: the class link points at a device folder that is gone.
    os.symlink("../../devices/virtual/thermal/thermal_zone7", tmp_path / "sys/class/thermal/thermal_zone7")
    s = det.sample()
    assert (s.errors, s.events, s.state) == ([], [], DetectorState.OK)
    write_thermal_zone(tmp_path, 3, 101000, trips, "mlx5")
    assert len(det.sample().events) == 3
    shutil.rmtree(tmp_path / "sys/class/thermal")  # the last zones go: nothing to watch, nothing left active
    s = det.sample()
    assert s.state == DetectorState.NO_HARDWARE and len(s.events) == 3 and det.active_conditions() == []


def test_unset_trip_points_raise_nothing(tmp_path) -> None:
    """x86_pkg_temp on an Intel server: two ``passive`` trips at 0 until someone programs them (newer kernels:
    -274000, THERMAL_TEMP_INVALID; ACPI zones use that for a critical trip they have no value for). Every
    temperature is above them: the detector read DEGRADED (throttling) on every such node, and a critical trip
    at -274 C asked for a checkpoint at 45 C. A real trip beside them still counts."""
    z0, z1 = "sys/class/thermal/thermal_zone0", "sys/class/thermal/thermal_zone1"
    write_thermal_zone(tmp_path, 0, 45000, {})
    for i, t in enumerate(("0", "0")):
        write_file(tmp_path, f"{z0}/trip_point_{i}_type", "passive\n")
        write_file(tmp_path, f"{z0}/trip_point_{i}_temp", t + "\n")
    write_thermal_zone(tmp_path, 1, 45000, {"passive": -274000, "critical": -274000, "hot": 90000}, "acpitz")
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.OK, [e.message for e in s.events]
    write_file(tmp_path, f"{z1}/temp", "91000\n")
    assert [e.kind for e in det.sample().events] == ["hw.temp_hot"]


def test_a_zone_held_at_its_trip_point_raises_one_event_not_one_per_crossing(tmp_path) -> None:
    """A zone the kernel throttles sits at its passive trip, a tenth of a degree either side from one sample to the
    next: every crossing raised hw.temp_throttling and its .cleared again, an event every 20 s for as long as the
    node ran hot. The condition ends once the zone is 2 C below the trip (or the trip's own hysteresis, if larger);
    a later rise is a new event."""
    z = "sys/class/thermal/thermal_zone0"
    write_thermal_zone(tmp_path, 0, 85100, {"passive": 85000})
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    assert [e.kind for e in det.sample().events] == ["hw.temp_throttling"]
    for mc in (84900, 85200, 84800, 83100):
        write_file(tmp_path, f"{z}/temp", f"{mc}\n")
        s = det.sample()
        assert s.events == [] and s.state == DetectorState.DEGRADED, mc
    write_file(tmp_path, f"{z}/temp", "82900\n")
    assert [e.kind for e in det.sample().events] == ["hw.temp_throttling.cleared"]
    write_file(tmp_path, f"{z}/temp", "85000\n")
    assert [e.kind for e in det.sample().events] == ["hw.temp_throttling"]
    write_file(tmp_path, f"{z}/trip_point_0_hyst", "5000\n")  # the driver's own, larger
    write_file(tmp_path, f"{z}/temp", "80500\n")
    assert det.sample().events == []
    write_file(tmp_path, f"{z}/temp", "79900\n")
    assert [e.kind for e in det.sample().events] == ["hw.temp_throttling.cleared"]


def test_a_zone_without_a_temperature_is_no_read_error(tmp_path, monkeypatch) -> None:
    """Intel's "INT3400 Thermal" zone (a DPTF policy zone) answers a read of its temp with ENODATA, a sensor not
    ready yet with EAGAIN: each was a detector.error, the thermal detector in ERROR for good and trainguard detect
    exiting 1 on every such machine. A regular file cannot fail so, so the read syscall answers as that kernel does
    for that zone's temp only; the other zones are judged, and any other read error is still one."""
    write_thermal_zone(tmp_path, 0, 45000, {"critical": 105000}, "acpitz")
    write_thermal_zone(tmp_path, 1, 20000, {}, "INT3400 Thermal")
    write_thermal_zone(tmp_path, 2, 104000, {"critical": 105000})
    real_read = os.read
    failing = {"zone": "thermal_zone1", "errno": errno.ENODATA}

    def kernel_read(fd: int, n: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{failing['zone']}/temp"):
            raise OSError(failing["errno"], os.strerror(failing["errno"]))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    s = det.sample()
    assert s.errors == [] and [e.kind for e in s.events] == ["hw.temp_critical"]
    assert "temp_c[thermal_zone1:INT3400 Thermal]" not in s.metrics and s.metrics["max_temp_c"] == 104.0
    failing["errno"] = errno.EAGAIN
    assert det.sample().errors == []
    failing["errno"] = errno.EIO
    assert len(det.sample().errors) == 1


def test_thermal_malformed_and_absent(tmp_path) -> None:
    assert ThermalDetector(ThermalConfig(root=str(tmp_path))).sample().state == DetectorState.NO_HARDWARE
    write_thermal_zone(tmp_path, 0, 45000, {"critical": 105000})
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/temp", "")  # empty: sensor returned nothing
    s = ThermalDetector(ThermalConfig(root=str(tmp_path))).sample()
    assert s.state == DetectorState.ERROR and "expected one integer" in s.detail


def test_edac_uncorrectable_and_correctable_rate(tmp_path) -> None:
    write_edac_mc(tmp_path, 0, 0, 0)
    write_edac_mc(tmp_path, 1, 5, 0, dimms=((5, 0),))
    det = EdacDetector(EdacConfig(root=str(tmp_path), ce_per_hour=100))
    s = det.sample()
    assert s.events == [] and s.metrics["ce_total"] == 5.0 and s.metrics["controllers"] == 2.0
    time.sleep(0.05)
    write_edac_mc(tmp_path, 0, 0, 1, dimms=((0, 1),))
    write_edac_mc(tmp_path, 1, 106, 0, dimms=((106, 0),))  # 101 new: over 100 within the hour
    s = det.sample()
    by_kind = {e.kind: e for e in s.events}
    ue = by_kind["hw.memory_ue"]
    assert ue.severity == Severity.CRITICAL and ue.action == Action.DRAIN_NODE and ue.subject == "mc0"
    assert "CPU_SrcID#0_MC#0_Chan#0_DIMM#0: ce=0 ue=1" in ue.message
    assert by_kind["hw.memory_ce_rate"].subject == "mc1"
    assert s.state == DetectorState.FAILED


def test_edac_a_stray_correctable_error_is_no_rate_over_the_threshold(tmp_path) -> None:
    """``ce_per_hour`` counts the errors of the last hour. It was one interval's rate scaled to an hour: one
    correctable error between two samples 30 s apart read as 120/hour, over the default 100, so every stray
    error (a healthy DIMM logs a few a day) raised and cleared a warning. Here one error, then 99 more, stay
    within 100 in the hour; the 101st raises it once, and it holds while the hour still has them."""
    write_edac_mc(tmp_path, 0, ce=7, ue=0)
    det = EdacDetector(EdacConfig(root=str(tmp_path), ce_per_hour=100))
    assert det.sample().events == []
    for ce in (8, 107):  # one error, then 99 more: 100 in the hour, not over it
        write_edac_mc(tmp_path, 0, ce=ce, ue=0)
        s = det.sample()
        assert s.events == [] and s.state == DetectorState.OK, s.events
    write_edac_mc(tmp_path, 0, ce=108, ue=0)
    s = det.sample()
    assert [e.kind for e in s.events] == ["hw.memory_ce_rate"]
    assert "101 correctable memory errors in the last" in s.events[0].message
    assert s.events[0].evidence["ce_last_hour"] == "101"
    s = det.sample()  # no new error, but the hour still holds 101
    assert s.events == [] and s.state == DetectorState.DEGRADED


def test_edac_controllers_back_after_a_driver_reload_count_from_zero(tmp_path) -> None:
    """Unloading the EDAC driver removes its memory controllers; loaded again, they count from zero. mc0 had
    one uncorrectable error before and one new after the reload: the count read the same (1), no event."""
    write_edac_mc(tmp_path, 0, ce=10, ue=1)
    det = EdacDetector(EdacConfig(root=str(tmp_path)))
    assert [e.evidence["before_agent_start"] for e in det.sample().events] == ["1"]  # the error from before
    shutil.rmtree(tmp_path / "sys/devices/system/edac/mc/mc0")
    assert det.sample().state == DetectorState.NO_HARDWARE
    write_edac_mc(tmp_path, 0, ce=0, ue=1)
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("hw.memory_ue", "mc0")]
    assert det.sample().events == []  # the same error once


def test_edac_malformed_and_absent(tmp_path) -> None:
    assert EdacDetector(EdacConfig(root=str(tmp_path))).sample().state == DetectorState.NO_HARDWARE
    write_edac_mc(tmp_path, 0, 0, 0)
    write_file(tmp_path, "sys/devices/system/edac/mc/mc0/ue_count", "0x1\n")
    s = EdacDetector(EdacConfig(root=str(tmp_path))).sample()
    assert s.state == DetectorState.ERROR and len(s.errors) == 1


def test_disk_usage_readonly_and_probe(tmp_path) -> None:
    det = DiskDetector(DiskConfig(paths=(str(tmp_path),), write_probe=True))
    s = det.sample()
    assert f"used_pct[{tmp_path}]" in s.metrics and f"write_probe_s[{tmp_path}]" in s.metrics
    assert not list(tmp_path.iterdir())  # the probe file is gone
    # A threshold below the real usage makes this disk "full" for the test.
    det = DiskDetector(DiskConfig(paths=(str(tmp_path),), warn_used_pct=0.001, error_used_pct=0.002))
    s = det.sample()
    assert [e.kind for e in s.events] == ["disk.full"] and s.state == DetectorState.FAILED


def test_disk_read_only_mount(tmp_path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        s = DiskDetector(DiskConfig(paths=(str(mnt),), write_probe=True)).sample()
        assert [e.kind for e in s.events] == ["disk.read_only"] and "tmpfs" in s.events[0].message
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_missing_path_and_bad_config(tmp_path) -> None:
    s = DiskDetector(DiskConfig(paths=(str(tmp_path / "nope"),))).sample()
    assert s.state == DetectorState.ERROR and "cannot stat" in s.detail
    with pytest.raises(DetectorConfigError):
        DiskConfig.from_dict({"paths": [], "interval_s": 5})
    with pytest.raises(DetectorConfigError, match="unknown field"):
        DiskConfig.from_dict({"pahts": ["/"]})


def test_disk_block_device_states(tmp_path) -> None:
    write_file(tmp_path, "sys/class/nvme/nvme0/state", "live\n")
    write_file(tmp_path, "sys/class/nvme/nvme1/state", "live\n")
    write_file(tmp_path, "sys/block/sda/device/state", "running\n")
    (tmp_path / "sys/block/loop0").mkdir(parents=True)  # no device/state: not checked
    det = DiskDetector(DiskConfig(root=str(tmp_path), paths=(str(tmp_path),)))
    s = det.sample()
    assert s.events == [] and s.metrics["block_devices_checked"] == 3.0
    write_file(tmp_path, "sys/class/nvme/nvme1/state", "dead\n")
    write_file(tmp_path, "sys/block/sda/device/state", "offline\n")
    s = det.sample()
    assert sorted((e.kind, e.subject) for e in s.events) == [
        ("disk.device_unhealthy", "block:sda"), ("disk.device_unhealthy", "nvme:nvme1")]
    assert s.state == DetectorState.FAILED and s.metrics["block_devices_unhealthy"] == 2.0
    write_file(tmp_path, "sys/class/nvme/nvme0/state", "")
    s = det.sample()
    assert len(s.errors) == 1 and "state word" in s.errors[0].reason


def _sysfs_link(root, link: str, target: str) -> None:
    path = root / link
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)


def test_disk_judges_only_scsi_disks_by_the_scsi_state(tmp_path) -> None:
    # The kernel's own layout: an NVMe namespace's /sys/block/<disk>/device is its controller (state "live"), a
    # Xen disk's its xenbus device (state "Connected"); only a SCSI disk's state reads "running".
    pci = "sys/devices/pci0000:00/0000:00:1d.0/0000:3d:00.0"
    write_file(tmp_path, f"{pci}/nvme/nvme0/state", "live\n")
    (tmp_path / f"{pci}/nvme/nvme0/nvme0n1").mkdir()
    _sysfs_link(tmp_path, f"{pci}/nvme/nvme0/subsystem", "../../../../../class/nvme")
    _sysfs_link(tmp_path, f"{pci}/nvme/nvme0/nvme0n1/device", "../../nvme0")
    _sysfs_link(tmp_path, "sys/class/nvme/nvme0", f"../../{pci[4:]}/nvme/nvme0")
    _sysfs_link(tmp_path, "sys/block/nvme0n1", f"../{pci[4:]}/nvme/nvme0/nvme0n1")
    write_file(tmp_path, "sys/devices/vbd-51712/state", "Connected\n")
    (tmp_path / "sys/bus/xen").mkdir(parents=True)
    _sysfs_link(tmp_path, "sys/devices/vbd-51712/subsystem", "../../bus/xen")
    _sysfs_link(tmp_path, "sys/block/xvda/device", "../../devices/vbd-51712")
    write_file(tmp_path, "sys/devices/host0/0:0:0:0/state", "running\n")
    (tmp_path / "sys/bus/scsi").mkdir(parents=True)
    _sysfs_link(tmp_path, "sys/devices/host0/0:0:0:0/subsystem", "../../../bus/scsi")
    _sysfs_link(tmp_path, "sys/block/sda/device", "../../devices/host0/0:0:0:0")
    det = DiskDetector(DiskConfig(root=str(tmp_path), paths=(str(tmp_path),)))
    s = det.sample()
    assert (s.events, s.errors, s.state) == ([], [], DetectorState.OK)
    assert s.metrics["block_devices_checked"] == 2.0  # nvme:nvme0 and block:sda
    write_file(tmp_path, "sys/devices/host0/0:0:0:0/state", "offline\n")
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("disk.device_unhealthy", "block:sda")]
    # A controller being removed prints "deleting (no IO)": an unhealthy controller, not an unreadable file.
    write_file(tmp_path, f"{pci}/nvme/nvme0/state", "deleting (no IO)\n")
    s = det.sample()
    assert s.errors == [] and [(e.kind, e.subject) for e in s.events] == [("disk.device_unhealthy", "nvme:nvme0")]
    assert "deleting (no IO)" in s.events[0].message


def test_memory_hovering_at_its_threshold_raises_one_event_not_one_per_crossing(tmp_path) -> None:
    """Available memory going around 5% (a checkpoint allocates, then frees) raised and cleared host.memory_low at
    every crossing, and each raise asked the job for a checkpoint, which allocated again. It now ends 1 point
    above the threshold."""
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    det = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0))
    kinds = []
    for pct in (50.0, 4.9, 5.2, 4.8, 5.9, 4.9, 6.1, 50.0):
        write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=int(65536000 * pct / 100)))
        kinds += [e.kind for e in det.sample().events if e.kind.startswith("host.memory_low")]
    assert kinds == ["host.memory_low", "host.memory_low.cleared"]


def test_a_disk_out_of_inodes_says_inodes_not_space(tmp_path) -> None:
    """A checkpoint directory of many small shard files runs out of inodes with its space nearly free. The
    event read "98.0% full" and the operator's df -h showed the disk almost empty; it now names the inodes."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m,nr_inodes=50", "tmpfs", str(mnt)], check=True)
    try:
        for i in range(49):  # the root directory holds one inode
            (mnt / f"shard{i}").write_bytes(b"x")
        s = DiskDetector(DiskConfig(paths=(str(mnt),), block_devices=False)).sample()
        assert [e.kind for e in s.events] == ["disk.full"]
        assert "100.0% of its inodes used (space 1." in s.events[0].message, s.events[0].message
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_usage_hovering_at_its_threshold_raises_one_event(tmp_path) -> None:
    """A checkpoint directory whose usage goes around the warning level (a step written, the oldest removed) raised
    and cleared disk.filling at every crossing. It now ends 1 point below where it started."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mnt)], check=True)
    try:
        det = DiskDetector(DiskConfig(paths=(str(mnt),), warn_used_pct=50.0, error_used_pct=97.0))
        kinds = []
        for mib in (1.0, 5.3, 4.96, 5.3, 4.96, 4.6):  # 53%, 49.6%, ..., 46%
            with open(mnt / "step.data", "wb") as f:
                f.write(b"\0" * int(mib * (1 << 20)))
            kinds += [e.kind for e in det.sample().events]
        assert kinds == ["disk.filling", "disk.filling.cleared"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_zone_or_memory_controller_removed_while_read_is_gone_not_unreadable(tmp_path, monkeypatch) -> None:
    """A thermal zone of a NIC whose driver unloads, or an EDAC memory controller whose driver unloads, removed
    while its files are read: the read of an open attribute fails with ENODEV, later opens with ENOENT. Each was a
    detector.error (the detector in ERROR). The zone or controller is gone, not unreadable: the next listing
    says so (conditions end, counters forgotten), and the others are judged as before."""
    trips = {"passive": 85000, "hot": 95000, "critical": 105000}
    write_thermal_zone(tmp_path, 0, 45000, trips)
    write_thermal_zone(tmp_path, 3, 101000, trips, "mlx5")
    write_edac_mc(tmp_path, 0, ce=0, ue=0)
    write_edac_mc(tmp_path, 1, ce=0, ue=0)
    thermal = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    edac = EdacDetector(EdacConfig(root=str(tmp_path)))
    assert len(thermal.sample().events) == 3 and edac.sample().events == []
    real_read = os.read

    def kernel_read(fd: int, n: int) -> bytes:
        path = os.readlink(f"/proc/self/fd/{fd}")
        for name, folder in (("/thermal_zone3/trip_point_1_temp", "sys/class/thermal/thermal_zone3"),
                             ("/mc1/ue_count", "sys/devices/system/edac/mc/mc1")):
            if path.endswith(name):
                # the zone or controller goes while this file is open: kernfs answers the read with ENODEV
                shutil.rmtree(tmp_path / folder)
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    s = thermal.sample()
    assert (s.errors, s.events) == ([], [])
    assert sorted(e.kind for e in thermal.sample().events) == [
        "hw.temp_critical.cleared", "hw.temp_hot.cleared", "hw.temp_throttling.cleared"]
    write_edac_mc(tmp_path, 0, ce=0, ue=1)
    s = edac.sample()
    assert s.errors == [] and [(e.kind, e.subject) for e in s.events] == [("hw.memory_ue", "mc0")]
    assert edac.sample().metrics["controllers"] == 1.0


def test_edac_controllers_reloaded_between_two_samples_count_from_zero(tmp_path) -> None:
    """An EDAC driver reload (rmmod and modprobe, seconds) falls between two samples 30 s apart: no sample sees
    the controllers gone, and they came back counting from zero. mc0 had one uncorrectable error before and one
    new after: the count read the same (1), no event. The controller's folder is a new one (kernfs numbers it
    anew), so its counts are new errors."""
    write_edac_mc(tmp_path, 0, ce=10, ue=1)
    det = EdacDetector(EdacConfig(root=str(tmp_path)))
    assert [e.evidence["before_agent_start"] for e in det.sample().events] == ["1"]  # the error from before
    assert det.sample().events == []  # the same folder: nothing new
    mc = tmp_path / "sys/devices/system/edac/mc"
    (mc / "mc0").rename(mc / "mc0.unloading")  # still there while the new one is made: another inode
    write_edac_mc(tmp_path, 0, ce=0, ue=1)
    shutil.rmtree(mc / "mc0.unloading")
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("hw.memory_ue", "mc0")]
    assert "1 uncorrectable" in s.events[0].message
    assert det.sample().events == []  # the same error once


def test_a_disk_removed_while_its_state_is_read_is_gone_not_unreadable(tmp_path, monkeypatch) -> None:
    """An NVMe controller deleted (hot-unplug, a failed reset) or a SCSI disk removed after it was listed: the
    read of its open state fails with ENODEV. That was a detector.error (the detector in ERROR) naming a file
    that no longer exists; the disk is gone, and the others are judged as before."""
    write_file(tmp_path, "sys/class/nvme/nvme0/state", "live\n")
    write_file(tmp_path, "sys/class/nvme/nvme1/state", "live\n")
    write_file(tmp_path, "sys/block/sda/device/state", "running\n")
    write_file(tmp_path, "sys/block/sdb/device/state", "running\n")
    det = DiskDetector(DiskConfig(root=str(tmp_path), paths=(str(tmp_path),)))
    assert det.sample().events == []
    write_file(tmp_path, "sys/block/sda/device/state", "offline\n")
    real_read = os.read

    def kernel_read(fd: int, n: int) -> bytes:
        path = os.readlink(f"/proc/self/fd/{fd}")
        for name, folder in (("/nvme1/state", "sys/class/nvme/nvme1"), ("/sdb/device/state", "sys/block/sdb")):
            if path.endswith(name):
                shutil.rmtree(tmp_path / folder)  # removed while its state is open: kernfs answers ENODEV
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    s = det.sample()
    assert s.errors == [] and [(e.kind, e.subject) for e in s.events] == [("disk.device_unhealthy", "block:sda")]


def test_a_disk_removed_for_good_ends_its_condition(tmp_path) -> None:
    """A disk or NVMe controller that went unhealthy and was then removed for good (hot-unplugged, a controller
    deleted after a failed reset): its disk.device_unhealthy stayed active forever, the detector FAILED for a
    device that no longer exists; only one re-added under its name cleared. It now ends as no longer present,
    while a device still listed whose state cannot be read keeps its condition."""
    write_file(tmp_path, "sys/class/nvme/nvme0/state", "live\n")
    write_file(tmp_path, "sys/block/sda/device/state", "running\n")
    write_file(tmp_path, "sys/block/sdb/device/state", "running\n")
    det = DiskDetector(DiskConfig(root=str(tmp_path), paths=(str(tmp_path),)))
    assert det.sample().events == []
    write_file(tmp_path, "sys/class/nvme/nvme0/state", "dead\n")
    write_file(tmp_path, "sys/block/sda/device/state", "offline\n")
    write_file(tmp_path, "sys/block/sdb/device/state", "offline\n")
    s = det.sample()
    assert sorted(e.subject for e in s.events) == ["block:sda", "block:sdb", "nvme:nvme0"]
    shutil.rmtree(tmp_path / "sys/class/nvme/nvme0")
    shutil.rmtree(tmp_path / "sys/block/sda")
    write_file(tmp_path, "sys/block/sdb/device/state", "")  # still there, its state unreadable: held
    s = det.sample()
    cleared = sorted((e.kind, e.subject, e.severity) for e in s.events)
    assert cleared == [("disk.device_unhealthy.cleared", "block:sda", Severity.INFO),
                       ("disk.device_unhealthy.cleared", "nvme:nvme0", Severity.INFO)]
    assert all("no longer present" in e.message for e in s.events)
    assert [e.subject for e in det.active_conditions()] == ["block:sdb"]
    write_file(tmp_path, "sys/block/sdb/device/state", "running\n")
    s = det.sample()
    assert [e.kind for e in s.events] == ["disk.device_unhealthy.cleared"] and s.state == DetectorState.OK
    assert det.active_conditions() == [] and det.sample().events == []


def test_a_disabled_thermal_zone_raises_no_critical_event(tmp_path, monkeypatch) -> None:
    """A zone whose mode reads 'disabled' (its kernel thermal management off: no shutdown at its critical trip)
    sat far above its critical trip with the node running: a bogus trip or a zone left to user space. It raised
    hw.temp_critical (checkpoint now, the detector FAILED) for good. Its critical trip is not judged now, the
    status says the zone is disabled; an enabled zone and one whose mode cannot be told are judged as before."""
    write_thermal_zone(tmp_path, 0, 120000, {"critical": 105000}, "acpitz")
    write_thermal_zone(tmp_path, 1, 120000, {"critical": 105000}, "pch_cannonlake")
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/mode", "disabled\n")
    write_file(tmp_path, "sys/class/thermal/thermal_zone1/mode", "enabled\n")
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("hw.temp_critical", "thermal_zone1:pch_cannonlake")]
    assert s.metrics["zone_disabled[thermal_zone0:acpitz]"] == 1.0 and s.errors == []
    write_file(tmp_path, "sys/class/thermal/thermal_zone1/mode", "disabled\n")
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("hw.temp_critical.cleared", "thermal_zone1:pch_cannonlake")]
    assert "is disabled" in s.events[0].message
    assert s.state == DetectorState.OK and "thermal_zone0:acpitz, thermal_zone1:pch_cannonlake" in s.detail
    assert "disabled" in s.detail
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/mode", "enab\n")  # cut: judged as enabled, and said
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("hw.temp_critical", "thermal_zone0:acpitz")]
    (err,) = s.errors
    assert err.path.endswith("thermal_zone0/mode") and "'enab'" in err.reason
    # before Linux 5.9 a zone whose driver has no get_mode answers EPERM: no read error, judged as enabled
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/mode", "disabled\n")
    real_read = os.read

    def kernel_read(fd: int, n: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("thermal_zone0/mode"):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    s = det.sample()
    assert (s.events, s.errors) == ([], []) and s.state == DetectorState.FAILED


def test_a_disabled_thermal_zone_is_not_judged_against_its_hot_and_passive_trips(tmp_path) -> None:
    """The kernel neither throttles a disabled zone at its passive trip nor acts on its hot trip: such a zone far
    above both (a bogus trip, or a zone left to user space) raised hw.temp_throttling, saying "throttled", and
    hw.temp_hot for as long as the node ran. Enabling the zone judges it again; disabling it clears both."""
    write_thermal_zone(tmp_path, 0, 95000, {"passive": 70000, "hot": 85000, "critical": 105000}, "acpitz")
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/mode", "disabled\n")
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.OK and s.metrics["temp_c[thermal_zone0:acpitz]"] == 95.0
    assert "trips not judged: thermal_zone0:acpitz" in s.detail
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/mode", "enabled\n")
    assert sorted(e.kind for e in det.sample().events) == ["hw.temp_hot", "hw.temp_throttling"]
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/mode", "disabled\n")
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["hw.temp_hot.cleared", "hw.temp_throttling.cleared"]
    assert all("is disabled" in e.message for e in s.events) and det.active_conditions() == []


def test_edac_uncorrectable_errors_from_before_the_start_are_said_once(tmp_path) -> None:
    """A node with uncorrectable memory errors earlier in this boot, before the agent started: the detector was
    FAILED from its first sample with no event saying why (a first reading is no increase), so an operator saw a
    failed node and nothing to explain it. One event now says so, as critical with drain-node as any
    uncorrectable error, its evidence saying the count is from before the start; it is not repeated."""
    write_edac_mc(tmp_path, 0, ce=3, ue=0)
    write_edac_mc(tmp_path, 1, ce=0, ue=2, dimms=((0, 2),))
    det = EdacDetector(EdacConfig(root=str(tmp_path)))
    s = det.sample()
    (ev,) = s.events
    assert (ev.kind, ev.subject, ev.severity, ev.action) == ("hw.memory_ue", "mc1", Severity.CRITICAL,
                                                             Action.DRAIN_NODE)
    assert "2 uncorrectable memory error(s) on mc1" in ev.message and "before the agent started" in ev.message
    assert ev.evidence["before_agent_start"] == "1" and "reset at boot" in ev.evidence["counted"]
    assert ev.evidence["ue_count"] == "2" and "CPU_SrcID#0_MC#1_Chan#0_DIMM#0: ce=0 ue=2" in ev.evidence["dimms"]
    assert s.state == DetectorState.FAILED
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.FAILED  # once
    write_edac_mc(tmp_path, 1, ce=0, ue=3, dimms=((0, 3),))
    (ev,) = det.sample().events
    assert ev.message.startswith("1 uncorrectable") and "before_agent_start" not in ev.evidence
    # a controller first listed later (its driver loaded since): counted before its first reading, not before
    # the start
    write_edac_mc(tmp_path, 2, ce=0, ue=1)
    (ev,) = det.sample().events
    assert ev.subject == "mc2" and ev.evidence["before_agent_start"] == "0"
    assert "before this detector first read it" in ev.message
