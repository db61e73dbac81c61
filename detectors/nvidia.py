"""NVIDIA GPU and NVLink detectors through NVML (``nvidia-ml-py``, imported only when the detector starts).

``nvidia`` reports per GPU: fallen off the bus (``NVML_ERROR_GPU_IS_LOST``), Xid critical errors (NVML event
set, mapped to actions by the fault facts' ``xid.json``), volatile/aggregate ECC counts, retired pages and remapped rows
(pending, failed), clock throttle reasons, and temperature against the GPU's own slowdown threshold.
``nvlink`` reports link state and the data-link error counters (replay, recovery, CRC) of every NVLink.

Both read through :class:`GpuBackend`; :class:`NvmlBackend` is the real one. Without the library, the driver,
or any GPU, the detectors are in state NO_HARDWARE and say which is missing.

Xids also appear in the kernel log (``kmsg`` detector, source ``kmsg``); a consumer de-duplicating by
``(kind, subject)`` sees both.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from trainguard.detectors.base import Detector, DetectorConfig, Sample, register_detector, state_for
from trainguard.detectors.counters import CounterTracker, RecentCounts
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.rules import check_operator_file
from trainguard.faultfacts.throttle import load_bad_throttle_reasons
from trainguard.faultfacts.xid import load_xid_catalog

log = logging.getLogger(__name__)

#: Throttle reason bits (nvmlClocksEventReason*) that mean trouble, not policy; name -> bit (fault facts'
#: ``throttle.json``).
BAD_THROTTLE_REASONS = load_bad_throttle_reasons()
#: Seconds between two tries to open NVML while it is not there (the driver loads after the agent at boot, or is
#: reloaded for an upgrade); a try costs a library lookup, or an init that may block a while on a sick driver.
NVML_RETRY_S = 60.0


@dataclass(frozen=True)
class NvlinkReading:
    """One NVLink of one GPU.

    Attributes:
        active: the link is up.
        replay: data-link replay errors (``NVML_NVLINK_ERROR_DL_REPLAY``).
        recovery: link recoveries (``NVML_NVLINK_ERROR_DL_RECOVERY``).
        crc_flit: flit CRC errors.
        crc_data: data CRC errors.
    """

    active: bool
    replay: int = 0
    recovery: int = 0
    crc_flit: int = 0
    crc_data: int = 0


@dataclass(frozen=True)
class GpuReading:
    """What NVML says about one GPU; None where the GPU does not support a query.

    Attributes:
        index: NVML index.
        uuid: GPU UUID.
        pci_bus_id: e.g. ``00000000:3B:00.0``.
        name: product name.
        lost: the GPU fell off the bus.
        temperature_c: core temperature.
        slowdown_temp_c: temperature at which the GPU slows down.
        ecc_volatile_corrected: corrected ECC errors since the driver loaded.
        ecc_volatile_uncorrected: uncorrected ECC errors since the driver loaded.
        ecc_aggregate_corrected: corrected ECC errors over the GPU's life.
        ecc_aggregate_uncorrected: uncorrected ECC errors over the GPU's life.
        retired_pages_sbe: pages retired for repeated single-bit errors.
        retired_pages_dbe: pages retired for double-bit errors.
        retired_pending: a page retirement waits for the next reset.
        remapped_correctable: rows remapped for correctable errors.
        remapped_uncorrectable: rows remapped for uncorrectable errors.
        remap_pending: a row remap waits for the next reset.
        remap_failure: a row remap failed (no spare rows).
        throttle_reasons: ``nvmlClocksEventReason`` bitmask.
        nvlinks: link number -> reading, for links the GPU has.
    """

    index: int
    uuid: str = ""
    pci_bus_id: str = ""
    name: str = ""
    lost: bool = False
    temperature_c: float | None = None
    slowdown_temp_c: float | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pending: bool = False
    remapped_correctable: int | None = None
    remapped_uncorrectable: int | None = None
    remap_pending: bool = False
    remap_failure: bool = False
    throttle_reasons: int = 0
    nvlinks: dict[int, NvlinkReading] = field(default_factory=dict)

    @property
    def subject(self) -> str:
        """PCI bus id, or ``gpu<index>`` when unknown."""
        return self.pci_bus_id or f"gpu{self.index}"


class GpuBackend(Protocol):
    """Where GPU readings come from (NVML on a real node)."""

    def device_count(self) -> int:
        """Number of GPUs."""
        ...

    def read(self, index: int, nvlink: bool) -> GpuReading:
        """Reads one GPU (and its NVLinks when ``nvlink``)."""
        ...

    def xid_events(self) -> list[tuple[int, int]]:
        """Pending Xid critical errors as ``(gpu index, xid)``, without blocking."""
        ...

    def close(self) -> None:
        """Releases the library."""
        ...


class NvmlBackend:
    """:class:`GpuBackend` over NVML (``import pynvml`` from nvidia-ml-py)."""

    def __init__(self, xid_events: bool = True) -> None:
        """Initialises NVML.

        Args:
            xid_events: register for Xid critical error events.

        Raises:
            ImportError: nvidia-ml-py is not installed.
            pynvml.NVMLError: no library, no driver, no permission.
        """
        import pynvml

        self._nv = pynvml
        pynvml.nvmlInit()
        # A GPU that cannot be opened (fallen off the bus before the agent started: GPU_IS_LOST; no power cable:
        # INSUFFICIENT_POWER) is kept as a failed handle: it made the whole of NVML "failed to initialise", the
        # detector NO_HARDWARE, and a node with a lost GPU read as one with no GPU at all.
        self._handles: list[Any] = []
        self._open_errors: dict[int, Exception] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            self._handles.append(self._handle_or_none(i))
        self._events: Any = None
        if xid_events and any(h is not None for h in self._handles):
            self._events = pynvml.nvmlEventSetCreate()
            for h in self._handles:
                if h is None:
                    continue
                try:
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._events)
                except pynvml.NVMLError as exc:  # some GPUs (and MIG instances) refuse; Xids still reach kmsg
                    log.info("GPU does not deliver Xid events through NVML: %s", exc)

    def device_count(self) -> int:
        """Number of GPUs."""
        return len(self._handles)

    def _handle_or_none(self, index: int) -> Any:
        try:
            handle = self._nv.nvmlDeviceGetHandleByIndex(index)
        except self._nv.NVMLError as exc:
            self._open_errors[index] = exc
            return None
        self._open_errors.pop(index, None)
        return handle

    def _try(self, fn: Any, *args: Any) -> Any:
        # An optional query the GPU does not support (or fails) leaves its field None; the others still count.
        # A lost GPU is the one failure that ends the whole reading.
        try:
            return fn(*args)
        except self._nv.NVMLError_GpuIsLost:
            raise
        except self._nv.NVMLError as exc:
            if not isinstance(exc, self._nv.NVMLError_NotSupported):
                log.debug("NVML %s failed: %s", getattr(fn, "__name__", fn), exc)
            return None

    def read(self, index: int, nvlink: bool) -> GpuReading:
        """Reads one GPU.

        Args:
            index: NVML index.
            nvlink: also read its NVLinks.

        Returns:
            The reading; ``lost=True`` when the GPU fell off the bus.
        """
        nv = self._nv
        h = self._handles[index]
        if h is None:  # could not be opened so far: asked again (a GPU reset brings a lost one back)
            h = self._handles[index] = self._handle_or_none(index)
            if h is None:
                exc = self._open_errors[index]
                if isinstance(exc, nv.NVMLError_GpuIsLost):
                    return GpuReading(index=index, lost=True)
                raise exc
        try:
            pci = nv.nvmlDeviceGetPciInfo(h).busId
            corr, unc = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            remap = self._try(nv.nvmlDeviceGetRemappedRows, h)
            sbe = self._try(nv.nvmlDeviceGetRetiredPages, h,
                            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
            dbe = self._try(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            links: dict[int, NvlinkReading] = {}
            if nvlink:
                for link in range(nv.NVML_NVLINK_MAX_LINKS):
                    try:
                        active = nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
                    except nv.NVMLError:
                        break  # no more links on this GPU
                    counters = [self._try(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, c) or 0 for c in (
                        nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                        nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, nv.NVML_NVLINK_ERROR_DL_CRC_DATA)]
                    links[link] = NvlinkReading(active, *counters)
            reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            return GpuReading(
                index=index,
                uuid=str(nv.nvmlDeviceGetUUID(h)),
                pci_bus_id=pci.decode() if isinstance(pci, bytes) else str(pci),
                name=str(nv.nvmlDeviceGetName(h)),
                temperature_c=self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                slowdown_temp_c=self._try(nv.nvmlDeviceGetTemperatureThreshold, h,
                                          nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                ecc_volatile_corrected=self._try(nv.nvmlDeviceGetTotalEccErrors, h, corr, nv.NVML_VOLATILE_ECC),
                ecc_volatile_uncorrected=self._try(nv.nvmlDeviceGetTotalEccErrors, h, unc, nv.NVML_VOLATILE_ECC),
                ecc_aggregate_corrected=self._try(nv.nvmlDeviceGetTotalEccErrors, h, corr, nv.NVML_AGGREGATE_ECC),
                ecc_aggregate_uncorrected=self._try(nv.nvmlDeviceGetTotalEccErrors, h, unc, nv.NVML_AGGREGATE_ECC),
                retired_pages_sbe=None if sbe is None else len(sbe),
                retired_pages_dbe=None if dbe is None else len(dbe),
                retired_pending=bool(self._try(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)),
                remapped_correctable=None if remap is None else int(remap[0]),
                remapped_uncorrectable=None if remap is None else int(remap[1]),
                remap_pending=bool(remap and remap[2]),
                remap_failure=bool(remap and remap[3]),
                throttle_reasons=int(self._try(reasons, h) or 0),
                nvlinks=links,
            )
        except nv.NVMLError_GpuIsLost:
            return GpuReading(index=index, lost=True)

    def xid_events(self) -> list[tuple[int, int]]:
        """Pending Xid events, without blocking.

        Raises:
            pynvml.NVMLError: the wait failed (GPU_IS_LOST once a GPU fell off the bus) before any event was read;
                events read before a failure are returned and the failure comes again at the next call.
        """
        if self._events is None:
            return []
        nv = self._nv
        out = []
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                return out
            except nv.NVMLError:
                if out:
                    return out
                raise
            try:
                index = int(nv.nvmlDeviceGetIndex(data.device))
            except nv.NVMLError:
                index = -1
            out.append((index, int(data.eventData)))

    def close(self) -> None:
        """Frees the event set and shuts NVML down."""
        nv = self._nv
        if self._events is not None:
            nv.nvmlEventSetFree(self._events)
            self._events = None
        nv.nvmlShutdown()


def open_nvml(xid_events: bool) -> tuple[GpuBackend | None, str]:
    """Opens NVML if this node has it.

    Args:
        xid_events: register for Xid events.

    Returns:
        ``(backend, "")``, or ``(None, reason)`` when there is no library, no driver or no GPU.
    """
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        backend = NvmlBackend(xid_events)
    except pynvml.NVMLError_LibraryNotFound:
        return None, "no NVIDIA driver (libnvidia-ml.so not found)"
    except pynvml.NVMLError_DriverNotLoaded:
        return None, "the NVIDIA kernel driver is not loaded"
    except pynvml.NVMLError as exc:
        return None, f"NVML failed to initialise: {exc}"
    if backend.device_count() == 0:
        backend.close()
        return None, "NVML reports no GPU"
    return backend, ""


@dataclass
class NvidiaConfig(DetectorConfig):
    """Settings of the NVIDIA GPU detector.

    Attributes:
        interval_s: seconds between samples. Default 10.0 (about 15 NVML queries per GPU; Xids reach the ``kmsg``
            detector within a second anyway).
        xid_events: read Xid errors from NVML events. Default True.
        xid_file: an operator Xid catalog replacing the shipped ``xid.json``; empty for the shipped one.
        temp_margin_c: report when within this many degrees Celsius of the slowdown threshold. Default 5.0.
        temp_hysteresis_c: a reported temperature ends once this many degrees Celsius below where it started, so
            a GPU held at that point does not raise and clear it every sample. Default 2.0.
        ecc_corrected_per_hour: corrected volatile ECC errors within the last hour (or since the detector started,
            when shorter) above which a GPU is reported. Default 1000.
    """

    interval_s: float = 10.0
    xid_events: bool = True
    xid_file: str = ""
    temp_margin_c: float = 5.0
    temp_hysteresis_c: float = 2.0
    ecc_corrected_per_hour: float = 1000.0

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range, or the operator's Xid file is unreadable or invalid.
        """
        super().validate()
        if self.temp_margin_c < 0 or self.temp_hysteresis_c < 0 or self.ecc_corrected_per_hour < 0:
            raise DetectorConfigError("nvidia: temp_margin_c, temp_hysteresis_c and ecc_corrected_per_hour must be "
                                      ">= 0")
        check_operator_file("nvidia.xid_file", self.xid_file, load_xid_catalog)


class _NvmlDetector(Detector):
    """Shared backend handling of the NVML detectors."""

    def __init__(self, config: DetectorConfig | None = None, backend: GpuBackend | None = None) -> None:
        super().__init__(config)
        self._backend = backend
        self._absent = ""
        self._absent_at = 0.0
        self._counters = CounterTracker()

    def _open(self, xid_events: bool) -> GpuBackend | None:
        # Tried again while absent: opened once at the agent's start, a driver that loaded a minute later (boot
        # order, a driver upgrade) left the node's GPUs unwatched, NO_HARDWARE until the agent restarted.
        if self._backend is None and (not self._absent or time.monotonic() - self._absent_at >= NVML_RETRY_S):
            self._backend, self._absent = open_nvml(xid_events)
            self._absent_at = time.monotonic()
        return self._backend

    def close(self) -> None:
        """Shuts NVML down."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def _read_all(self, s: Sample, backend: GpuBackend, nvlink: bool) -> list[GpuReading]:
        out = []
        for i in range(backend.device_count()):
            try:
                out.append(backend.read(i, nvlink))
            except Exception as exc:  # noqa: BLE001 - one GPU failing a query must not hide the others
                s.error(DetectorReadError(f"nvml:gpu{i}", f"{type(exc).__name__}: {exc}"))
        return out


@register_detector
class NvidiaDetector(_NvmlDetector):
    """NVIDIA GPU health through NVML."""

    name: ClassVar[str] = "nvidia"
    config_class: ClassVar[type[DetectorConfig]] = NvidiaConfig
    default_interval_s: ClassVar[float] = 10.0

    def __init__(self, config: NvidiaConfig | None = None, backend: GpuBackend | None = None) -> None:
        """Creates the detector; NVML is opened on the first sample.

        Args:
            config: settings.
            backend: GPU readings; NVML when None.
        """
        super().__init__(config, backend)
        self.config: NvidiaConfig
        self._uuids: dict[int, str] = {}
        self._ecc_recent = RecentCounts(3600.0)
        self.xids, self.xid_default = load_xid_catalog(self.config.xid_file or None)

    def sample(self) -> Sample:
        """Reads every GPU once and drains pending Xid events.

        Returns:
            Per-GPU metrics and events.
        """
        backend = self._open(self.config.xid_events)
        if backend is None:
            return self.no_hardware(self._absent)
        s = Sample()
        readings = self._read_all(s, backend, nvlink=False)
        by_index = {r.index: r for r in readings}
        for r in readings:
            self._check(s, r)
        try:
            xids = backend.xid_events()
        except Exception as exc:  # noqa: BLE001 - GPU_IS_LOST once a GPU fell off the bus (documented return)
            # It raised out of the sample: the readings' events (gpu.lost itself) were dropped, and their
            # conditions, already active, never sent again.
            s.error(DetectorReadError("nvml:events", f"cannot read Xid events: {type(exc).__name__}: {exc}"))
            xids = []
        for index, xid in xids:
            entry = self.xids.get(xid, self.xid_default)
            gpu = by_index.get(index)
            subject = gpu.subject if gpu else f"gpu{index}"
            # one_off: drained from NVML's event set, it is not read again (see Detector.one_off)
            self.one_off(s, self.event("gpu.xid", entry.severity, entry.action,
                                       f"GPU {subject} reported Xid {xid} ({entry.name}; NVIDIA: "
                                       f"{entry.nvidia_action})", subject,
                                       {"xid": xid, "xid_name": entry.name, "nvidia_action": entry.nvidia_action,
                                        "description": entry.description}))
        for ev in s.events:
            # One-off events (an uncorrectable ECC error, an Xid) set the state of the sample that raised them, as
            # conditions do: a new double-bit error left the detector OK, and trainguard detect exited 0 on it.
            if not ev.kind.endswith(".cleared"):
                s.worsen(state_for(ev.severity), ev.message)
        s.metrics["gpus"] = float(len(readings))
        s.metrics["gpus_lost"] = float(sum(r.lost for r in readings))
        temps = [r.temperature_c for r in readings if r.temperature_c is not None]
        if temps:
            s.metrics["max_temp_c"] = float(max(temps))
        s.metrics["ecc_volatile_uncorrected_total"] = float(sum(r.ecc_volatile_uncorrected or 0 for r in readings))
        s.metrics["ecc_volatile_corrected_total"] = float(sum(r.ecc_volatile_corrected or 0 for r in readings))
        return s

    def _check(self, s: Sample, r: GpuReading) -> None:
        g = r.subject
        self.condition(s, f"lost/{r.index}", r.lost, "gpu.lost", Severity.CRITICAL, Action.DRAIN_NODE,
                       f"GPU {g} has fallen off the bus", g, {"index": r.index})
        if r.lost:
            # It comes back only through a GPU reset or a driver reload, which zero its volatile ECC counts: counted
            # from zero, its errors at the first reading after are new. Compared with the counts from before the
            # loss, as many new uncorrectable errors as it had then went unreported.
            uuid = self._uuids.get(r.index)
            if uuid is not None:
                self._counters.update(f"{uuid}/ecc_unc", 0)
                self._counters.update(f"{uuid}/ecc_cor", 0)
            return
        self._uuids[r.index] = r.uuid
        ident = {"index": r.index, "uuid": r.uuid, "name": r.name}
        if r.temperature_c is not None:
            s.metrics[f"temp_c[{g}]"] = float(r.temperature_c)
            hot = False
            if r.slowdown_temp_c is not None:
                limit = r.slowdown_temp_c - self.config.temp_margin_c
                if f"temp/{r.index}" in self._active:  # holds until clearly below: no event per crossing
                    limit -= self.config.temp_hysteresis_c
                    hot = r.temperature_c > limit
                else:
                    hot = r.temperature_c >= limit
            self.condition(s, f"temp/{r.index}", hot, "gpu.temp_high", Severity.WARNING, Action.WATCH,
                           f"GPU {g} at {r.temperature_c} C, slowdown at {r.slowdown_temp_c} C", g,
                           {**ident, "temp_c": r.temperature_c, "slowdown_c": r.slowdown_temp_c})
        if r.ecc_volatile_uncorrected is not None:
            s.metrics[f"ecc_volatile_uncorrected[{g}]"] = float(r.ecc_volatile_uncorrected)
            d = self._counters.update(f"{r.uuid}/ecc_unc", r.ecc_volatile_uncorrected)
            if not d.first and d.delta > 0:
                # one_off: the counter moved past these errors already (see Detector.one_off)
                self.one_off(s, self.event("gpu.ecc_uncorrected", Severity.CRITICAL, Action.DRAIN_NODE,
                                           f"GPU {g}: {d.delta} new uncorrectable ECC error(s)", g,
                                           {**ident, "volatile": r.ecc_volatile_uncorrected,
                                            "aggregate": r.ecc_aggregate_uncorrected}))
        if r.ecc_volatile_corrected is not None:
            s.metrics[f"ecc_volatile_corrected[{g}]"] = float(r.ecc_volatile_corrected)
            d = self._counters.update(f"{r.uuid}/ecc_cor", r.ecc_volatile_corrected)
            # Counted over the last hour: one interval's rate scaled to an hour made 3 corrected errors within
            # 10 s "1080/hour", a warning raised and cleared by every small burst.
            last_hour = self._ecc_recent.add(r.uuid, 0 if d.first else d.delta)
            self.condition(s, f"ecc_cor/{r.index}", last_hour > self.config.ecc_corrected_per_hour,
                           "gpu.ecc_corrected_rate", Severity.WARNING, Action.WATCH,
                           f"GPU {g}: {last_hour} corrected ECC errors in {self._ecc_recent.span_text()}, over "
                           f"{self.config.ecc_corrected_per_hour:g}/hour", g,
                           {**ident, "volatile": r.ecc_volatile_corrected, "aggregate": r.ecc_aggregate_corrected,
                            "last_hour": last_hour})
        if r.remapped_uncorrectable is not None:
            s.metrics[f"remapped_rows_uncorrectable[{g}]"] = float(r.remapped_uncorrectable)
            s.metrics[f"remapped_rows_correctable[{g}]"] = float(r.remapped_correctable or 0)
        rows = {**ident, "remapped_correctable": r.remapped_correctable,
                "remapped_uncorrectable": r.remapped_uncorrectable, "retired_sbe": r.retired_pages_sbe,
                "retired_dbe": r.retired_pages_dbe}
        self.condition(s, f"remap_fail/{r.index}", r.remap_failure, "gpu.row_remap_failed", Severity.CRITICAL,
                       Action.DRAIN_NODE, f"GPU {g}: row remapping failed (no spare rows left)", g, rows)
        self.condition(s, f"pending/{r.index}", r.remap_pending or r.retired_pending, "gpu.memory_repair_pending",
                       Severity.WARNING, Action.CHECKPOINT_NOW,
                       f"GPU {g}: a row remap or page retirement waits for a GPU reset", g, rows)
        bad = {name for name, bit in BAD_THROTTLE_REASONS.items() if r.throttle_reasons & bit}
        s.metrics[f"throttle_reasons[{g}]"] = float(r.throttle_reasons)
        self.condition(s, f"throttle/{r.index}", bool(bad), "gpu.throttled", Severity.WARNING, Action.WATCH,
                       f"GPU {g} clocks are throttled: {', '.join(sorted(bad))}", g,
                       {**ident, "reasons": f"0x{r.throttle_reasons:x}"})


@dataclass
class NvlinkConfig(DetectorConfig):
    """Settings of the NVLink detector.

    Attributes:
        interval_s: seconds between samples. Default 30.0 (up to 18 links x 5 queries per GPU).
        replay_per_s: replay errors per second per link above which it is reported. Default 10.0.
        crc_per_s: CRC (flit + data) errors per second per link above which it is reported. Default 10.0.
    """

    interval_s: float = 30.0
    replay_per_s: float = 10.0
    crc_per_s: float = 10.0


@register_detector
class NvlinkDetector(_NvmlDetector):
    """NVLink state and error counters through NVML."""

    name: ClassVar[str] = "nvlink"
    config_class: ClassVar[type[DetectorConfig]] = NvlinkConfig
    default_interval_s: ClassVar[float] = 30.0

    def __init__(self, config: NvlinkConfig | None = None, backend: GpuBackend | None = None) -> None:
        """Creates the detector; NVML is opened on the first sample.

        Args:
            config: settings.
            backend: GPU readings; NVML when None.
        """
        super().__init__(config, backend)
        self._seen: set[str] = set()

    def sample(self) -> Sample:
        """Reads every link of every GPU once.

        Returns:
            Per-link metrics and events.
        """
        self.config: NvlinkConfig
        backend = self._open(False)
        if backend is None:
            return self.no_hardware(self._absent)
        s = Sample()
        readings = self._read_all(s, backend, nvlink=True)
        total = active = 0
        for r in readings:
            for link, nl in sorted(r.nvlinks.items()):
                total += 1
                active += nl.active
                subject = f"{r.subject}/link{link}"
                s.metrics[f"active[{subject}]"] = float(nl.active)
                # A link that never came up is how the board is built; one that was up and went down is a fault.
                was_seen = subject in self._seen
                if nl.active:
                    self._seen.add(subject)
                self.condition(s, f"down/{subject}", was_seen and not nl.active, "nvlink.link_down",
                               Severity.ERROR, Action.DRAIN_NODE, f"NVLink {subject} went inactive", subject)
                for name, value, limit, kind in (
                    ("replay", nl.replay, self.config.replay_per_s, "nvlink.replay_errors"),
                    ("recovery", nl.recovery, 0.0, "nvlink.recoveries"),
                    ("crc", nl.crc_flit + nl.crc_data, self.config.crc_per_s, "nvlink.crc_errors"),
                ):
                    d = self._counters.update(f"{subject}/{name}", value)
                    s.metrics[f"{name}_per_s[{subject}]"] = d.rate
                    measured = d.delta if name == "recovery" else d.rate
                    self.condition(s, f"{name}/{subject}", not d.first and measured > limit, kind, Severity.WARNING,
                                   Action.WATCH, f"NVLink {subject}: {name} errors rising ({measured:.3g})", subject,
                                   {"counter": name, "value": value, "delta": d.delta})
        if total == 0:
            return self.no_hardware("the GPUs report no NVLink")
        s.metrics.update({"links": float(total), "links_active": float(active)})
        return s
