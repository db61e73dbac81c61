"""NVIDIA (NVML through a GpuBackend double) and Ascend (a real npu-smi-format script) detectors."""

from __future__ import annotations

import stat
from dataclasses import replace

import pytest

from trainguard.detectors.ascend import AscendConfig, AscendDetector, parse_npu_smi_info
from trainguard.detectors.base import DetectorState
from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.nvidia import (
    GpuReading,
    NvidiaConfig,
    NvidiaDetector,
    NvlinkConfig,
    NvlinkDetector,
    NvlinkReading,
    open_nvml,
)
from trainguard.detectors.runner import DetectorRunner
from trainguard.testing.nvml import GpuBackendDouble


def healthy(index: int, pci: str) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{index}", pci_bus_id=pci, name="NVIDIA H100 80GB HBM3",
                      temperature_c=45, slowdown_temp_c=90, ecc_volatile_corrected=0, ecc_volatile_uncorrected=0,
                      ecc_aggregate_corrected=10, ecc_aggregate_uncorrected=0, retired_pages_sbe=0,
                      retired_pages_dbe=0, remapped_correctable=0, remapped_uncorrectable=0, throttle_reasons=0x1,
                      nvlinks={i: NvlinkReading(True) for i in range(4)})


def test_nvml_absent_here_is_no_hardware() -> None:
    backend, reason = open_nvml(xid_events=True)
    if backend is not None:
        backend.close()
        pytest.skip("this machine has an NVIDIA GPU")
    assert reason  # e.g. "no NVIDIA driver (libnvidia-ml.so not found)" or "nvidia-ml-py ... not installed"
    s = NvidiaDetector().sample()
    assert s.state == DetectorState.NO_HARDWARE and s.detail == reason
    assert NvlinkDetector().sample().state == DetectorState.NO_HARDWARE


def test_nvml_that_comes_after_the_start_is_opened_then(monkeypatch) -> None:
    """At boot the agent can start before the NVIDIA driver loads (or the driver is reloaded for an upgrade).
    NVML was tried once: the GPUs stayed unwatched, NO_HARDWARE, until the agent restarted. It is tried again
    (every NVML_RETRY_S; 0 here); the opener is the leaf replaced here, the detector runs as on a node."""
    import trainguard.detectors.nvidia as nvidia

    tries = []
    double = GpuBackendDouble([healthy(0, "00000000:3B:00.0")])

    def opener(xid_events: bool):
        tries.append(xid_events)
        return (double, "") if len(tries) >= 3 else (None, "the NVIDIA kernel driver is not loaded")

    monkeypatch.setattr(nvidia, "open_nvml", opener)
    monkeypatch.setattr(nvidia, "NVML_RETRY_S", 0.0, raising=False)
    det = NvidiaDetector(NvidiaConfig())
    for _ in range(2):
        s = det.sample()
        assert s.state == DetectorState.NO_HARDWARE and "not loaded" in s.detail
    double.readings[0] = GpuReading(index=0, lost=True)
    s = det.sample()
    assert [e.kind for e in s.events] == ["gpu.lost"] and s.state == DetectorState.FAILED
    det.sample()
    assert len(tries) == 3  # open: no more tries


def test_a_gpu_that_cannot_be_opened_does_not_hide_the_others(monkeypatch) -> None:
    """nvmlDeviceGetHandleByIndex fails for a GPU that fell off the bus before the agent started (GPU_IS_LOST)
    or has no power cable (INSUFFICIENT_POWER). Either made all of NVML "failed to initialise": NO_HARDWARE, a
    node with a lost GPU read as one without GPUs. Only the NVML library's entry points are replaced here."""
    pynvml = pytest.importorskip("pynvml")
    lost = {1}

    def handle(i: int):
        if i in lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_POWER)

    for name, fn in (("nvmlInit", lambda: None), ("nvmlShutdown", lambda: None), ("nvmlDeviceGetCount", lambda: 2),
                     ("nvmlDeviceGetHandleByIndex", handle)):
        monkeypatch.setattr(pynvml, name, fn)
    backend, reason = open_nvml(xid_events=True)
    assert backend is not None, reason
    assert backend.device_count() == 2 and backend.read(1, False).lost
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("gpu.lost", "gpu1")]
    assert [e.path for e in s.errors] == ["nvml:gpu0"] and "Insufficient" in s.errors[0].reason
    assert s.state == DetectorState.FAILED


def test_gpu_faults_become_events() -> None:
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0"), healthy(1, "00000000:5E:00.0")])
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.OK and s.metrics["gpus"] == 2.0
    backend.readings[0] = replace(backend.readings[0], ecc_volatile_uncorrected=2, remap_pending=True,
                                  throttle_reasons=0x40 | 0x8, temperature_c=88)
    backend.readings[1] = GpuReading(index=1, lost=True)
    backend.xids = [(0, 79), (0, 13), (1, 12345)]
    s = det.sample()
    got = sorted((e.kind, e.subject, e.severity, e.action) for e in s.events)
    assert got == sorted([
        ("gpu.ecc_uncorrected", "00000000:3B:00.0", Severity.CRITICAL, Action.DRAIN_NODE),
        ("gpu.memory_repair_pending", "00000000:3B:00.0", Severity.WARNING, Action.CHECKPOINT_NOW),
        ("gpu.throttled", "00000000:3B:00.0", Severity.WARNING, Action.WATCH),
        ("gpu.temp_high", "00000000:3B:00.0", Severity.WARNING, Action.WATCH),
        ("gpu.lost", "gpu1", Severity.CRITICAL, Action.DRAIN_NODE),
        ("gpu.xid", "00000000:3B:00.0", Severity.CRITICAL, Action.DRAIN_NODE),
        ("gpu.xid", "00000000:3B:00.0", Severity.ERROR, Action.RESTART_PROCESS),
        ("gpu.xid", "gpu1", Severity.WARNING, Action.WATCH),
    ])
    throttled = next(e for e in s.events if e.kind == "gpu.throttled")
    assert "HwSlowdown" in throttled.message and "HwThermalSlowdown" in throttled.message
    assert s.state == DetectorState.FAILED and s.metrics["gpus_lost"] == 1.0
    assert det.sample().events == []  # conditions are edge-triggered
    det.close()
    assert backend.closed


def test_an_uncorrectable_ecc_error_or_an_xid_sets_the_detector_state() -> None:
    """A new uncorrectable ECC error (CRITICAL, drain-node) or an Xid was an event in a sample whose state read OK:
    trainguard detect, a node health probe, printed the event and exited 0."""
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0")])
    runner = DetectorRunner([NvidiaDetector(NvidiaConfig(), backend=backend)])
    runner.run_once()
    assert runner.statuses()[0].state == DetectorState.OK
    backend.readings[0] = replace(backend.readings[0], ecc_volatile_uncorrected=1)
    assert [e.kind for e in runner.run_once()] == ["gpu.ecc_uncorrected"]
    status = runner.statuses()[0]
    assert status.state == DetectorState.FAILED and "uncorrectable ECC" in status.detail
    backend.xids = [(0, 12345)]  # not in the catalog: a warning
    runner.run_once()
    assert runner.statuses()[0].state == DetectorState.DEGRADED
    runner.run_once()
    assert runner.statuses()[0].state == DetectorState.OK  # one-off events: the next sample is clean


def test_a_gpu_back_on_the_bus_clears_the_loss_it_was_reported_under() -> None:
    """NVML names a lost GPU by its index only ("gpu1"), one that answers by its PCI address: gpu.lost.cleared came
    under another subject than gpu.lost, so whoever paired them by kind and subject never saw the GPU back."""
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0"), healthy(1, "00000000:5E:00.0")])
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    det.sample()
    backend.readings[1] = GpuReading(index=1, lost=True)
    assert [(e.kind, e.subject) for e in det.sample().events] == [("gpu.lost", "gpu1")]
    backend.readings[1] = healthy(1, "00000000:5E:00.0")
    assert [(e.kind, e.subject) for e in det.sample().events] == [("gpu.lost.cleared", "gpu1")]


def test_a_few_corrected_ecc_errors_are_no_rate_over_the_hourly_threshold() -> None:
    """``ecc_corrected_per_hour`` counts the corrected errors of the last hour. It scaled one interval's rate: 3
    corrected errors between two samples 10 s apart read as 1080/hour, over the default 1000, so every small
    burst raised and cleared a warning. 1000 in the hour stay quiet; the 1001st raises it once, and it holds."""
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0")])
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    assert det.sample().events == []
    for ce in (3, 1000):
        backend.readings[0] = replace(backend.readings[0], ecc_volatile_corrected=ce)
        s = det.sample()
        assert s.events == [] and s.state == DetectorState.OK, [e.message for e in s.events]
    backend.readings[0] = replace(backend.readings[0], ecc_volatile_corrected=1001)
    s = det.sample()
    assert [e.kind for e in s.events] == ["gpu.ecc_corrected_rate"]
    assert "1001 corrected ECC errors in the last" in s.events[0].message
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.DEGRADED


def test_a_gpu_held_near_its_slowdown_temperature_raises_one_event() -> None:
    """A loaded GPU hovering at its reporting point (slowdown 90 C - margin 5) raised gpu.temp_high and its .cleared
    on every crossing; it ends once 2 C below, and a later rise is a new event."""
    backend = GpuBackendDouble([replace(healthy(0, "00000000:3B:00.0"), slowdown_temp_c=90)])
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    kinds = []
    for temp in (85, 84, 85, 83.5, 82.9, 85):
        backend.readings[0] = replace(backend.readings[0], temperature_c=temp)
        kinds.append([e.kind for e in det.sample().events])
    assert kinds == [["gpu.temp_high"], [], [], [], ["gpu.temp_high.cleared"], ["gpu.temp_high"]]


def test_a_gpu_back_from_the_lost_counts_its_ecc_errors_from_zero() -> None:
    """A GPU that fell off the bus comes back through a reset, which zeroes its volatile ECC counts. It had two
    uncorrectable errors before; back with two new ones, the count read the same (2) and they went unreported."""
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0")])
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    det.sample()
    backend.readings[0] = replace(backend.readings[0], ecc_volatile_uncorrected=2)
    assert [e.kind for e in det.sample().events] == ["gpu.ecc_uncorrected"]
    backend.readings[0] = GpuReading(index=0, lost=True)
    assert [e.kind for e in det.sample().events] == ["gpu.lost"]
    backend.readings[0] = replace(healthy(0, "00000000:3B:00.0"), ecc_volatile_uncorrected=2)
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["gpu.ecc_uncorrected", "gpu.lost.cleared"]
    ecc = next(e for e in s.events if e.kind == "gpu.ecc_uncorrected")
    assert ecc.message.endswith("2 new uncorrectable ECC error(s)")


def test_remap_failure_and_query_errors() -> None:
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0"), healthy(1, "00000000:5E:00.0")])
    backend.readings[0] = replace(backend.readings[0], remap_failure=True)
    backend.fail = {1}
    events = []
    runner = DetectorRunner([NvidiaDetector(NvidiaConfig(), backend=backend)], on_event=events.append)
    runner.run_once()
    kinds = sorted(e.kind for e in events)
    assert kinds == ["detector.error", "gpu.row_remap_failed"]
    assert runner.statuses()[0].state == DetectorState.FAILED


def test_nvlink_errors_and_link_down() -> None:
    backend = GpuBackendDouble([healthy(0, "00000000:3B:00.0")])
    det = NvlinkDetector(NvlinkConfig(), backend=backend)
    s = det.sample()
    assert s.events == [] and s.metrics["links"] == 4.0 and s.metrics["links_active"] == 4.0
    links = dict(backend.readings[0].nvlinks)
    links[2] = NvlinkReading(False)
    links[1] = NvlinkReading(True, replay=0, recovery=3, crc_flit=10**6, crc_data=0)
    backend.readings[0] = replace(backend.readings[0], nvlinks=links)
    s = det.sample()
    assert sorted((e.kind, e.subject) for e in s.events) == [
        ("nvlink.crc_errors", "00000000:3B:00.0/link1"),
        ("nvlink.link_down", "00000000:3B:00.0/link2"),
        ("nvlink.recoveries", "00000000:3B:00.0/link1"),
    ]


NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.0                   Version: 24.1.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | {health}      | NA          {temp}                0    / 0             |
| 0                         | 0000:C2:00.0  | 12          0    / 0          2858 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
"""


def fake_npu_smi(tmp_path, output: str, code: int = 0) -> str:
    (tmp_path / "out.txt").write_text(output)
    script = tmp_path / "npu-smi"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = info ] || exit 3\ncat {tmp_path / 'out.txt'}\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_ascend_health_from_npu_smi(tmp_path) -> None:
    exe = fake_npu_smi(tmp_path, NPU_SMI.format(health="OK     ", temp=41))
    det = AscendDetector(AscendConfig(npu_smi=exe))
    s = det.sample()
    assert s.events == [] and s.metrics["npus"] == 2.0 and s.metrics["temp_c[0000:C2:00.0]"] == 41.0
    assert "power_w[0000:C2:00.0]" not in s.metrics and s.metrics["power_w[0000:C1:00.0]"] == 93.6
    fake_npu_smi(tmp_path, NPU_SMI.format(health="Critical", temp=95))
    s = det.sample()
    assert [(e.kind, e.subject, e.action) for e in s.events] == [
        ("npu.health_critical", "0000:C2:00.0", Action.DRAIN_NODE)]
    assert s.state == DetectorState.FAILED


def test_ascend_absent_failing_and_truncated(tmp_path) -> None:
    s = AscendDetector(AscendConfig(npu_smi=str(tmp_path / "no-such-npu-smi"))).sample()
    assert s.state == DetectorState.NO_HARDWARE and "not installed" in s.detail
    exe = fake_npu_smi(tmp_path, "dcmi module initialize failed. ret is -8005\n", code=1)
    s = AscendDetector(AscendConfig(npu_smi=exe)).sample()
    assert s.state == DetectorState.ERROR and "exit code 1" in s.detail
    truncated = NPU_SMI.format(health="OK", temp=40).splitlines()[:7]
    with pytest.raises(DetectorReadError, match="truncated"):
        parse_npu_smi_info("\n".join(truncated))
    with pytest.raises(DetectorReadError, match="header"):
        parse_npu_smi_info("command not found")


def test_nvml_backend_uses_only_names_the_installed_bindings_have() -> None:
    """Without a GPU here, at least hold the NVML adapter to the real nvidia-ml-py API names."""
    import re

    pynvml = pytest.importorskip("pynvml")
    import trainguard.detectors.nvidia as nvidia

    with open(nvidia.__file__, encoding="utf-8") as f:
        source = f.read()
    used = set(re.findall(r"\bnv\.(\w+)", source)) | set(re.findall(r"pynvml\.(\w+)", source))
    optional = {"nvmlDeviceGetCurrentClocksEventReasons"}  # looked up with getattr, with a fallback
    missing = sorted(n for n in used - optional if not hasattr(pynvml, n))
    assert not missing, f"names not in nvidia-ml-py {getattr(pynvml, '__version__', '')}: {missing}"
    assert len(used) > 25


def test_a_gpu_lost_while_its_xid_events_are_drained_is_still_reported(monkeypatch) -> None:
    """nvmlEventSetWait fails with GPU_IS_LOST once a GPU fell off the bus (its documented return): the error
    raised out of the sample after the readings, so the gpu.lost event of that very sample was dropped, and the
    condition, already marked active, was never sent again: the drain never left the node. Only the NVML
    library's entry points are replaced here."""
    pynvml = pytest.importorskip("pynvml")
    state = {"lost": False}

    class Pci:
        busId = b"00000000:3B:00.0"

    def pci_info(h):
        if state["lost"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return Pci()

    def wait(events, timeout_ms):
        if state.get("xid"):
            return type("Data", (), {"device": object(), "eventData": state.pop("xid")})()
        if state["lost"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def unsupported(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    for name, fn in (("nvmlInit", lambda: None), ("nvmlShutdown", lambda: None), ("nvmlDeviceGetCount", lambda: 1),
                     ("nvmlDeviceGetHandleByIndex", lambda i: object()), ("nvmlEventSetCreate", lambda: object()),
                     ("nvmlDeviceRegisterEvents", lambda h, t, e: None), ("nvmlEventSetFree", lambda e: None),
                     ("nvmlEventSetWait_v2", wait), ("nvmlDeviceGetPciInfo", pci_info),
                     ("nvmlDeviceGetUUID", lambda h: "GPU-0"), ("nvmlDeviceGetName", lambda h: "H100"),
                     ("nvmlDeviceGetIndex", lambda d: 0)):
        monkeypatch.setattr(pynvml, name, fn)
    for name in ("nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages", "nvmlDeviceGetTemperature",
                 "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetTotalEccErrors",
                 "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetCurrentClocksThrottleReasons"):
        monkeypatch.setattr(pynvml, name, unsupported, raising=False)
    backend, reason = open_nvml(xid_events=True)
    assert backend is not None, reason
    det = NvidiaDetector(NvidiaConfig(), backend=backend)
    assert det.sample().events == []
    state["lost"], state["xid"] = True, 79  # the Xid that said so is read before the wait fails
    s = det.sample()
    assert [(e.kind, e.subject, e.evidence.get("xid")) for e in s.events] == [("gpu.lost", "gpu0", None),
                                                                              ("gpu.xid", "gpu0", "79")]
    assert not s.errors  # the failure comes again at the next wait
    det = NvidiaDetector(NvidiaConfig(), backend=backend)  # an agent started after the loss: no Xid left to read
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("gpu.lost", "gpu0")]
    assert [e.path for e in s.errors] == ["nvml:events"] and "GPU is lost" in s.errors[0].reason
    assert s.state == DetectorState.FAILED and s.metrics["gpus_lost"] == 1.0
    det.close()


def test_npu_smi_output_that_is_no_utf8_is_still_read(tmp_path) -> None:
    """A byte that is no UTF-8 in npu-smi's output (a garbled product name, a locale's encoding) raised
    UnicodeDecodeError out of the whole sample: no chip's health was judged. The health columns are ASCII."""
    exe = fake_npu_smi(tmp_path, "")
    text = NPU_SMI.format(health="Critical", temp=95).replace("910B3 ", "910B\xff", 1)
    (tmp_path / "out.txt").write_bytes(text.encode("latin-1"))
    s = AscendDetector(AscendConfig(npu_smi=exe)).sample()
    assert s.errors == [] and s.metrics["npus"] == 2.0
    assert [(e.kind, e.subject) for e in s.events] == [("npu.health_critical", "0000:C2:00.0")]


def test_an_npu_health_npu_smi_does_not_print_is_a_read_error(tmp_path) -> None:
    """npu-smi's Health is OK, Warning, Alarm or Critical. A garbled or cut cell ('Crit', bytes that are no
    UTF-8) read as healthy 0 in the metric with no event and the detector OK; it is a read error naming the
    chip now, with no healthy metric, and the other chip is judged as before."""
    exe = fake_npu_smi(tmp_path, NPU_SMI.format(health="OK     ", temp=41))
    det = AscendDetector(AscendConfig(npu_smi=exe))
    assert det.sample().events == []
    fake_npu_smi(tmp_path, NPU_SMI.format(health="Crit   ", temp=41))
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.ERROR, (s.events, s.state)
    assert "healthy[0000:C2:00.0]" not in s.metrics and s.metrics["healthy[0000:C1:00.0]"] == 1.0
    assert "0000:C2:00.0" in s.detail and "'Crit'" in s.detail, s.detail
    assert s.metrics["npus_unhealthy"] == 0.0
    fake_npu_smi(tmp_path, NPU_SMI.format(health="Alarm  ", temp=41))
    assert [e.kind for e in det.sample().events] == ["npu.health_alarm"]
