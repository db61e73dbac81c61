"""A stand-in for NVML behind the NVIDIA detector's backend seam, for machines without an NVIDIA driver.

:class:`~trainguard.detectors.nvidia.NvidiaDetector` reads GPUs through a small backend (``device_count``,
``read``, ``xid_events``, ``close``); NVML itself is a leaf library, so a test or a drill gives the real detector
this backend and sets readings and pending Xids itself.
"""

from __future__ import annotations

from dataclasses import replace

from trainguard.detectors.nvidia import GpuReading


class GpuBackendDouble:
    """NVML as the detector sees it; readings, Xids and failures are set by the caller.

    Attributes:
        readings: one :class:`GpuReading` per device, by index.
        xids: pending ``(device index, xid)`` events, drained by the next :meth:`xid_events`.
        fail: device indexes whose :meth:`read` raises (NVML's "Unknown Error").
        closed: whether :meth:`close` was called.
    """

    def __init__(self, readings: list[GpuReading]) -> None:
        self.readings = readings
        self.xids: list[tuple[int, int]] = []
        self.fail: set[int] = set()
        self.closed = False

    def device_count(self) -> int:
        """Number of devices."""
        return len(self.readings)

    def read(self, index: int, nvlink: bool) -> GpuReading:
        """The reading of device ``index`` (NVLink states only when ``nvlink``).

        Raises:
            RuntimeError: ``index`` is in :attr:`fail`.
        """
        if index in self.fail:
            raise RuntimeError("NVML Unknown Error")
        r = self.readings[index]
        return r if nvlink else replace(r, nvlinks={})

    def xid_events(self) -> list[tuple[int, int]]:
        """The pending Xids, once."""
        out, self.xids = self.xids, []
        return out

    def close(self) -> None:
        """Marks the backend closed."""
        self.closed = True


__all__ = ["GpuBackendDouble"]
