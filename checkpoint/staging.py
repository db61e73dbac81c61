"""Where one rank's snapshots are staged: the shared-memory tier, or a fallback when /dev/shm is too small.

Containers give /dev/shm 64 MiB (Docker's default, and Kubernetes pods without a memory-backed ``emptyDir``). The
first ``prepare()``/``save()`` checks that the rank's staging slots fit in the memory directory and allocates them
there at once (ranks of one node racing for a small /dev/shm either get all their slots or fall back). When they
do not fit, snapshots are staged elsewhere so checkpoints still reach disk (``checkpoint.memory.fallback``):

- ``"disk"``: slot files under ``<disk tier dir>/.trainguard-staging`` (CPU nodes: the state already fills host
  memory, and the page cache absorbs the copy);
- ``"host"``: anonymous shared memory (``memfd``), not bounded by /dev/shm, page-locked for the GPU copies where
  CUDA is present (GPU nodes: the state lives on the device, host memory is free);
- ``"auto"`` (default): host with CUDA, else disk.

One warning names /dev/shm, ``docker run --shm-size``, a Kubernetes ``emptyDir`` with ``medium: Memory`` and the
config key, and a ``checkpoint.staging_fallback`` health event says the same. A fallback is staging only, never a
tier: the memory tier is off for this process until /dev/shm is enlarged.

The disk tier's folder gets a writer lease of its own (``<disk dir>/.trainguard-writers/<job>/rank_NNNNN``): the
staging lease lives in the memory directory, so two processes of one job and rank given different memory
directories (two containers, each with its own /dev/shm, on one checkpoint directory) both wrote every step
there, each overwriting the other's files, with no word. On a filesystem shared between hosts (NFS, Lustre,
GPFS, CephFS...) a held lease may be a lost node's: its server keeps the lock until the node's lease with it
expires (NFSv4: 90 s), while the node's replacement already runs the rank. There a held lease is a warning, not a
refusal: refusing would fail every save of the replacement, and restart it, for that long.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.arena import Arena, ArenaLease
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import ArenaOwnedError, StorageUnavailableError
from trainguard.checkpoint.events import EventSink

log = logging.getLogger(__name__)

EVENT_KIND = "checkpoint.staging_fallback"
#: Folder of the disk tier holding the writers' leases (a dot folder: no job and no step is named so).
WRITERS_DIR = ".trainguard-writers"
#: Where the mount table is read (the kernel's format); tests point it at a copy describing other filesystems.
MOUNTINFO = "/proc/self/mountinfo"
#: Filesystems of one host: a lock held there is a live process's (the kernel drops a dead one's at once).
_LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay",
                       "devtmpfs", "bcachefs", "reiserfs", "jfs", "vfat", "exfat", "ntfs3"})


_OCTAL = re.compile(r"\\([0-7]{3})")


def filesystem_type(path: str, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it in ``mountinfo``), "" when
    the table cannot be read."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5 or not right.split():
                    continue
                # Mount points escape space, tab, newline and backslash as octal (\040...).
                point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        return ""
    return kind


def shared_between_hosts(path: str) -> bool:
    """Whether ``path`` may be on a filesystem other hosts write too (not a known local type, or unknown)."""
    return filesystem_type(path) not in _LOCAL_FS


def _cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def _host_staging() -> str:
    """The anonymous-memory staging's folder (its lease files) when there is no disk tier: one for the host."""
    return os.path.join(tempfile.gettempdir(), "trainguard-staging")


class StagingArea:
    """The staging slots of one rank and the lease that makes this process their only writer.

    Args:
        config: the checkpointer's configuration.
        job: job name; rank: this rank.
        nslots: staging slots (memory.keep + 1).
        events: where the fallback's health event goes.
    """

    def __init__(self, config: CheckpointConfig, job: str, rank: int, nslots: int, events: EventSink) -> None:
        self.config, self.job, self.rank, self.nslots, self.events = config, job, rank, nslots, events
        self.arena: Arena | None = None
        self.lease: ArenaLease | None = None
        #: "memory", "disk" or "host" once opened; None before.
        self.kind: str | None = None
        #: The shared-memory lease kept after the state outgrew its slots (see :meth:`retire_memory`).
        self.outgrown_lease: ArenaLease | None = None
        #: This process's lease on the job and rank in the disk tier's folder (see the module docstring).
        self.disk_lease: ArenaLease | None = None
        #: The disk lease was held by another process on a shared filesystem, and this one writes without it.
        self._disk_lease_held_elsewhere = False

    def fallback(self) -> tuple[str, str | None]:
        """``(kind, directory)`` of the staging used when the memory directory is too small (see module)."""
        cfg = self.config
        kind = cfg.memory.fallback
        if kind == "auto":
            kind = "host" if _cuda() else "disk"
        if cfg.memory.fallback_directory:
            return kind, cfg.memory.fallback_directory
        if cfg.disk.enabled:
            return kind, os.path.join(cfg.disk_directory, ".trainguard-staging")
        if kind == "host":
            return kind, _host_staging()
        return kind, None

    def ensure(self, nbytes: int) -> Arena:
        """Opens (once) the staging arena for slots of ``nbytes``: shared memory when they fit, else the fallback.

        Raises:
            ArenaOwnedError: another live process writes this job and rank.
            StorageUnavailableError: neither the memory directory nor the fallback can hold the slots.
        """
        if self.arena is not None:
            return self.arena
        self._lease_disk()
        shm_root = self.config.memory.directory
        try:
            short = arena_mod.staging_shortfall(arena_mod.rank_dir(shm_root, self.job, self.rank), self.nslots,
                                                nbytes)
        except OSError:
            short = self.nslots * nbytes
        if short == 0:
            try:
                arena: Arena | None = self._open(shm_root, "memory", anonymous=False)
            except StorageUnavailableError:  # no usable memory directory at all (read-only, missing /dev/shm)
                arena, short = None, self.nslots * nbytes
            if arena is not None:
                try:
                    arena.preallocate(nbytes)
                    return arena
                except StorageUnavailableError:
                    # Another process took the room between the check and the allocation: fall back as well.
                    self.close(remove=False)
                    short = arena_mod.staging_shortfall(arena.dir, self.nslots, nbytes)
                    return self.fall_back(nbytes, short, raced=True)
        return self.fall_back(nbytes, short)

    def _lease_disk(self) -> None:
        """Takes this job and rank's writer lease in the disk tier's folder (once).

        Raises:
            ArenaOwnedError: another live process writes this job and rank there (the message names its pid).
        """
        if self.disk_lease is not None or self._disk_lease_held_elsewhere or not self.config.disk.enabled:
            return
        lease = ArenaLease(arena_mod.rank_dir(os.path.join(self.config.disk_directory, WRITERS_DIR), self.job,
                                              self.rank))
        try:
            lease.acquire()
        except ArenaOwnedError as exc:
            if not shared_between_hosts(self.config.disk_directory):
                raise
            # Possibly a lost node's lock that its file server has not expired yet (see the module docstring).
            log.warning("%s; the checkpoint folder is on a filesystem shared between hosts, where this may be a "
                        "lost node's lock not yet expired, so this process writes anyway: if another live process "
                        "writes this job and rank, their checkpoints overwrite each other", exc)
            self._disk_lease_held_elsewhere = True  # said once; the next open() must not say it again
            return
        except StorageUnavailableError as exc:
            # A disk folder that cannot be written fails each save's disk tier, reported there; not a reason to
            # refuse the memory tier here.
            log.debug("no writer lease on the disk tier: %s", exc)
            return
        self.disk_lease = lease

    def fall_back(self, nbytes: int, short: int, raced: bool = False) -> Arena:
        """Opens the fallback staging for slots of ``nbytes`` (``short`` bytes missing in the memory directory;
        ``raced``: another process took the room between the check and this allocation).

        Warns once and emits the ``checkpoint.staging_fallback`` event. The caller has closed any arena first.

        Raises:
            ArenaOwnedError: another live process writes this job and rank in the fallback directory.
            StorageUnavailableError: there is no fallback (no disk tier and ``fallback = "disk"``), or it fails.
        """
        shm_root = self.config.memory.directory
        kind, where_dir = self.fallback()
        if where_dir is None:
            raise StorageUnavailableError(
                f"{shm_root} is {_short(short, raced)} for {self.nslots} staging slots of "
                f"{nbytes / 2**20:.1f} MiB and the disk tier is off; enlarge /dev/shm (docker run --shm-size, "
                "a Kubernetes emptyDir with medium: Memory) or set checkpoint.memory.directory")
        where = (f"on local disk at {where_dir}" if kind == "disk" else
                 "in anonymous host memory" + (" (page-locked for the GPU copies)" if _cuda() else ""))
        msg = (f"checkpoint staging: {shm_root} has too little room for {self.nslots} slots "
               f"({self.nslots * nbytes / 2**20:.1f} MiB, {_short(short, raced)}; /dev/shm is 64 MiB in "
               f"Docker and in Kubernetes pods by default), so snapshots are staged {where} "
               f"and the in-memory tier is off for rank {self.rank}; to restore from memory "
               "again, enlarge /dev/shm (docker run --shm-size=16g, or mount a Kubernetes emptyDir with "
               "medium: Memory at /dev/shm) or point checkpoint.memory.directory "
               "($TRAINGUARD_CHECKPOINT_SHM_DIR) at a larger tmpfs")
        self.events.notice(EVENT_KIND, msg, {
            "shm_dir": shm_root, "needed_bytes": str(self.nslots * nbytes), "short_bytes": str(short),
            "fallback": kind, "fallback_directory": where_dir, "config_key": "checkpoint.memory.directory"})
        return self._open(where_dir, kind, anonymous=kind == "host")

    def _open(self, root: str, kind: str, anonymous: bool) -> Arena:
        self._lease_disk()  # again after a close() on the way to the fallback
        if kind == "memory" or root == _host_staging():
            # Roots every job of the host shares; a fallback in the job's own checkpoint folder stays private.
            arena_mod.make_shared_root(root)
        lease = ArenaLease(arena_mod.rank_dir(root, self.job, self.rank))
        lease.acquire()
        try:
            arena = Arena(root, self.job, self.rank, self.nslots, anonymous=anonymous)
        except BaseException:
            lease.release(remove=False)
            raise
        self.lease, self.arena, self.kind = lease, arena, kind
        return arena

    def outgrown(self, data_bytes: int, exc: StorageUnavailableError) -> StorageUnavailableError:
        """The error for a state that outgrew the staging chosen at the first save (names /dev/shm when there)."""
        if self.kind != "memory":
            return exc
        return StorageUnavailableError(
            f"the state grew to {data_bytes / 2**20:.1f} MiB per snapshot and {self.config.memory.directory} "
            "cannot hold its staging slots (a container's /dev/shm?): enlarge /dev/shm (docker run --shm-size, a "
            "Kubernetes emptyDir with medium: Memory) or point checkpoint.memory.directory at a larger tmpfs; a new "
            f"Checkpointer falls back to other staging ({exc})")

    def retire_memory(self) -> None:
        """Unmaps the shared-memory slots the state outgrew, keeping their lease until :meth:`close`.

        Their committed copies stay restorable meanwhile, and ``close`` removes them as it removes an arena in
        use: given back now, the lease could never be retaken to remove them, so a clean exit left the slots
        holding a container's /dev/shm.
        """
        if self.arena is not None:
            self.arena.close(remove=False)
        self.outgrown_lease, self.lease = self.lease, None
        self.arena, self.kind = None, None

    def drop_outgrown(self) -> bool:
        """Removes the shared-memory slots left by :meth:`retire_memory` (and gives their lease back) now that a
        newer step is on disk: their copies only duplicate older disk steps, while they held most of a small
        /dev/shm for the rest of the run, the room DataLoader workers share tensors through.

        Returns:
            True when there were such slots.
        """
        lease, self.outgrown_lease = self.outgrown_lease, None
        if lease is None:
            return False
        lease.release(remove=True)
        return True

    def close(self, remove: bool, remove_outgrown: bool = False) -> None:
        """Unmaps the slots and gives the lease back; only the lease holder removes, and only with ``remove``
        (``remove_outgrown`` for the shared-memory slots left by :meth:`retire_memory`)."""
        if self.arena is not None:
            self.arena.close(remove=False)
        if self.lease is not None:
            self.lease.release(remove=remove)
        outgrown, self.outgrown_lease = self.outgrown_lease, None  # taken first: drop_outgrown may run meanwhile
        if outgrown is not None:
            outgrown.release(remove=remove_outgrown)
        if self.disk_lease is not None:
            self.disk_lease.release(remove=True)  # only its own lock folder (and the job's, once empty)
        self.arena, self.lease, self.kind, self.outgrown_lease, self.disk_lease = None, None, None, None, None


__all__ = ["EVENT_KIND", "MOUNTINFO", "StagingArea", "filesystem_type", "shared_between_hosts"]


def _short(nbytes: int, raced: bool = False) -> str:
    """How much room the memory directory lacks, as said to the user: "0.0 MiB short" was said when another
    process took the room between the check and this rank's allocation (two ranks starting together)."""
    said = f"{nbytes / 2**20:.1f} MiB short" if nbytes >= 2**20 // 10 else f"{max(nbytes, 1)} bytes short"
    return said + (" (another process took the room while these were allocated)" if raced else "")
