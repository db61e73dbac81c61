"""The shared-memory arena: reusable staging slots that double as the in-memory checkpoint tier.

Per job and rank, ``slots`` files under a tmpfs directory (``/dev/shm/trainguard/<job>/rank_00003/``)::

    slot_0.data            staging buffer (flat, aligned, same layout as the disk data file)
    slot_0.tag             the step whose bytes the buffer holds, or "writing"
    slot_0.manifest.json   present only while the slot holds a complete, checksummed copy of that step
    slot_0.retired.json    the manifest of a copy trimmed from the tier (outside ``memory.keep``): not listed,
                           but its bytes stay valid until the slot is reused, so a restore whose ranks agree on
                           that step can still read it from memory (see :func:`memory_manifests`)

Slots are allocated once, pre-faulted (``posix_fallocate`` + ``MAP_POPULATE``) and reused, and they are plain
tmpfs files, so they outlive a crashed worker; whoever owns the job's lifetime (the node agent's checkpoint
service, or the private persist process) removes them. Locking: the writer of a slot holds ``flock(LOCK_EX)`` on
its data file; the persist process and readers hold ``LOCK_SH``. No torch import (the persist process uses it).

Ownership: one writer per (job, rank). The writer holds an exclusive, non-blocking POSIX record lock
(``lockf``) on ``owner.lock`` in the rank's directory (an :class:`ArenaLease`) from its first save to its close;
only the lease holder may remove the directory. A record lock, unlike ``flock``, belongs to the process and is
not inherited by ``fork()``: a DataLoader worker forked from the trainer and outliving it never keeps the lease
from the trainer's successor. (Record locks do not exclude their own process, so a per-process registry does.) A process that only restores never takes the lease, so it can neither remove nor reuse another
process's slots. The kernel drops a crashed owner's flock, so its successor takes the lease and reuses the slots
(each under its slot lock, so a persist still reading a slot finishes first): the area is reclaimed, never torn.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import shutil
import threading
from dataclasses import dataclass
from typing import Iterator

from trainguard.checkpoint.errors import ArenaOwnedError, CorruptCheckpointError, StorageUnavailableError
from trainguard.checkpoint.fileio import storage_error
from trainguard.checkpoint.manifest import Manifest, complete_world_size

_RANK_RE = re.compile(r"^rank_(\d{5})\Z")
_SLOT_MANIFEST_RE = re.compile(r"^slot_(\d+)\.manifest\.json\Z")
_SLOT_RETIRED_RE = re.compile(r"^slot_(\d+)\.retired\.json\Z")
WRITING = "writing"


def rank_dir(shm_root: str, job: str, rank: int) -> str:
    """Arena directory of one rank."""
    return os.path.join(shm_root, job, f"rank_{rank:05d}")


def make_shared_root(root: str) -> None:
    """Creates the host-wide root of every job's arenas, when missing, world-writable with the sticky bit (as
    /dev/shm is, and as the node daemon makes it): made by the first launcher with the umask's 0755, it kept
    every other user's jobs on the host out of the in-memory tier until a reboot. An existing root is left as it
    is; a root that cannot be made is left to the arena's own error, which says what is wrong."""
    if os.path.isdir(root):
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
        os.mkdir(root)
    except OSError:
        return  # another process made it first (it chose the mode), or it cannot be made (said by the caller)
    try:
        os.chmod(root, 0o1777)
    except OSError:
        pass  # a filesystem without modes: this user's jobs work in it all the same


@dataclass
class SlotPaths:
    """Files of one staging slot."""

    data: str
    tag: str
    manifest: str

    @classmethod
    def of(cls, directory: str, index: int) -> "SlotPaths":
        base = os.path.join(directory, f"slot_{index}")
        return cls(base + ".data", base + ".tag", base + ".manifest.json")

    @property
    def retired(self) -> str:
        """Where the manifest goes when the copy leaves the tier but its bytes are still intact."""
        return self.manifest[: -len(".manifest.json")] + ".retired.json"


def retire_manifest(paths: SlotPaths) -> None:
    """Takes the slot's copy out of the memory tier's listing, keeping its manifest as the retired one.

    ``os.replace`` is atomic: a reader sees the copy either listed or retired, never neither.
    """
    try:
        os.replace(paths.manifest, paths.retired)
    except FileNotFoundError:
        pass


def drop_manifests(paths: SlotPaths) -> None:
    """Removes the slot's listed and retired manifests: its bytes are about to be overwritten."""
    for p in (paths.manifest, paths.retired):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def read_tag(paths: SlotPaths) -> str:
    """The slot's tag ("" when absent; damaged bytes are replaced, so a damaged tag names no step)."""
    try:
        with open(paths.tag, "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    # Decoded leniently: a tag of bytes that are not UTF-8 raised UnicodeDecodeError out of restore() and
    # save(), although such a slot is only a damaged copy, which every caller already skips.
    return raw.decode("utf-8", errors="replace").strip()


def write_tag(paths: SlotPaths, tag: str) -> None:
    """Sets the slot's tag (tmpfs: a rename is enough, there is nothing to fsync).

    On a tmpfs that another process filled, the new file finds no page: the tag is then written over the old
    one in place (its page is already there). A reader racing that write sees neither tag whole, so it takes
    the slot for one being rewritten, which is what it is.

    Raises:
        OSError: the tag cannot be written either way.
    """
    tmp = paths.tag + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(tag)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        _overwrite_tag(paths.tag, tag, exc)
        return
    os.replace(tmp, paths.tag)


def _overwrite_tag(path: str, tag: str, full: OSError) -> None:
    """Writes ``tag`` over the existing tag file in place; raises ``full`` when there is none."""
    try:
        os.unlink(path + ".tmp")
    except OSError:
        pass
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        raise full from None
    try:
        data = tag.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


class Slot:
    """One mapped staging slot (file descriptor kept open for locking).

    Args:
        paths: the slot's files.
        nbytes: minimum size.
        anonymous: back the data with an anonymous shared-memory file (``memfd_create``) instead of
            ``paths.data``: it is not bounded by the size of /dev/shm (only by the host's memory and cgroup), and
            the persist process opens it as ``/proc/<pid>/fd/<n>``. It dies with the last process holding it, so
            it is staging only, never a tier.
    """

    def __init__(self, paths: SlotPaths, nbytes: int, anonymous: str | None = None) -> None:
        self.paths = paths
        if anonymous is not None:
            try:
                self.fd = os.memfd_create(anonymous, getattr(os, "MFD_CLOEXEC", 1))
            except OSError as exc:
                raise storage_error(exc, f"create {nbytes} bytes of anonymous shared memory") from exc
            self.paths = SlotPaths(f"/proc/{os.getpid()}/fd/{self.fd}", paths.tag, paths.manifest)
        else:
            try:
                self.fd = os.open(paths.data, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:  # a tmpfs out of inodes (nr_inodes), too many open files...
                raise storage_error(exc, f"create the shared-memory slot {paths.data}") from exc
        try:
            st = os.fstat(self.fd)
            size = max(st.st_size, nbytes)
            if st.st_size < nbytes or st.st_blocks * 512 < size:
                # Allocates tmpfs pages once; later saves reuse them. A sparse file (its holes hold no memory)
                # is filled too: a write into a hole of a full tmpfs is a SIGBUS, this is an error.
                os.posix_fallocate(self.fd, 0, size)
            self.size = size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, size, flags=flags)
        except OSError as exc:
            os.close(self.fd)
            raise storage_error(exc, f"allocate {nbytes} bytes of shared memory at {self.paths.data}") from exc

    def lock(self, exclusive: bool) -> None:
        """Blocks until the slot's flock is held (exclusive for writers, shared for readers)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def unlock(self) -> None:
        """Releases the flock."""
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmaps and closes (the file stays)."""
        try:
            self.map.close()
        except BufferError:
            pass  # a tensor view still references it; the mapping dies with the process
        os.close(self.fd)


def _cut_back(data: str, size: int) -> None:
    """Truncates the slot file ``data`` back to ``size`` bytes, unless a reader holds its shared lock.

    A reader (the agent's memory tier verifying the copy, a restore, a persist) may have mapped the grown file;
    cutting it under that mapping raised SIGBUS in the reader on the next page past the new end. The memory
    stays allocated then, as it was before this fix for every slot, until the slot is reused or removed.
    """
    fd = os.open(data, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)  # drops the lock


class Arena:
    """The staging slots of one rank.

    Args:
        shm_root: tmpfs directory holding all jobs' arenas.
        job: job name.
        rank: this rank.
        slots: number of slots (>= 2).
        anonymous: keep the slots' data in anonymous shared memory (see :class:`Slot`); tags stay in the directory.
    """

    def __init__(self, shm_root: str, job: str, rank: int, slots: int, anonymous: bool = False) -> None:
        # Absolute: the slot paths travel to a persist process that may run in another working directory.
        self.dir = os.path.abspath(rank_dir(shm_root, job, rank))
        self.anonymous = anonymous
        self._name = f"trainguard-{job}-rank{rank}"
        self.nslots = max(2, slots)
        self.slots: list[Slot | None] = [None] * self.nslots
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as exc:
            raise storage_error(exc, f"create the shared-memory arena {self.dir}") from exc

    def paths(self, index: int) -> SlotPaths:
        """Files of slot ``index``."""
        return SlotPaths.of(self.dir, index)

    def get(self, index: int, nbytes: int) -> Slot:
        """Maps slot ``index`` with room for at least ``nbytes`` (grows it when needed)."""
        slot = self.slots[index]
        if slot is None or slot.size < nbytes:
            if slot is not None:
                slot.close()
                self.slots[index] = None  # a failed regrowth below must not leave a closed slot to close again
            slot = Slot(self.paths(index), nbytes, f"{self._name}-slot{index}" if self.anonymous else None)
            self.slots[index] = slot
        return slot

    def preallocate(self, nbytes: int) -> None:
        """Allocates and pre-faults every slot (cost paid once, before the first save), all or none.

        When a slot cannot be allocated (ranks of a node racing for a small /dev/shm), the memory taken is given
        back before raising: slot files holding no copy (no tag, no manifest) are removed, and those holding a
        predecessor's copy are cut back to their old size (the copy stays). Otherwise the loser of the race kept
        that memory, unused, for the rest of the run while staging elsewhere.

        Raises:
            StorageUnavailableError: a slot cannot be allocated.
        """
        before: dict[int, int | None] = {}
        if not self.anonymous:
            for i in range(self.nslots):
                try:
                    before[i] = os.stat(self.paths(i).data).st_size
                except FileNotFoundError:
                    before[i] = None
        try:
            for i in range(self.nslots):
                self.get(i, nbytes)
        except StorageUnavailableError:
            self.close()
            for i, size in before.items():
                paths = self.paths(i)
                holds_copy = bool(read_tag(paths)) or any(os.path.exists(p) for p in (paths.manifest, paths.retired))
                try:
                    if size is None or not holds_copy:
                        os.unlink(paths.data)
                    else:
                        _cut_back(paths.data, size)
                except OSError:
                    pass  # gone already; what it holds is freed with the arena
            raise

    def close(self, remove: bool = False) -> None:
        """Unmaps every slot; with ``remove`` also deletes this rank's arena directory."""
        for s in self.slots:
            if s is not None:
                s.close()
        self.slots = [None] * self.nslots
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


LEASE_NAME = "owner.lock"
_HELD: set[str] = set()  # lease files this process holds (record locks never conflict within one process)
_HELD_LOCK = threading.Lock()


class ArenaLease:
    """Exclusive ownership of one rank's arena directory (see module docstring).

    Args:
        directory: the rank's arena directory (created when missing).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.fd = -1
        self._key = ""

    @property
    def held(self) -> bool:
        """True while this process holds the lease."""
        return self.fd >= 0

    def acquire(self) -> None:
        """Takes the lease without waiting.

        Raises:
            ArenaOwnedError: another live process holds it (the message names its pid).
            StorageUnavailableError: the directory or lock file cannot be created.
        """
        if self.held:
            return
        path = os.path.join(self.directory, LEASE_NAME)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise storage_error(exc, f"create the staging area lock {path}") from exc
        key = os.path.realpath(path)
        with _HELD_LOCK:
            if key in _HELD:
                raise ArenaOwnedError(
                    f"this process ({os.getpid()}) already writes checkpoints for this job and rank "
                    f"({self.directory}) through another Checkpointer; close it first or use another job name")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise storage_error(exc, f"create the staging area lock {path}") from exc
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                err = exc
            else:
                err = None
                _HELD.add(key)
        if err is not None:
            exc = err
            try:
                owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise storage_error(exc, f"lock {path}") from exc
            raise ArenaOwnedError(
                f"process {owner} already writes checkpoints for this job and rank ({self.directory}); only one "
                "writer per (job, rank): give this process another job name, or only restore from it") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:
            # A full filesystem has no page for the pid, which only names the holder in another process's error
            # ("process ? already writes"); the lock is what excludes. Raised, the disk tier's writer lease made
            # the first save of a process started on a full disk raise ENOSPC into the training loop.
            pass
        self.fd, self._key = fd, key

    def release(self, remove: bool) -> None:
        """Gives the lease back; with ``remove`` first deletes the directory (only the holder may)."""
        if not self.held:
            return
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(self.directory))  # the job directory, once its last rank is gone
            except OSError:
                pass
        with _HELD_LOCK:
            os.close(self.fd)  # releases the record lock
            _HELD.discard(self._key)
        self.fd = -1


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem holding ``directory`` (or its parent)."""
    d = directory
    while d and not os.path.isdir(d):
        d = os.path.dirname(d)
    st = os.statvfs(d or "/")
    return st.f_bavail * st.f_frsize


def staging_shortfall(directory: str, nslots: int, nbytes: int) -> int:
    """Bytes missing on ``directory``'s filesystem to hold ``nslots`` slots of ``nbytes`` (0 when they fit).

    Slot files already there count for the memory allocated to them (they are reused, not reallocated): their
    allocated blocks, not their size, as a sparse file holds none of its holes.
    """
    have = 0
    for i in range(nslots):
        try:
            have += min(os.stat(SlotPaths.of(directory, i).data).st_blocks * 512, nbytes)
        except OSError:
            pass
    need = nslots * nbytes - have
    return max(0, need - free_bytes(directory))


def memory_manifests(shm_root: str, job: str, location: str | None = None,
                     cache: dict[str, tuple[int, int, Manifest]] | None = None, retired: bool = False,
                     ) -> dict[int, dict[int, tuple[SlotPaths, Manifest]]]:
    """Every valid in-memory copy: ``{step: {rank: (slot paths, manifest)}}``.

    Damaged manifests are skipped (a reader falls back to another tier). With ``location``, only copies written
    by a Checkpointer of that checkpoint location count: the arena is keyed by job name only, and two runs in
    different directories may share a job name on one host. ``cache`` (path -> (mtime ns, size, manifest)), kept
    by a caller that lists often (the node agent, several times a second), skips parsing unchanged manifests.
    ``retired``: also the copies trimmed from the tier whose slots were not reused yet (a restore's candidates,
    never the tier's listing); a listed copy of the same step and rank wins over a retired one.
    """
    out: dict[int, dict[int, tuple[SlotPaths, Manifest]]] = {}
    kinds = [(_SLOT_MANIFEST_RE, False)] + ([(_SLOT_RETIRED_RE, True)] if retired else [])
    for name_re, is_retired in kinds:
        listed = {(s, r) for s, ranks in out.items() for r in ranks}
        for _rank, d, slot in rank_files(os.path.join(shm_root, job), name_re):
            paths = SlotPaths.of(d, slot)
            try:
                man = read_manifest(paths.retired if is_retired else paths.manifest, cache)
            except (OSError, CorruptCheckpointError):
                continue
            if read_tag(paths) != str(man.step):
                continue
            if location is not None and man.location != location:
                continue
            if (man.step, man.rank) in listed:
                continue
            prev = out.get(man.step, {}).get(man.rank)
            if prev is None or man.created >= prev[1].created:  # a step saved twice: the newer copy wins
                out.setdefault(man.step, {})[man.rank] = (paths, man)
    return out


def rank_files(root: str, name_re: re.Pattern[str]) -> Iterator[tuple[int, str, int]]:
    """``(rank, rank folder, number)`` for every file in ``root/rank_NNNNN/`` whose name matches ``name_re``
    (its first group: the slot or step number). A missing ``root`` or an unreadable rank folder yields nothing:
    listings skip what they cannot read, like a damaged manifest."""
    try:
        rank_names = os.listdir(root)
    except OSError:
        return
    for rn in rank_names:
        m = _RANK_RE.match(rn)
        if not m:
            continue
        d = os.path.join(root, rn)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            nm = name_re.match(n)
            if nm:
                yield int(m.group(1)), d, int(nm.group(1))


_MANIFEST_CACHE_MAX = 4096  # entries; a cache past this is emptied rather than grown (listing stays correct)


def read_manifest(path: str, cache: dict[str, tuple[int, int, Manifest]] | None = None) -> Manifest:
    """The manifest at ``path``; with ``cache`` (path -> (mtime ns, size, manifest)), an unchanged file is not
    parsed again. Raises OSError or CorruptCheckpointError like :meth:`Manifest.from_json`."""
    if cache is None:
        with open(path, "rb") as f:
            return Manifest.from_json(f.read(), path)
    st = os.stat(path)
    hit = cache.get(path)
    if hit is not None and hit[0] == st.st_mtime_ns and hit[1] == st.st_size:
        return hit[2]
    with open(path, "rb") as f:
        man = Manifest.from_json(f.read(), path)
    if len(cache) > _MANIFEST_CACHE_MAX:
        cache.clear()
    cache[path] = (st.st_mtime_ns, st.st_size, man)
    return man


def memory_committed(shm_root: str, job: str, location: str | None = None,
                     retired: bool = False) -> list[tuple[int, int]]:
    """``(step, world_size)`` of steps whose every rank has an in-memory copy on this host, ascending.

    ``location``, ``retired``: as in :func:`memory_manifests`.
    """
    out = []
    for step, ranks in sorted(memory_manifests(shm_root, job, location, retired=retired).items()):
        ws = complete_world_size({r: m.world_size for r, (_, m) in ranks.items()})
        if ws:
            out.append((step, ws))
    return out


def live_writers(shm_root: str, job: str) -> dict[int, int]:
    """``{rank: pid}`` of the job's ranks under ``shm_root`` whose lease records a live process (read only: the
    pid a holder wrote into its ``owner.lock``; a stale pid of a dead holder is skipped).

    A hint for refusing a second run of the same job name up front, never for ownership: only taking the lease
    decides that.
    """
    out: dict[int, int] = {}
    try:
        names = os.listdir(os.path.join(shm_root, job))
    except OSError:
        return out
    for name in names:
        m = _RANK_RE.match(name)
        if m is None:
            continue
        rank = int(m.group(1))
        try:
            with open(os.path.join(shm_root, job, name, LEASE_NAME), "rb") as f:
                pid = int(f.read(32).strip() or b"0")
            if pid > 0 and pid != os.getpid():
                os.kill(pid, 0)
                out[rank] = pid
        except ProcessLookupError:
            continue
        except PermissionError:
            out[rank] = pid  # another user's live process
        except (OSError, ValueError):
            continue
    return out


def remove_job(shm_root: str, job: str) -> list[int]:
    """Deletes a job's arena (every rank, the replicas), except the ranks whose lease a live process holds.

    The arena is keyed by job name only: another run of the same name on this host (another checkpoint
    directory) may be writing there, and only a lease holder may remove a rank's area. Deleting it all made the
    first run to end take the other's memory tier with it, and that trainer's next save failed on a missing
    folder.

    Returns:
        The ranks left in place because a live process holds their lease.
    """
    root = os.path.join(shm_root, job)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    kept = []
    for name in names:
        path = os.path.join(root, name)
        m = _RANK_RE.match(name)
        if m is None:
            shutil.rmtree(path, ignore_errors=True)
            continue
        lease = ArenaLease(path)
        try:
            lease.acquire()
        except ArenaOwnedError:
            kept.append(int(m.group(1)))
            continue
        except StorageUnavailableError:
            shutil.rmtree(path, ignore_errors=True)  # no lock file can be made there: nobody writes it either
            continue
        lease.release(remove=True)
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
    return sorted(kept)


def open_locked(paths: SlotPaths) -> int:
    """Opens a slot's data file read-only under a shared flock (the writer cannot reuse the slot meanwhile);
    returns the fd (the caller closes it, which unlocks).

    No mapping: a reader checks the bytes with ``pread``
    (:func:`~trainguard.checkpoint.manifest.verify_file_checksums`). A mapping sized when the slot was opened
    raised SIGBUS in the reading process (the node agent) on a page past the end of a file cut short meanwhile.

    Raises:
        StorageUnavailableError: the slot cannot be opened or locked.
    """
    try:
        fd = os.open(paths.data, os.O_RDONLY)
    except OSError as exc:
        raise StorageUnavailableError(f"cannot open shared-memory slot {paths.data}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        os.close(fd)
        raise StorageUnavailableError(f"cannot lock shared-memory slot {paths.data}: {exc}") from exc
    return fd

