"""``[qualify]``: what the pre-flight node check runs, its thresholds and its time bounds.

The table lives in the agent's TOML file (:class:`~trainguard.agent.config.AgentConfig`, the one shared loader);
``trainguard run --qualify-config FILE`` and ``trainguard qualify --config FILE`` read the same file::

    [qualify]
    checks = ["detectors", "pcie", "nic", "rdma", "disk", "peers"]
    budget_s = 5.0              # the whole check, seconds; each check gets at most what is left
    check_timeout_s = 3.0       # one check, seconds
    nics = ["ens1f*"]           # interfaces whose speed is checked (globs); empty: the NIC check is skipped
    nic_speed_mbps = 200000     # their expected speed; 0 only requires the link up
    rdma_rate_gbps = 200        # expected rate of every RDMA port; 0 only requires state ACTIVE
    disk_dir = "/data/ckpt"     # where the write test goes; "" uses the job's checkpoint dir or a temp dir
    disk_mib = 8
    disk_min_mib_s = 100

Every field is documented with its unit and default on :class:`QualifySection`; :meth:`QualifySection.validate`
raises :class:`QualifyConfigError` naming the key and what to do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trainguard.config_loader import local_path_problem
from trainguard.errors import ConfigError

#: Names of the local checks, in the order they run.
CHECK_NAMES: tuple[str, ...] = ("detectors", "pcie", "nic", "rdma", "disk", "peers")


class QualifyConfigError(ConfigError):
    """A ``[qualify]`` value is out of range or names an unknown check."""


@dataclass
class QualifySection:
    """``[qualify]``: the pre-flight check a node passes before it takes a slot.

    Attributes:
        checks: which checks run, any of :data:`CHECK_NAMES`. Default all of them.
        budget_s: wall-clock bound of the whole check, seconds; a check starting with less than this left gets
            only what is left. Default 5.0.
        check_timeout_s: bound of one check, seconds; a check still running then fails as timed out. Default 3.0.
        recheck_s: a node running no workers (a spare or standby waiting to be promoted) qualifies again every
            this many seconds and sends the verdict with its next heartbeat; 0 never. Default 300.0.
        root: path prefix of the /sys files read by the ``pcie`` and ``rdma`` checks (tests point it at a fake
            tree); ``""`` uses the detectors' root. Default ``""``.
        net_root: path prefix of ``/sys/class/net`` for the ``nic`` check (interfaces belong to a network
            namespace, so this is usually the real ``/``). Default ``"/"``.
        pcie_devices: globs of PCI addresses whose links must be at full width; empty: every device of
            ``pcie_classes``. Default empty.
        pcie_classes: PCI class prefixes whose links are checked (GPU 0x0302/0x0300, Ethernet 0x0200, InfiniBand
            0x0207, accelerators 0x1200). Default those five.
        pcie_speed_classes: class prefixes whose link *speed* must also be at its maximum (GPUs lower their speed
            when idle, so they are not listed). Default Ethernet, InfiniBand, accelerators.
        nics: network interface names or globs whose ``speed`` is checked; empty skips the check. Default empty.
        nic_speed_mbps: the speed each of ``nics`` must report, Mb/s; 0 only requires the link up (virtual NICs
            report no speed). Default 0.
        rdma_rate_gbps: the rate each active RDMA port must report, Gb/s; 0 only requires ACTIVE. Default 0.
        disk_dir: directory the write test writes into; it must exist (a missing one fails the check rather than
            testing the disk above it); ``""`` uses the job's checkpoint directory (or its nearest existing
            folder), else the system temp dir. Default ``""``.
        disk_mib: MiB written (fsync'd) by the write test. Default 8.
        disk_min_mib_s: the write rate the disk must reach, MiB/s. Default 50.0.
        peer_count: already-qualified peers the node times an exchange with over its data address (``peers``
            check, at registration only); 0 turns the check off. Default 3.
        peer_kib: KiB sent to each peer and read back. Default 1024.
        peer_slow_ratio: the node fails when its median exchange time is over this many times the median of the
            nodes that qualified before it. Default 3.0.
        peer_min_history: earlier nodes' times needed before the comparison applies (the first nodes only record
            theirs). Default 3.
        in_daemon: the daemon (``trainguard agent``) qualifies its node at start and every ``recheck_s``; a failed
            verdict latches the node FATAL for its coordinators (:mod:`trainguard.agent.daemon_qualify`).
            Default false.
    """

    checks: list[str] = field(default_factory=lambda: list(CHECK_NAMES))
    budget_s: float = 5.0
    check_timeout_s: float = 3.0
    recheck_s: float = 300.0
    root: str = ""
    net_root: str = "/"
    pcie_devices: list[str] = field(default_factory=list)
    pcie_classes: list[str] = field(default_factory=lambda: ["0x0302", "0x0300", "0x0200", "0x0207", "0x1200"])
    pcie_speed_classes: list[str] = field(default_factory=lambda: ["0x0200", "0x0207", "0x1200"])
    nics: list[str] = field(default_factory=list)
    nic_speed_mbps: int = 0
    rdma_rate_gbps: float = 0.0
    disk_dir: str = ""
    disk_mib: int = 8
    disk_min_mib_s: float = 50.0
    peer_count: int = 3
    peer_kib: int = 1024
    peer_slow_ratio: float = 3.0
    peer_min_history: int = 3
    in_daemon: bool = False

    def validate(self) -> None:
        """Checks names and ranges.

        Raises:
            QualifyConfigError: the first bad value, naming its key.
        """
        # TOML has nan and inf literals, and a NaN passes every range check below (disk_min_mib_s = inf failed
        # every node's disk check, nan passed every one)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise QualifyConfigError(f"qualify.{f.name}={value}: must be a finite number")
        for name in self.checks:
            if name not in CHECK_NAMES:
                raise QualifyConfigError(f"qualify.checks: unknown check {name!r}; use any of {', '.join(CHECK_NAMES)}")
        if len(set(self.checks)) != len(self.checks):
            raise QualifyConfigError(f"qualify.checks {self.checks}: a check is listed twice")
        if not 0 < self.budget_s <= 600:
            raise QualifyConfigError(f"qualify.budget_s={self.budget_s}: use 0 < seconds <= 600")
        if not 0 < self.check_timeout_s <= 600:
            raise QualifyConfigError(f"qualify.check_timeout_s={self.check_timeout_s}: use 0 < seconds <= 600")
        if self.recheck_s < 0:
            raise QualifyConfigError(f"qualify.recheck_s={self.recheck_s}: use >= 0 seconds (0: never)")
        if self.nic_speed_mbps < 0:
            raise QualifyConfigError(f"qualify.nic_speed_mbps={self.nic_speed_mbps}: use >= 0 (0: any known speed)")
        if self.rdma_rate_gbps < 0:
            raise QualifyConfigError(f"qualify.rdma_rate_gbps={self.rdma_rate_gbps}: use >= 0 (0: any rate)")
        if not 1 <= self.disk_mib <= 1024:
            raise QualifyConfigError(f"qualify.disk_mib={self.disk_mib}: use 1-1024 MiB")
        if self.disk_min_mib_s < 0:
            raise QualifyConfigError(f"qualify.disk_min_mib_s={self.disk_min_mib_s}: use >= 0 MiB/s")
        if not 0 <= self.peer_count <= 16:
            raise QualifyConfigError(f"qualify.peer_count={self.peer_count}: use 0-16 (0: no peer check)")
        if not 1 <= self.peer_kib <= 16384:
            raise QualifyConfigError(f"qualify.peer_kib={self.peer_kib}: use 1-16384 KiB")
        if not self.peer_slow_ratio > 1:
            raise QualifyConfigError(f"qualify.peer_slow_ratio={self.peer_slow_ratio}: use a ratio > 1")
        if self.peer_min_history < 1:
            raise QualifyConfigError(f"qualify.peer_min_history={self.peer_min_history}: use >= 1")
        if not self.net_root:
            raise QualifyConfigError("qualify.net_root is empty; use '/' on a real node")
        for key in ("root", "net_root", "disk_dir"):
            value = getattr(self, key)
            if not value:
                continue
            # Checked when first read otherwise: a relative root skipped the pcie and rdma checks (the node
            # qualified on nothing), a URL or relative disk_dir failed the node FATAL, cordoned for a typo.
            problem = local_path_problem(value)
            if problem is not None:
                raise QualifyConfigError(f"qualify.{key} {value!r} {problem}")
        for key in ("pcie_classes", "pcie_speed_classes"):
            for cls in getattr(self, key):
                if not cls.startswith("0x"):
                    raise QualifyConfigError(f"qualify.{key}: {cls!r} is not a PCI class prefix like '0x0302'")


__all__ = ["CHECK_NAMES", "QualifyConfigError", "QualifySection"]
