"""Disk detector: fullness and health of the paths that matter (checkpoint and log directories).

For each configured path: space and inode usage (``statvfs`` through psutil), whether its filesystem is mounted
read-only (ext4 and XFS remount read-only on errors), and optionally a write probe that creates, fsyncs and
removes a small file, timing it. Paths are real paths of this node, not mapped under ``root``.

Block device health, under ``root``: an NVMe controller whose ``/sys/class/nvme/<ctrl>/state`` is not ``live``
(``resetting``, ``dead``, ``deleting (no IO)``...) and a SCSI/SATA disk whose ``/sys/block/<dev>/device/state``
is not ``running`` (``offline``, ``blocked``) are reported. Other disks' devices have a ``state`` of their own bus
there (an NVMe namespace's is its controller's ``live``, a Xen disk's ``Connected``) and are not read as SCSI.

A filesystem that hangs (a dead NFS server) blocks ``statvfs``; the probe is off by default for that reason.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import ClassVar

import psutil

from trainguard.config_loader import local_path_problem
from trainguard.detectors.base import Detector, DetectorConfig, Sample, register_detector
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity

#: Percentage points of usage below a threshold before ``disk.filling``/``disk.full`` ends.
USED_HYSTERESIS_PCT = 1.0
from trainguard.detectors.sysfs import list_dir_or_record, read_text, removed_while_read


@dataclass
class DiskConfig(DetectorConfig):
    """Settings of the disk detector.

    Attributes:
        interval_s: seconds between samples. Default 30.0.
        paths: directories to watch (checkpoint dir, log dir). Default ``("/",)``.
        warn_used_pct: space or inode usage above this percentage is a warning. Default 90.0.
        error_used_pct: usage above this percentage is an error. Default 97.0.
        write_probe: create, fsync and remove a small file in each path on every sample. Default False.
        slow_write_s: a probe slower than this many seconds is reported. Default 5.0.
        block_devices: check NVMe controller and SCSI disk states. Default True.
    """

    interval_s: float = 30.0
    paths: tuple[str, ...] = ("/",)
    warn_used_pct: float = 90.0
    error_used_pct: float = 97.0
    write_probe: bool = False
    slow_write_s: float = 5.0
    block_devices: bool = True

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range.
        """
        super().validate()
        if not 0 < self.warn_used_pct <= self.error_used_pct <= 100:
            raise DetectorConfigError("disk: need 0 < warn_used_pct <= error_used_pct <= 100")
        if not self.paths:
            raise DetectorConfigError("disk.paths is empty; list the checkpoint and log directories")
        for path in self.paths:
            # Checked against the folder each process starts in: / for the daemon under systemd (so 'ckpt'
            # watched the root filesystem's /ckpt, or nothing), the shell's folder for `trainguard detect`.
            problem = local_path_problem(path) if isinstance(path, str) else "is not a path"
            if problem is not None:
                raise DetectorConfigError(f"disk.paths: {path!r} {problem}")


#: The states the kernel prints: nvme_sysfs_show_state() (``adminonly`` before 5.x) and the SCSI sdev_states
#: table (``del`` before 5.x). A word outside them is a corrupt or cut file: 'runn' or 'li' read as a device
#: unhealthy (checkpoint-now, the detector FAILED) although the kernel said running/live.
_KNOWN_STATES = {
    "live": frozenset({"new", "live", "adminonly", "resetting", "connecting", "deleting", "deleting (no IO)",
                       "dead", "unknown state"}),
    "running": frozenset({"created", "running", "cancel", "deleted", "del", "quiesce", "offline",
                          "transport-offline", "blocked", "created-blocked"}),
}


def _scsi_device(disk: str, device: str, nvme_devices: set[str]) -> bool:
    """Whether ``/sys/block/<disk>/device`` is a SCSI device, whose ``state`` is the SCSI state (``running``).

    Other buses have a ``state`` file there too, in their own words: an NVMe namespace's device is its controller
    (``live``, already checked under ``/sys/class/nvme``), a Xen disk's its xenbus device (``Connected``). Read as
    SCSI states, every such disk was an unhealthy device. The device's ``subsystem`` link names its bus; a tree
    without that link (a fake one) is taken as SCSI unless the disk is an NVMe namespace.
    """
    subsystem = os.path.join(device, "subsystem")
    if os.path.islink(subsystem):
        return os.path.basename(os.path.realpath(subsystem)) == "scsi"
    return not disk.startswith("nvme") and os.path.realpath(device) not in nvme_devices


def mount_of(path: str) -> psutil._common.sdiskpart | None:
    """The mounted filesystem holding ``path`` (longest mount point prefix).

    Args:
        path: an existing path.

    Returns:
        The partition entry, or None when none matches.
    """
    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best.mountpoint)):
            best = part
    return best


@register_detector
class DiskDetector(Detector):
    """Watches the fullness and health of configured paths."""

    name: ClassVar[str] = "disk"
    config_class: ClassVar[type[DetectorConfig]] = DiskConfig
    default_interval_s: ClassVar[float] = 30.0

    def sample(self) -> Sample:
        """Checks every path once.

        Returns:
            Usage metrics and events.
        """
        self.config: DiskConfig
        cfg = self.config
        s = Sample()
        worst = 0.0
        for path in cfg.paths:
            try:
                usage = psutil.disk_usage(path)
                vfs = os.statvfs(path)
            except OSError as exc:
                s.error(DetectorReadError(path, f"cannot stat ({exc.strerror or exc})"))
                continue
            inode_pct = 100.0 * (vfs.f_files - vfs.f_ffree) / vfs.f_files if vfs.f_files else 0.0
            used = max(usage.percent, inode_pct)
            worst = max(worst, used)
            s.metrics.update({f"used_pct[{path}]": usage.percent, f"free_bytes[{path}]": float(usage.free),
                              f"inodes_used_pct[{path}]": inode_pct})
            evidence = {"used_pct": usage.percent, "free_bytes": usage.free, "inodes_used_pct": f"{inode_pct:.1f}"}
            # Says which runs out: a disk out of inodes (millions of small shard files) read "98.0% full", and the
            # operator's df -h showed 40% used; the fix (delete files, not bytes) differs.
            what = (f"{used:.1f}% of its inodes used (space {usage.percent:.1f}%; see df -i)"
                    if inode_pct > usage.percent else f"{used:.1f}% full")
            # a usage hovering at a threshold (a checkpoint written, then the old one removed) raises one event,
            # not one per crossing: a condition ends a hysteresis below where it started
            full = used >= cfg.error_used_pct - (USED_HYSTERESIS_PCT if self.holding(f"full/{path}") else 0.0)
            self.condition(s, f"full/{path}", full, "disk.full", Severity.ERROR, Action.WATCH,
                           f"{path} is {what}", path, evidence)
            warn = cfg.warn_used_pct - (USED_HYSTERESIS_PCT if self.holding(f"filling/{path}") else 0.0)
            self.condition(s, f"filling/{path}", warn <= used and not full, "disk.filling",
                           Severity.WARNING, Action.WATCH, f"{path} is {what}", path, evidence)
            part = mount_of(path)
            ro = part is not None and "ro" in part.opts.split(",")
            self.condition(s, f"ro/{path}", ro, "disk.read_only", Severity.ERROR, Action.WATCH,
                           f"{path} is on a read-only filesystem ({part.device if part else '?'} at "
                           f"{part.mountpoint if part else '?'})", path, {"opts": part.opts if part else ""})
            if cfg.write_probe and not ro:
                self._probe(s, path)
        s.metrics["max_used_pct"] = worst
        if cfg.block_devices:
            self._block_devices(s)
        return s

    def _block_devices(self, s: Sample) -> None:
        nvme = self.config.path("/sys/class/nvme")
        block = self.config.path("/sys/block")
        # Which listings were read: a folder that cannot be listed says nothing about its devices being gone.
        errors_before = len(s.errors)
        controllers = list_dir_or_record(nvme, s.error)
        nvme_ok = len(s.errors) == errors_before
        checks = [(f"nvme:{c}", os.path.join(nvme, c, "state"), "live", os.path.join(nvme, c)) for c in controllers]
        nvme_devices = {os.path.realpath(os.path.join(nvme, c)) for c in controllers}
        errors_before = len(s.errors)
        disks = list_dir_or_record(block, s.error)
        listed = {"nvme": nvme_ok, "block": len(s.errors) == errors_before}
        checks += [(f"block:{d}", os.path.join(block, d, "device", "state"), "running", os.path.join(block, d))
                   for d in disks
                   if os.path.exists(os.path.join(block, d, "device", "state"))
                   and _scsi_device(d, os.path.join(block, d, "device"), nvme_devices)]
        bad = 0
        present: set[str] = set()
        for subject, path, good, folder in checks:
            try:
                state = read_text(path)
            except DetectorReadError as exc:
                # A disk or controller removed since it was listed (hot-unplug, a controller deleted after a
                # failed reset) is gone, not unreadable: it was a detector.error naming a file that no longer
                # exists. Gone, its conditions end below.
                if not removed_while_read(exc, folder):
                    present.add(subject)  # still there, state unknown: its condition holds as it is
                    s.error(exc)
                continue
            present.add(subject)
            if state not in _KNOWN_STATES[good]:
                s.error(DetectorReadError(path, f"expected a state word the kernel prints "
                                                f"({', '.join(sorted(_KNOWN_STATES[good]))}), found {state[:40]!r}"))
                continue
            bad += state != good
            self.condition(s, f"dev/{subject}", state != good, "disk.device_unhealthy", Severity.ERROR,
                           Action.CHECKPOINT_NOW, f"{subject} is {state!r} (healthy: {good!r})", subject,
                           {"state": state, "file": path})
        self._clear_gone(s, present, listed)
        s.metrics["block_devices_checked"] = float(len(checks))
        s.metrics["block_devices_unhealthy"] = float(bad)

    def _clear_gone(self, s: Sample, present: set[str], listed: dict[str, bool]) -> None:
        """Ends the conditions of disks and controllers no longer present (removed for good: hot-unplugged, a
        controller deleted after a failed reset). Their ``disk.device_unhealthy`` stayed active forever, the
        detector FAILED for a device that no longer exists; only one re-added under its name cleared. Devices of
        a folder that could not be listed this sample are not judged."""
        for key, started in list(self._active.items()):
            kind, _, subject = key.partition("/")
            if kind != "dev" or subject in present or not listed.get(subject.partition(":")[0], False):
                continue
            self.condition(s, key, False, started.kind, started.severity, started.action,
                           f"{subject} is no longer present (removed)", started.subject, {"state": "missing"})

    def _probe(self, s: Sample, path: str) -> None:
        probe = os.path.join(path, f".trainguard-probe-{os.getpid()}")
        started = time.monotonic()
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"trainguard disk probe\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            self.condition(s, f"probe/{path}", True, "disk.write_failed", Severity.ERROR, Action.WATCH,
                           f"cannot write to {path}: {exc.strerror or exc}", path, {"errno": exc.errno})
            return
        self.condition(s, f"probe/{path}", False, "disk.write_failed", Severity.ERROR, Action.WATCH,
                       f"writes to {path} work", path)
        elapsed = time.monotonic() - started
        s.metrics[f"write_probe_s[{path}]"] = elapsed
        self.condition(s, f"slow/{path}", elapsed > self.config.slow_write_s, "disk.slow", Severity.WARNING,
                       Action.WATCH, f"a 22-byte fsync'd write to {path} took {elapsed:.1f} s", path,
                       {"seconds": f"{elapsed:.3f}"})
