"""Host detector: CPU load, memory headroom and pressure stall information (PSI) for memory, CPU and I/O.

CPU utilisation comes from psutil; memory from ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``, in kB) and
pressure from ``/proc/pressure/memory`` (``some``/``full`` lines of ``avg10=... avg60=... avg300=... total=...``,
Documentation/accounting/psi.rst), both under the configured root. ``full avg10`` is the share of the last
10 s in which every non-idle task was stalled on memory: the node is thrashing, and an OOM kill is near.
With ``memory_cgroup`` set, a cgroup's limit counts as well (``trainguard run`` in a container: the OOM killer
acts at the container's limit, see :mod:`.cgroup_memory`).

A kernel built with ``CONFIG_PSI_DEFAULT_DISABLED`` (RHEL 8, some distribution kernels) and not booted with
``psi=1`` has the ``/proc/pressure`` files, but reading them fails with ``EOPNOTSUPP``: pressure is then not
measured on this node, as without the files, rather than an unreadable input.
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import psutil

from trainguard.detectors.base import Detector, DetectorConfig, Sample, register_detector
from trainguard.detectors.cgroup_memory import CGROUP_MOUNT, read_cgroup_memory
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.sysfs import parse_decimal, parse_int, read_key_values, read_text

#: Percentage points of available memory above the threshold before ``host.memory_low`` ends.
MEM_HYSTERESIS_PCT = 1.0
#: Percentage points of CPU utilisation below the threshold before ``host.cpu_saturated`` ends.
CPU_HYSTERESIS_PCT = 5.0


def parse_meminfo(text: str, path: str) -> dict[str, int]:
    """Parses ``/proc/meminfo``.

    Args:
        text: the file content (``Name:   value kB`` lines).
        path: the file, for errors.

    Returns:
        Name -> bytes (values without a unit are counts and kept as is).

    Raises:
        DetectorReadError: a line is not ``Name: value [kB]``, MemTotal/MemAvailable is missing, MemTotal is 0 or
            MemAvailable exceeds it (a corrupt file: read as 500% or 512000% of memory available before).
    """
    out: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        name, sep, rest = line.partition(":")
        parts = rest.split()
        # isdigit() took '²', which int() refuses: a ValueError out of the sample instead of this read error
        if not sep or not parts or not parts[0].isascii() or not parts[0].isdigit() or len(parts) > 2 or (
                len(parts) == 2 and parts[1] != "kB"):
            raise DetectorReadError(path, f"line {number} {line[:40]!r} is not 'Name: value kB'")
        out[name.strip()] = parse_int(parts[0], path, f"'Name: value kB' on line {number}") * (
            1024 if len(parts) == 2 else 1)
    for key in ("MemTotal", "MemAvailable"):
        if key not in out:
            raise DetectorReadError(path, f"no {key} line (truncated?)")
    if out["MemTotal"] <= 0 or out["MemAvailable"] > out["MemTotal"]:
        raise DetectorReadError(path, f"MemAvailable {out['MemAvailable'] >> 10} kB of MemTotal "
                                      f"{out['MemTotal'] >> 10} kB is impossible (a corrupt file)")
    return out


def read_psi(path: str) -> dict[str, str] | None:
    """Reads a ``/proc/pressure/<resource>`` file.

    Args:
        path: the file.

    Returns:
        ``"<some|full>.<key>"`` -> value, or None when the kernel does not measure pressure (no file, or PSI
        disabled at boot: the read fails with ``EOPNOTSUPP``).

    Raises:
        DetectorReadError: the file cannot be read for another reason, or is not in the PSI format (an ``avg``
            that is not a percentage from 0 to 100).
    """
    try:
        os.stat(path)
    except FileNotFoundError:  # a kernel without CONFIG_PSI
        return None
    except OSError as exc:
        # os.path.exists() said False for EACCES and ELOOP too: an unreadable /proc/pressure read as a kernel
        # without pressure stall information, and memory thrashing went unreported with the detector OK.
        raise DetectorReadError(path, f"cannot be read ({exc.strerror or exc})") from exc
    try:
        values = read_key_values(path)
    except DetectorReadError as exc:
        if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EOPNOTSUPP:
            return None
        raise
    # float() takes 'inf', 'nan' and '1e999': an infinite pressure metric made the predictor refuse the whole
    # sample (the rules tier's too), and a NaN one never crossed the memory pressure threshold; it also took
    # other scripts' digits ('٥٠.٠٠' read as 50%) and '5_0.00'. The kernel prints ASCII '<int>.<2 digits>'.
    for key, value in values.items():
        if key.rpartition(".")[2].startswith("avg"):
            try:
                pct = parse_decimal(value, path)
            except DetectorReadError:
                pct = math.nan
            if not 0.0 <= pct <= 100.0:
                raise DetectorReadError(path, f"{key} {value[:40]!r} is not a percentage from 0 to 100")
    return values


@dataclass
class HostConfig(DetectorConfig):
    """Settings of the host detector.

    Attributes:
        interval_s: seconds between samples. Default 5.0.
        mem_available_min_pct: available memory below this percentage of the total is reported. Default 5.0.
        psi_full_avg10_pct: memory pressure ``full avg10`` above this percentage is reported. Default 10.0.
        cpu_busy_pct: CPU utilisation above this percentage is reported. Training nodes often run their CPUs
            flat out on purpose (data loaders), so the default 100.0 reports nothing; the utilisation is still
            a metric.
        memory_cgroup: whose memory limit also counts (:mod:`.cgroup_memory`): ``""`` none, the node's
            ``/proc/meminfo`` only (default: the node daemon, which runs in a cgroup of its own, not the
            job's); ``"self"`` this process's cgroup and its parents (``trainguard run`` inside the job's
            container: the OOM killer acts at the container's limit, whatever the host has free); or an absolute
            cgroup path, e.g. the job's pod or slice. The smaller room of the node and the cgroup is reported.
    """

    interval_s: float = 5.0
    mem_available_min_pct: float = 5.0
    psi_full_avg10_pct: float = 10.0
    cpu_busy_pct: float = 100.0
    memory_cgroup: str = ""

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range.
        """
        super().validate()
        for name in ("mem_available_min_pct", "psi_full_avg10_pct", "cpu_busy_pct"):
            if not 0 <= getattr(self, name) <= 100:
                raise DetectorConfigError(f"host.{name}={getattr(self, name)} must be a percentage in [0, 100]")
        cg = self.memory_cgroup
        if not isinstance(cg, str) or not (cg in ("", "self") or (cg.startswith("/") and ".." not in cg.split("/"))):
            raise DetectorConfigError(f"host.memory_cgroup={cg!r} must be '' (the node only), 'self' (this "
                                      "process's cgroup) or an absolute cgroup path like /kubepods.slice")


@register_detector
class HostDetector(Detector):
    """CPU, memory and memory pressure of the node."""

    name: ClassVar[str] = "host"
    config_class: ClassVar[type[DetectorConfig]] = HostConfig
    default_interval_s: ClassVar[float] = 5.0

    def __init__(self, config: HostConfig | None = None) -> None:
        """Creates the detector (and primes psutil's CPU counter).

        Args:
            config: settings.
        """
        super().__init__(config)
        self.config: HostConfig
        psutil.cpu_percent(interval=None)

    def sample(self) -> Sample:
        """Reads CPU, memory and pressure once.

        Returns:
            Metrics and events.
        """
        cfg = self.config
        s = Sample()
        cpu = psutil.cpu_percent(interval=None)
        s.metrics["cpu_percent"] = cpu
        s.metrics["load1_per_cpu"] = os.getloadavg()[0] / (psutil.cpu_count() or 1)
        # each threshold ends a hysteresis past where it started: a value hovering at it (memory freed and taken
        # by every checkpoint) raised and cleared an event per crossing, and each memory_low asked for a checkpoint
        busy = cfg.cpu_busy_pct - (CPU_HYSTERESIS_PCT if self.holding("cpu") else 0.0)
        self.condition(s, "cpu", cpu > busy, "host.cpu_saturated", Severity.WARNING, Action.WATCH,
                       f"CPU utilisation {cpu:.0f}% above {cfg.cpu_busy_pct:.0f}%", "", {"cpu_percent": cpu})
        path = cfg.path("/proc/meminfo")
        try:
            mem = parse_meminfo(read_text(path), path)
        except DetectorReadError as exc:
            s.error(exc)
        else:
            avail, total, where = mem["MemAvailable"], mem["MemTotal"], "memory"
            details: dict[str, object] = {"mem_available_bytes": avail, "mem_total_bytes": total}
            if cfg.memory_cgroup:
                try:
                    cg = read_cgroup_memory(cfg.path("/proc/self/cgroup"), cfg.path(CGROUP_MOUNT), cfg.memory_cgroup)
                except DetectorReadError as exc:
                    s.error(exc)  # the node's figures still count
                else:
                    # the cgroup binds when it leaves less room (in bytes) than the node does
                    if cg is not None and cg.available_bytes < avail:
                        avail, total = cg.available_bytes, cg.limit_bytes
                        where = f"the memory limit of cgroup {cg.cgroup}"
                        details = {"mem_available_bytes": avail, "mem_limit_bytes": total, "cgroup": cg.cgroup,
                                   "working_set_bytes": cg.working_set_bytes}
            avail_pct = 100.0 * avail / max(1, total)
            s.metrics.update({"mem_available_pct": avail_pct, "mem_available_bytes": float(avail),
                              "swap_used_bytes": float(mem.get("SwapTotal", 0) - mem.get("SwapFree", 0))})
            low = cfg.mem_available_min_pct + (MEM_HYSTERESIS_PCT if self.holding("mem") else 0.0)
            self.condition(s, "mem", avail_pct < low, "host.memory_low", Severity.WARNING,
                           Action.CHECKPOINT_NOW,
                           f"only {avail_pct:.1f}% of {where} available ({avail >> 20} MiB of {total >> 20} MiB)", "",
                           details)
        psi_path = cfg.path("/proc/pressure/memory")
        try:
            psi = read_psi(psi_path)  # None: pressure not measured here (no CONFIG_PSI, or psi=0), not an error
            some, full = (float(psi["some.avg10"]), float(psi["full.avg10"])) if psi is not None else (0.0, 0.0)
        except (DetectorReadError, KeyError, ValueError) as exc:
            s.error(exc if isinstance(exc, DetectorReadError) else
                    DetectorReadError(psi_path, f"no valid 'some/full avg10' values ({exc})"))
        else:
            if psi is not None:
                s.metrics.update({"mem_pressure_some_avg10": some, "mem_pressure_full_avg10": full})
                stalled = cfg.psi_full_avg10_pct * (0.5 if self.holding("psi") else 1.0)
                self.condition(s, "psi", full > stalled, "host.memory_pressure", Severity.WARNING,
                               Action.CHECKPOINT_NOW, f"memory pressure: all tasks stalled {full:.1f}% of the "
                               f"last 10 s", "", {"full_avg10": full, "some_avg10": some})
        for resource in ("cpu", "io"):  # metrics only: the predictor learns what they mean on each fleet
            path = cfg.path(f"/proc/pressure/{resource}")
            try:
                values = read_psi(path)
                if values is None:
                    continue
                s.metrics[f"{resource}_pressure_some_avg10"] = float(values["some.avg10"])
                if "full.avg10" in values:  # the cpu file has a 'full' line only since Linux 5.13
                    s.metrics[f"{resource}_pressure_full_avg10"] = float(values["full.avg10"])
            except (DetectorReadError, KeyError, ValueError) as exc:
                s.error(exc if isinstance(exc, DetectorReadError) else
                        DetectorReadError(path, f"no valid 'some avg10' value ({exc})"))
        return s
