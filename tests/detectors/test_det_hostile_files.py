"""Corrupt files in the kernel's own formats: each is a read error naming the file, never a traceback out of the
sample or a number no kernel prints passed on as a measurement."""

from __future__ import annotations

import math
import os
import threading

import pytest

from trainguard.detectors.ascend import parse_npu_smi_info
from trainguard.detectors.disk import DiskConfig, DiskDetector
from trainguard.detectors.edac import EdacConfig, EdacDetector
from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.ethtool import parse_ethtool_s
from trainguard.detectors.host import HostConfig, HostDetector
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.detectors.process import parse_proc_stat
from trainguard.detectors.roce import RoceConfig, RoceDetector
from trainguard.detectors.thermal import ThermalConfig, ThermalDetector
from trainguard.testing.sysfs import write_edac_mc, write_file, write_pci_device, write_rdma_port, write_thermal_zone

BEYOND_U64 = "9" * 20  # 1e20: past 2**64 - 1 (1.8e19)
U64_MAX = str((1 << 64) - 1)
GPU = "0000:3b:00.0"
MEMINFO = "MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:    {avail} kB\n"
NPU_SMI_ONE = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 65536         |
+===========================+===============+====================================================+
"""
PSI = "some avg10={some} avg60=1.00 avg300=0.50 total=123456\nfull avg10={full} avg60=0.80 avg300=0.20 total=98765\n"


def _reasons(sample) -> list[str]:
    return [str(e) for e in sample.errors]


def test_integers_beyond_64_bits_are_read_errors_not_measurements(tmp_path):
    """A 20-digit temperature read as 1e17 degrees (a critical trip crossed: a drain), a 20-digit RDMA counter
    as some 1e18 errors per second; no kernel prints an integer outside 64 bits. The largest u64 still reads."""
    write_thermal_zone(tmp_path, 0, 45000, {"critical": 105000})
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/temp", BEYOND_U64 + "\n")
    s = ThermalDetector(ThermalConfig(root=str(tmp_path))).sample()
    assert s.events == [] and not any(k.startswith("temp_c") for k in s.metrics)
    assert any("thermal_zone0/temp" in r and "64-bit" in r for r in _reasons(s)), _reasons(s)

    write_rdma_port(tmp_path, netdev=None)
    roce = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    roce.sample()
    write_file(tmp_path, "sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error", BEYOND_U64 + "\n")
    s = roce.sample()
    assert all(math.isfinite(v) and abs(v) < 1e20 for v in s.metrics.values()), s.metrics
    assert any("symbol_error" in r and "64-bit" in r for r in _reasons(s)), _reasons(s)

    write_pci_device(tmp_path, GPU, fatal={"DLP": 1})
    write_file(tmp_path, f"sys/bus/pci/devices/{GPU}/aer_dev_fatal", f"DLP {BEYOND_U64}\nTOTAL_ERR_FATAL 1\n")
    s = PcieDetector(PcieConfig(root=str(tmp_path))).sample()
    assert any("aer_dev_fatal" in r and "64-bit" in r for r in _reasons(s)), _reasons(s)

    write_file(tmp_path, "sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error", "0\n")
    write_file(tmp_path, "sys/class/infiniband/mlx5_0/ports/1/hw_counters/out_of_sequence", U64_MAX + "\n")
    s = roce.sample()  # hw_counters are u64 (symbol_error is 16 bits: past them, test_a_counter_past_its_...)
    assert not any("symbol_error" in r or ("out_of_sequence" in r and "64-bit" in r) for r in _reasons(s)), \
        _reasons(s)


@pytest.mark.parametrize("meminfo, needle", [
    ("MemTotal:       ² kB\nMemAvailable:    5 kB\n", "line 1"),  # isdigit() takes it, int() raised ValueError
    (f"MemTotal:       {'9' * 5000} kB\nMemAvailable:    5 kB\n", "line 1"),  # int() refuses > 4300 digits
    ("MemTotal:       0 kB\nMemAvailable:    5 kB\n", "impossible"),  # read as 512000% available
    (MEMINFO.format(avail=99999999), "impossible"),  # more available than there is: 152%
])
def test_corrupt_meminfo_is_a_read_error(tmp_path, meminfo, needle):
    write_file(tmp_path, "proc/meminfo", meminfo)
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert not any(k.startswith("mem_available") for k in s.metrics) and s.events == []
    assert any("meminfo" in r and needle in r for r in _reasons(s)), _reasons(s)


@pytest.mark.parametrize("some, full", [("inf", "0.00"), ("0.00", "nan"), ("1e999", "0.00"), ("-3.00", "0.00"),
                                        ("0.00", "250.00")])
def test_pressure_that_is_no_percentage_is_a_read_error(tmp_path, some, full):
    """``float()`` took 'inf', 'nan' and '1e999': an infinite pressure metric made the predictor refuse the whole
    sample, the rules tier's part too, and a NaN one could never cross the memory pressure threshold."""
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    for resource in ("memory", "io", "cpu"):
        write_file(tmp_path, f"proc/pressure/{resource}", PSI.format(some=some, full=full))
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert not any("pressure" in k for k in s.metrics), s.metrics
    assert sorted(r.split(":")[0].rsplit("/", 1)[1] for r in _reasons(s)) == ["cpu", "io", "memory"], _reasons(s)
    assert all("percentage" in r for r in _reasons(s))
    assert s.metrics["mem_available_pct"] == pytest.approx(50.0)  # the rest of the sample still counts


def test_a_blank_line_in_a_pressure_file_is_skipped(tmp_path):
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    write_file(tmp_path, "proc/pressure/memory", PSI.format(some="1.50", full="0.25").replace("\n", "\n\n", 1))
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert s.metrics["mem_pressure_some_avg10"] == 1.5 and s.metrics["mem_pressure_full_avg10"] == 0.25
    assert not any("pressure/memory" in r for r in _reasons(s)), _reasons(s)


@pytest.mark.parametrize("limit", ["-5", "1_000", "٦٤", "9" * 20])
def test_a_cgroup_limit_that_is_no_byte_count_is_a_read_error(tmp_path, limit):
    """``int()`` took '-5' (no room at all: memory_low and a checkpoint asked for on garbage), '1_000' and other
    scripts' digits; the node's own figures still count."""
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    write_file(tmp_path, "proc/self/cgroup", "0::/job\n")
    write_file(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n")
    write_file(tmp_path, "sys/fs/cgroup/job/memory.max", limit + "\n")
    write_file(tmp_path, "sys/fs/cgroup/job/memory.current", "1000\n")
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    assert s.events == [] and s.metrics["mem_available_pct"] == pytest.approx(50.0)
    assert any("job/memory.max" in r for r in _reasons(s)), _reasons(s)


def test_a_link_speed_no_pcie_link_has_is_a_read_error(tmp_path):
    """400 nines before 'GT/s' read as an infinite maximum speed, silently: no error, no slow-link judgement."""
    write_pci_device(tmp_path, GPU, max_speed="9" * 400 + " GT/s PCIe")
    s = PcieDetector(PcieConfig(root=str(tmp_path))).sample()
    assert any("max_link_speed" in r and "GT/s" in r for r in _reasons(s)), _reasons(s)


ARABIC_50 = "\u0665\u0660"  # '٥٠': isdigit(), int() and float() read it as 50


def test_digits_of_other_scripts_are_no_numbers_in_any_parser(tmp_path):
    """``\\d``, isdigit(), int() and float() all take other scripts' digits (and float() 'nan', int() '1_0');
    the kernel and the vendor tools print ASCII. Each parser refuses them as not in its format."""
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=32768000))
    write_file(tmp_path, "proc/pressure/memory", PSI.format(some="1.00", full=ARABIC_50 + ".00"))
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert "mem_pressure_full_avg10" not in s.metrics and s.events == []
    assert any("pressure/memory" in r and "percentage" in r for r in _reasons(s)), _reasons(s)

    with pytest.raises(DetectorReadError, match="line 2"):
        parse_ethtool_s(f"NIC statistics:\n     rx_prio3_pause: {ARABIC_50}\n")
    with pytest.raises(DetectorReadError, match="line 2"):  # int() of 5000 digits raised ValueError
        parse_ethtool_s(f"NIC statistics:\n     rx_prio3_pause: {'9' * 5000}\n")
    for cell in (f"93.6        {ARABIC_50}", "93.6        nan", "1_0         40"):
        with pytest.raises(DetectorReadError):
            parse_npu_smi_info(NPU_SMI_ONE.replace("93.6        40", cell))
    assert parse_npu_smi_info(NPU_SMI_ONE)[0].temp_c == 40.0

    write_rdma_port(tmp_path, netdev=None, state="\u0664: ACTIVE")
    s = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False)).sample()
    assert not any(k.startswith("port_active") for k in s.metrics)
    assert any("ports/1/state" in r and "<n>: <STATE>" in r for r in _reasons(s)), _reasons(s)

    write_thermal_zone(tmp_path, 0, 45000, {})  # a trip point numbered '٠', set at 1 C: a critical overheat
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/trip_point_\u0660_type", "critical\n")
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/trip_point_\u0660_temp", "1000\n")
    assert ThermalDetector(ThermalConfig(root=str(tmp_path))).sample().events == []

    write_edac_mc(tmp_path, 0, 0, 0)
    write_edac_mc(tmp_path, 1, 0, 0)
    os.rename(tmp_path / "sys/devices/system/edac/mc/mc1", tmp_path / "sys/devices/system/edac/mc/mc\u00b2")
    write_file(tmp_path, "sys/devices/system/edac/mc/mc\u00b2/ue_count", "3\n")
    s = EdacDetector(EdacConfig(root=str(tmp_path))).sample()
    assert s.metrics["controllers"] == 1.0 and s.metrics["ue_total"] == 0.0, s.metrics

    fields = ["S"] + ["0"] * 20
    for rss in ("-5", "1_000"):  # a negative resident size, an underscore int() allows
        with pytest.raises(ValueError, match="rss"):
            parse_proc_stat("1 (x) " + " ".join(fields + [rss]))


def test_a_negative_counter_is_a_read_error_not_a_negative_rate(tmp_path):
    """Counters are unsigned. '-5' read as a count gave negative error rates, and the sane reading after it a
    jump from -5 taken for 5 new errors: a port's link_downed and RNR retries raised events (ERROR/FAILED) on
    a healthy NIC. Each is a read error naming the file, and the next sane reading counts nothing new."""
    write_rdma_port(tmp_path, netdev="ens1f0np0")
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    det.sample()
    port = "sys/class/infiniband/mlx5_0/ports/1"
    for rel in (f"{port}/counters/link_downed", f"{port}/hw_counters/rnr_nak_retry_err",
                "sys/class/net/ens1f0np0/statistics/rx_crc_errors"):
        write_file(tmp_path, rel, "-5\n")
    s = det.sample()
    assert all(v >= 0 for v in s.metrics.values()), s.metrics
    for name in ("link_downed", "rnr_nak_retry_err", "rx_crc_errors"):
        assert any(name in r and "negative" in r for r in _reasons(s)), _reasons(s)
    write_rdma_port(tmp_path, netdev="ens1f0np0")
    s = det.sample()
    assert s.events == [] and s.errors == [], (s.events, _reasons(s))


def test_a_counter_past_its_kernel_width_is_a_read_error(tmp_path):
    """EDAC's counts are u32 and an IB link_downed 8 bits: a u64 in ue_count read as 1.8e19 uncorrectable
    memory errors (hw.memory_ue, a drain, the detector FAILED), in link_downed as that many link downs. Now a
    read error naming the file; the largest value a counter holds still reads."""
    write_edac_mc(tmp_path, 0, 0, 0)
    edac = EdacDetector(EdacConfig(root=str(tmp_path)))
    edac.sample()
    write_file(tmp_path, "sys/devices/system/edac/mc/mc0/ue_count", U64_MAX + "\n")
    s = edac.sample()
    assert s.events == [] and s.state.name == "ERROR", (s.events, s.state)
    assert any("mc0/ue_count" in r and "32-bit" in r for r in _reasons(s)), _reasons(s)
    write_file(tmp_path, "sys/devices/system/edac/mc/mc0/ce_count", str((1 << 32) - 1) + "\n")
    write_file(tmp_path, "sys/devices/system/edac/mc/mc0/ue_count", "0\n")
    s = edac.sample()
    assert s.errors == [] and s.metrics["ce_count[mc0]"] == float((1 << 32) - 1)

    write_rdma_port(tmp_path, netdev=None)
    roce = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    roce.sample()
    write_file(tmp_path, "sys/class/infiniband/mlx5_0/ports/1/counters/link_downed", "256\n")
    s = roce.sample()
    assert s.events == [] and "link_downed_per_s" not in s.metrics, s.events
    assert any("link_downed" in r and "8-bit" in r for r in _reasons(s)), _reasons(s)


def test_a_temperature_the_kernel_cannot_hold_is_no_overheat(tmp_path):
    """Temperatures and trips are a C int of millidegrees in the kernel: a u64 in ``temp`` read as 1.8e16 C,
    hw.temp_critical (checkpoint) and a FAILED detector; in a critical trip as a trip no zone reached. Both are
    read errors naming the file now. Below absolute zero (THERMAL_TEMP_INVALID) a zone has no reading to judge."""
    write_thermal_zone(tmp_path, 0, 45000, {"passive": 95000, "critical": 105000})
    det = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    det.sample()
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/temp", U64_MAX + "\n")
    s = det.sample()
    assert s.events == [] and s.state.name == "ERROR" and "max_temp_c" not in s.metrics, (s.events, s.metrics)
    assert any("thermal_zone0/temp" in r and "32-bit" in r for r in _reasons(s)), _reasons(s)
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/temp", "-274000\n")
    s = det.sample()
    assert s.events == [] and s.errors == [] and "max_temp_c" not in s.metrics, (s.events, _reasons(s))
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/temp", str((1 << 31) - 1) + "\n")
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/trip_point_1_temp", str(1 << 31) + "\n")
    s = det.sample()
    assert any("trip_point_1_temp" in r and "32-bit" in r for r in _reasons(s)), _reasons(s)
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/trip_point_1_temp", "105000\n")
    write_file(tmp_path, "sys/class/thermal/thermal_zone0/temp", "-5000\n")  # a cold-aisle sensor: a reading
    s = det.sample()
    assert s.errors == [] and s.metrics["max_temp_c"] == -5.0, (_reasons(s), s.metrics)


@pytest.mark.parametrize("rel, state", [("sys/class/nvme/nvme0/state", "li"), ("sys/block/sda/device/state", "runn"),
                                        ("sys/block/sda/device/state", "nan")])
def test_a_device_state_the_kernel_does_not_print_is_a_read_error(tmp_path, rel, state):
    """A cut or corrupt state ('li' for live, 'runn' for running) read as a device unhealthy: disk.device_unhealthy
    (checkpoint-now) and a FAILED detector. The kernel prints states from a fixed table: anything else is a read
    error naming the file; a real state outside the healthy one still counts."""
    write_file(tmp_path, "sys/class/nvme/nvme0/state", "live\n")
    write_file(tmp_path, "sys/block/sda/device/state", "running\n")
    det = DiskDetector(DiskConfig(root=str(tmp_path), paths=(str(tmp_path),)))
    assert det.sample().events == []
    write_file(tmp_path, rel, state + "\n")
    s = det.sample()
    assert s.events == [] and s.state.name == "ERROR", (s.events, s.state)
    assert any(rel in r and "state word the kernel prints" in r for r in _reasons(s)), _reasons(s)
    write_file(tmp_path, "sys/block/sda/device/state", "transport-offline\n")
    assert [e.kind for e in det.sample().events] == ["disk.device_unhealthy"]


@pytest.mark.parametrize("name, value", [("current_link_width", "-5"), ("max_link_width", "9" * 19),
                                         ("max_link_width", "64")])
def test_a_link_width_outside_its_register_field_is_a_read_error(tmp_path, name, value):
    """Link widths are a 6-bit register field (0-63). A width of -5 was published as the link's width, and a
    maximum of 1e19 made the healthy x16 link pcie.link_narrow. Each is a read error naming the file now."""
    write_pci_device(tmp_path, GPU)
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    assert det.sample().events == []
    write_file(tmp_path, f"sys/bus/pci/devices/{GPU}/{name}", value + "\n")
    s = det.sample()
    assert s.events == [] and f"link_width[{GPU}]" not in s.metrics, (s.events, s.metrics)
    assert any(name in r and "0-63" in r for r in _reasons(s)), _reasons(s)


@pytest.mark.parametrize("state", ["4: AC", "4: DOWN", "1: ACTIVE", "9" * 5000 + ": ACTIVE"])
def test_a_port_state_whose_name_does_not_go_with_its_number_is_a_read_error(tmp_path, state):
    """ib_core prints '<n>: <name>' from a fixed table: '4: AC' (a cut file) read as a port not ACTIVE,
    roce.port_down and a FAILED detector, while its number said ACTIVE. A mismatch is a read error naming the
    file; a port really down ('1: DOWN') still raises roce.port_down."""
    write_rdma_port(tmp_path, netdev=None)
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    assert det.sample().events == []
    write_file(tmp_path, "sys/class/infiniband/mlx5_0/ports/1/state", state + "\n")
    s = det.sample()
    assert s.events == [] and s.state.name == "ERROR", (s.events, s.state)
    assert any("ports/1/state" in r and "ib_core" in r for r in _reasons(s)), _reasons(s)
    write_file(tmp_path, "sys/class/infiniband/mlx5_0/ports/1/state", "1: DOWN\n")
    assert [e.kind for e in det.sample().events] == ["roce.port_down"]


@pytest.mark.parametrize("rel", ["sys/class/thermal/thermal_zone0/temp", "proc/meminfo"])
def test_a_fifo_where_a_file_should_be_is_a_read_error_not_a_stall(tmp_path, rel):
    """A FIFO in place of a sysfs or procfs file (a fake tree, a bind mount gone wrong): opening it waited for a
    writer forever, so ``trainguard detect --root`` and the detector's sample never returned."""
    write_thermal_zone(tmp_path, 0, 45000, {"critical": 105000})
    write_file(tmp_path, "proc/meminfo", MEMINFO.format(avail=30000000))
    path = tmp_path / rel
    path.unlink()
    os.mkfifo(path)
    det = ThermalDetector(ThermalConfig(root=str(tmp_path))) if "thermal" in rel \
        else HostDetector(HostConfig(root=str(tmp_path)))
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(det.sample()), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the reader, so the failing run ends too
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(10)
        pytest.fail(f"sampling with a FIFO at {rel} waited for a writer")
    s = result[0]
    assert s.state.name == "ERROR" and any(rel in r and "not a regular file" in r for r in _reasons(s)), _reasons(s)
