"""EDAC memory error detector: correctable error rate and any uncorrectable error, from sysfs.

Layout (Documentation/ABI/testing/sysfs-devices-edac)::

    /sys/devices/system/edac/mc/mc<N>/ce_count, ue_count, ce_noinfo_count, ue_noinfo_count, mc_name
    /sys/devices/system/edac/mc/mc<N>/dimm<M>/dimm_ce_count, dimm_ue_count, dimm_label     (newer drivers)
    /sys/devices/system/edac/mc/mc<N>/rank<M>/dimm_ce_count, dimm_ue_count, dimm_label     (some drivers)

Any increase of an uncorrectable count is critical (the kernel may already have killed a process or panicked),
and so is a controller's count above zero at its first reading, raised once and said to be from before the start
(EDAC counters start at zero at boot);
correctable errors are reported when more than ``ce_per_hour`` of them arrived at one controller within the
last hour (counted, not extrapolated from one sampling interval), since a rising correctable rate often precedes
uncorrectable errors on the same DIMM.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import ClassVar

from trainguard.detectors.base import Detector, DetectorConfig, DetectorState, Sample, register_detector
from trainguard.detectors.counters import CounterTracker, RecentCounts
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.sysfs import list_dir, list_dir_or_record, read_count, read_text, removed_while_read

#: Width of the EDAC error counters: u32 in the kernel (``mci->ce_mc``, ``dimm->ce_count``...), printed with ``%u``.
_EDAC_BITS = 32

#: Span over which correctable errors are counted against ``ce_per_hour``, seconds.
CE_WINDOW_S = 3600.0


@dataclass
class EdacConfig(DetectorConfig):
    """Settings of the EDAC detector.

    Attributes:
        interval_s: seconds between samples. Default 30.0.
        ce_per_hour: correctable errors within the last hour at one memory controller above which it is reported
            (counted over the hour, or over the time since the detector started when that is shorter).
            Default 100.
    """

    interval_s: float = 30.0
    ce_per_hour: float = 100.0

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range.
        """
        super().validate()
        if self.ce_per_hour < 0:
            raise DetectorConfigError(f"edac.ce_per_hour={self.ce_per_hour} must be >= 0")


@register_detector
class EdacDetector(Detector):
    """Reads EDAC memory controller counters."""

    name: ClassVar[str] = "edac"
    config_class: ClassVar[type[DetectorConfig]] = EdacConfig
    default_interval_s: ClassVar[float] = 30.0

    def __init__(self, config: EdacConfig | None = None) -> None:
        """Creates the detector.

        Args:
            config: settings.
        """
        super().__init__(config)
        self.config: EdacConfig
        self._counters = CounterTracker()
        self._seen: set[str] = set()
        # Controller -> the inode of its folder when last read (kernfs numbers a new folder anew).
        self._inodes: dict[str, int] = {}
        self._ce_recent = RecentCounts(CE_WINDOW_S)
        # Whether a listing of the controllers has been read: what the first one finds was counted before the
        # detector (the agent) started.
        self._listed = False

    def sample(self) -> Sample:
        """Reads every memory controller once.

        Returns:
            Totals, rates and events.
        """
        base = self.config.path("/sys/devices/system/edac/mc")
        mcs = [m for m in list_dir(base) if re.fullmatch("mc[0-9]+", m)]  # isdigit() took 'mc²', 'mc٣'
        renewed = set()
        for mc in mcs:
            # Also a controller whose folder was made anew since the last sample: the driver reloaded within one
            # interval (30 s; rmmod and modprobe take seconds), so no sample saw it gone.
            inode = self._inode(os.path.join(base, mc))
            if inode is not None and self._inodes.setdefault(mc, inode) != inode:
                self._inodes[mc] = inode
                renewed.add(mc)
        for gone in (self._seen - set(mcs)) | (renewed & self._seen):
            # A controller that comes back (the EDAC driver reloaded) is a new one whose counts start at zero:
            # its counts at the first reading after are new errors. Compared with the old ones instead, an
            # uncorrectable error after a reload went unreported unless the new count passed the old.
            self._counters.update(f"{gone}/ce", 0)
            self._counters.update(f"{gone}/ue", 0)
            self._ce_recent.forget(gone)
        for gone in set(self._inodes) - set(mcs):
            del self._inodes[gone]
        self._seen = set(mcs)
        at_start, self._listed = not self._listed, True
        if not mcs:
            return self.no_hardware(f"no EDAC memory controller under {base} (EDAC driver not loaded)")
        s = Sample()
        ce_total = ue_total = 0
        ce_rate = 0.0
        for mc in mcs:
            mdir = os.path.join(base, mc)
            try:
                # u32 in the kernel (mci->ce_mc, ue_mc, printed with %u): past it, negative, a corrupt file
                ce = read_count(os.path.join(mdir, "ce_count"), _EDAC_BITS)
                ue = read_count(os.path.join(mdir, "ue_count"), _EDAC_BITS)
            except DetectorReadError as exc:
                if not removed_while_read(exc, mdir):  # the EDAC driver unloading: gone, as the next listing says
                    s.error(exc)
                continue
            dimms = self._dimms(s, mdir)
            ce_total += ce
            ue_total += ue
            s.metrics[f"ce_count[{mc}]"] = float(ce)
            s.metrics[f"ue_count[{mc}]"] = float(ue)
            now = time.monotonic()
            dce = self._counters.update(f"{mc}/ce", ce, now)
            due = self._counters.update(f"{mc}/ue", ue, now)
            per_hour = dce.rate * 3600
            ce_rate += per_hour
            # Judged on the errors counted over the last hour, not on one interval's rate: at the default 30 s
            # interval a single correctable error read as 120/hour, over the default 100, and every stray one
            # raised and cleared a warning (a healthy DIMM logs a few a day).
            last_hour = self._ce_recent.add(mc, 0 if dce.first else dce.delta, now)
            worst = ", ".join(f"{label}: ce={c} ue={u}" for label, c, u in dimms if c or u)
            evidence = {"ce_count": ce, "ue_count": ue, "ce_per_hour": f"{per_hour:.1f}",
                        "ce_last_hour": last_hour, "dimms": worst}
            try:
                evidence["mc_name"] = read_text(os.path.join(mdir, "mc_name"))
            except DetectorReadError:
                pass  # mc_name is evidence only
            if not due.first and due.delta > 0:
                # one_off: the counter moved past this error already; a later read that raised out of the sample
                # lost it for good (a drain never asked for)
                self.one_off(s, self.event("hw.memory_ue", Severity.CRITICAL, Action.DRAIN_NODE,
                                           f"{due.delta} uncorrectable memory error(s) on {mc} ({worst})", mc,
                                           evidence))
            elif due.first and ue > 0:
                # Uncorrectable errors counted before the first reading: the detector is FAILED for them (below),
                # and no event said why (the counter's first reading is no increase). Raised once, with what is
                # known of when: EDAC counters start at zero at boot (or when the EDAC driver loads).
                when = ("before the agent started (EDAC counters reset at boot)" if at_start else
                        "before this detector first read it (since boot or since its EDAC driver loaded)")
                self.one_off(s, self.event("hw.memory_ue", Severity.CRITICAL, Action.DRAIN_NODE,
                                           f"{ue} uncorrectable memory error(s) on {mc} counted {when} ({worst})",
                                           mc, {**evidence, "counted": when, "before_agent_start": int(at_start)}))
            if ue > 0:
                s.worsen(DetectorState.FAILED, f"{mc} has {ue} uncorrectable memory errors")
            self.condition(s, f"ce/{mc}", last_hour > self.config.ce_per_hour,
                           "hw.memory_ce_rate", Severity.WARNING, Action.WATCH,
                           f"{mc}: {last_hour} correctable memory errors in {self._ce_recent.span_text(now)}, over "
                           f"{self.config.ce_per_hour:g}/hour ({worst})", mc, evidence)
        s.metrics.update({"ce_total": float(ce_total), "ue_total": float(ue_total), "ce_per_hour": ce_rate,
                          "controllers": float(len(mcs))})
        return s

    @staticmethod
    def _inode(path: str) -> int | None:
        """The inode number of a controller's folder (None when it went meanwhile)."""
        try:
            return os.stat(path).st_ino
        except OSError:
            return None

    def _dimms(self, s: Sample, mdir: str) -> list[tuple[str, int, int]]:
        out = []
        for sub in list_dir_or_record(mdir, s.error):
            if not re.fullmatch("(?:dimm|rank)[0-9]+", sub):
                continue
            ddir = os.path.join(mdir, sub)
            try:
                ce = read_count(os.path.join(ddir, "dimm_ce_count"), _EDAC_BITS)
                ue = read_count(os.path.join(ddir, "dimm_ue_count"), _EDAC_BITS)
            except DetectorReadError as exc:
                if not removed_while_read(exc, ddir):
                    s.error(exc)
                continue
            try:
                label = read_text(os.path.join(ddir, "dimm_label")) or sub
            except DetectorReadError:
                label = sub
            out.append((label, ce, ue))
        return out
