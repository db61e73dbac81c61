"""Real fail-slow injection: a CPU quota on chosen processes (cgroup v1 ``cpu``) and a rate cap on a link (tbf).

- :class:`CpuThrottle` makes a cgroup ``/sys/fs/cgroup/cpu/tg-slow-<pid>-<tag>``, sets ``cpu.cfs_quota_us`` to a
  fraction of ``cpu.cfs_period_us`` (100 ms) and moves the processes in (``cgroup.procs`` moves every thread).
  Closing moves them back to the cgroup they came from and removes the group, also after a failure.
- :class:`LinkRateCap` puts a ``tbf`` qdisc on an interface (optionally inside a network namespace): the way to
  slow a link on a kernel without ``netem``. Closing deletes it.

Both are context managers with unique names per process, so concurrent drills and tests never collide.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterable

from trainguard.drill.errors import SoakError

#: Mount point of the cgroup v1 cpu controller.
CPU_CGROUP_ROOT = "/sys/fs/cgroup/cpu"


def cpu_throttle_unavailable_reason(root: str = CPU_CGROUP_ROOT) -> str | None:
    """Why a CPU throttle cannot be set up here, or None when it can."""
    if not os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
        return f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing)"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (needs root)"
    return None


def _cpu_cgroup_of(pid: int) -> str:
    """The cgroup v1 ``cpu`` path of ``pid`` (e.g. ``/`` or ``/user.slice``)."""
    with open(f"/proc/{pid}/cgroup", encoding="ascii") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "cpu" in controllers.split(","):
                return path
    return "/"


class CpuThrottle:
    """Caps processes at ``fraction`` of one CPU through a fresh cgroup v1 ``cpu`` group.

    Args:
        fraction: CPU share allowed, in (0, 64] CPUs per period (0.25: a quarter of one core).
        root: cgroup v1 cpu mount.

    Raises:
        SoakError: the controller is missing or not writable, or the fraction is out of range.
    """

    def __init__(self, fraction: float, root: str = CPU_CGROUP_ROOT) -> None:
        reason = cpu_throttle_unavailable_reason(root)
        if reason:
            raise SoakError(f"cannot throttle CPU: {reason}")
        if not 0 < fraction <= 64:
            raise SoakError(f"CPU throttle fraction {fraction} must be in (0, 64] CPUs")
        self.root = root
        self.fraction = fraction
        self.path = os.path.join(root, f"tg-slow-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._origin: dict[int, str] = {}
        os.mkdir(self.path)
        try:
            with open(os.path.join(self.path, "cpu.cfs_period_us"), encoding="ascii") as f:
                period = int(f.read())
            self._write("cpu.cfs_quota_us", str(max(1000, int(period * fraction))))
        except (OSError, ValueError) as exc:
            os.rmdir(self.path)
            raise SoakError(f"cannot set the CPU quota in {self.path}: {exc}") from exc

    def _write(self, name: str, value: str, path: str | None = None) -> None:
        with open(os.path.join(path or self.path, name), "w", encoding="ascii") as f:
            f.write(value)

    def add(self, pids: Iterable[int]) -> None:
        """Moves processes (all their threads) into the throttled group.

        Raises:
            SoakError: a process could not be moved (it is gone).
        """
        for pid in pids:
            try:
                self._origin.setdefault(pid, _cpu_cgroup_of(pid))
                self._write("cgroup.procs", str(pid))
            except OSError as exc:
                raise SoakError(f"cannot move pid {pid} into {self.path}: {exc}") from exc

    def close(self) -> None:
        """Moves the processes back where they were and removes the group (idempotent, never raises)."""
        for pid, origin in self._origin.items():
            try:
                self._write("cgroup.procs", str(pid), os.path.join(self.root, origin.lstrip("/")))
            except OSError:
                pass  # the process is gone
        self._origin.clear()
        try:
            with open(os.path.join(self.path, "cgroup.procs"), encoding="ascii") as f:
                left = [int(x) for x in f.read().split()]
            for pid in left:  # children forked meanwhile
                try:
                    self._write("cgroup.procs", str(pid), self.root)
                except OSError:
                    pass
            os.rmdir(self.path)
        except (OSError, ValueError):
            pass

    def __enter__(self) -> "CpuThrottle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LinkRateCap:
    """Caps an interface's egress rate with a ``tbf`` qdisc.

    Args:
        dev: interface name.
        rate: tc rate, e.g. ``"20mbit"``.
        netns: network namespace of the interface ("" for the current one).
        burst: tbf bucket size. Default ``"32kbit"``.
        latency: how long a packet may wait in the bucket. Default ``"400ms"``.

    Raises:
        SoakError: tc refused (no such device, no tbf).
    """

    def __init__(self, dev: str, rate: str, netns: str = "", burst: str = "32kbit", latency: str = "400ms") -> None:
        self.dev, self.rate, self.netns = dev, rate, netns
        self._tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        self._active = True

    def _tc(self, *args: str, check: bool = True) -> None:
        cmd = (["ip", "netns", "exec", self.netns] if self.netns else []) + ["tc", *args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise SoakError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")

    def close(self) -> None:
        """Removes the qdisc (idempotent, never raises)."""
        if getattr(self, "_active", False):
            self._active = False
            self._tc("qdisc", "del", "dev", self.dev, "root", check=False)

    def __enter__(self) -> "LinkRateCap":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
