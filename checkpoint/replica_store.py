"""Other nodes' snapshots held in this node's memory (peer replicas), published only once verified.

Layout, next to the job's own arena (``<shm_root>/<job>/rank_NNNNN/``)::

    <shm_root>/<job>/replicas/rank_00003/step_000000000120.data            raw bytes, the arena's data layout
    <shm_root>/<job>/replicas/rank_00003/step_000000000120.manifest.json   present only for a complete copy
    <shm_root>/<job>/replicas/rank_00003/.partial-<uuid>                   a copy being received

Steps have 12 digits, more from 10**12 on (``step_1000000000000``), up to ``MAX_STEP`` (2**53-1), as the disk tier.

A copy arrives in pieces into a ``.partial-*`` file; :meth:`ReplicaWriter.commit` verifies every chunk against the
manifest's checksums, renames the data into place, then writes the manifest (temporary name + rename): the
manifest is the commit marker, so a sender or receiver killed mid-transfer leaves at most a ``.partial-*`` file
that nothing lists (and the next store on that root removes). One copy per rank is kept: the one published
last (its node's newest snapshot; a higher step held before it belongs to a run the job went back from).

Memory is bounded: ``max_bytes`` caps what replicas may hold, copies still being received included (each
reserves its size when it begins, under the store's lock, and gives it back when it is published or dropped), and
a new copy first evicts older replicas (other ranks' oldest steps first), never this node's own snapshots, which
live in the arena's rank directories and are not this store's to touch. When the tmpfs itself is short of room
for the copy plus ``reserve_bytes`` (kept free for the node's own next snapshots), replicas are evicted too. A
copy that would not fit even with every other replica evicted is refused before anything is evicted.

No torch import (the agent uses it).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import shutil
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from trainguard.checkpoint.arena import (SlotPaths, drop_manifests, free_bytes, make_shared_root, rank_files,
                                        read_manifest, read_tag, write_tag)
from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError
from trainguard.checkpoint.manifest import Manifest, verify_checksums
from trainguard.steps import MAX_STEP

log = logging.getLogger(__name__)

# 12 digits, more without a leading zero from step 10**12 on (as the disk tier names its folders): only 12 were
# taken, so a job counting steps in tokens had every copy past 10**12 refused and no replica at all.
_STEP_RE = re.compile(r"^step_(\d{12}|[1-9]\d{12,})\.manifest\.json\Z")
_RANK_DIR_RE = re.compile(r"^rank_\d{5}\Z")
_SLOT_FILE_RE = re.compile(r"^slot_(\d+)\.(?:data|tag|manifest\.json|retired\.json)\Z")
#: Highest rank a copy can be filed under (``rank_NNNNN``): a name with more digits is listed by nothing, so its
#: memory would be held outside the bound until the job ends. Steps go to :data:`MAX_STEP`, as on every tier.
MAX_RANK = 99_999


def remove_stale_partials(directory: str) -> None:
    """Removes the ``.partial-*`` staging files in ``directory`` that no live writer holds.

    A writer keeps an exclusive ``flock`` on its file until it publishes or drops it, and the kernel releases it
    when the writer dies (kill -9 included), so a file whose lock can be taken is a dead writer's. Removing every
    staging file instead cut the live transfers of another agent of the job on this host (they share the
    folders): their publish then found no file.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for n in names:
        if not n.startswith(".partial-"):
            continue
        path = os.path.join(directory, n)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer's
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
        finally:
            os.close(fd)


def _make_folders(path: str, tries: int = 20) -> None:
    """``os.makedirs(path, exist_ok=True)``, again when a folder vanishes while it is made: another agent of the
    job on this host removes the store's folders while they are empty, at its start, so a parent could go before
    the next folder was made under it (FileNotFoundError), or ``path`` between its mkdir's "exists" and the check
    that it is a folder (FileExistsError). Two agents starting together: one died of either, found by a
    black-box review."""
    for attempt in range(tries):
        try:
            os.makedirs(path, exist_ok=True)
            return
        except (FileNotFoundError, FileExistsError):
            if attempt == tries - 1 or os.path.lexists(path) and not os.path.isdir(path):
                raise


def _lock_dir(directory: str, wait: bool) -> int:
    """An fd holding ``flock(LOCK_EX)`` on ``directory`` (closing it unlocks); -1 when ``wait`` is False and
    another holder has it (or the folder is gone). flock, not the store's thread lock: the lock must hold across
    processes, and two open descriptions exclude each other within one process too."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        if wait:
            raise
        return -1  # gone (the job's replicas removed): nothing there to lock or remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return -1
    except BaseException:
        os.close(fd)
        raise
    return fd


class ReplicaRefusedError(CheckpointError):
    """A replica does not fit (memory bound or tmpfs full) or failed verification; the message says which."""


class ReplicaTornError(ReplicaRefusedError):
    """A replica's stream ended before all its bytes arrived (the sender cut it, or is broken)."""


def check_numbers(manifest: Manifest) -> None:
    """Refuses a received manifest whose numbers no copy can be filed or sized by (a peer's bug, or a sender
    crafting them: the manifest's own checksum proves nothing about its sender).

    Raises:
        ReplicaRefusedError: rank, step, size or chunk size is not an integer in range, or the checksums are not
            a list of strings (the message names which).
    """
    for name, value, low, high in (("rank", manifest.rank, 0, MAX_RANK), ("step", manifest.step, 0, MAX_STEP),
                                   ("data_bytes", manifest.data_bytes, 0, None),
                                   ("chunk_bytes", manifest.chunk_bytes, 1, None)):
        if type(value) is not int or value < low or (high is not None and value > high):
            raise ReplicaRefusedError(f"replica manifest has {name} {value!r}: must be an integer from {low}"
                                      + (f" to {high}" if high is not None else ""))
    if not (isinstance(manifest.chunks, list) and all(isinstance(c, str) for c in manifest.chunks)):
        raise ReplicaRefusedError("replica manifest's chunks must be a list of checksums")


@dataclass(frozen=True)
class Replica:
    """One complete replica: its files and its manifest."""

    rank: int
    step: int
    data: str
    manifest_path: str
    manifest: Manifest

    @property
    def nbytes(self) -> int:
        """Bytes of memory the copy holds."""
        return self.manifest.data_bytes


class ReplicaStore:
    """The replicas of one job on this node (see the module docstring).

    Args:
        shm_root: the arena root (tmpfs).
        job: job name.
        max_bytes: cap on the bytes all replicas may hold (0: no replicas at all).
        reserve_bytes: free tmpfs space a new replica must leave for this node's own snapshots.
        location: the job's checkpoint location (:attr:`CheckpointConfig.location
            <trainguard.checkpoint.config.CheckpointConfig.location>`); None: copies of every location count.

    With a ``location``, copies another run of the job's name wrote (another checkpoint location; its arena
    outlives it for the daemon's TTL) are neither listed, served nor reported, and a new copy never removes them
    as "the run the job went back from": they are evicted first when room is needed, as the memory they hold
    counts against ``max_bytes``. Listed, the coordinator planned restores from another run's state.
    """

    def __init__(self, shm_root: str, job: str, max_bytes: int, reserve_bytes: int = 0,
                 location: str | None = None) -> None:
        self.root = os.path.join(shm_root, job, "replicas")
        self.location = location
        self.max_bytes = max_bytes
        self.reserve_bytes = reserve_bytes
        self._lock = threading.Lock()
        self._manifests: dict[str, tuple[int, int, Manifest]] = {}  # parsed manifests, by path and mtime
        # Bytes of the copies being received, by partial file: checked against ``max_bytes`` with the published
        # ones, so pushes arriving together cannot each pass the bound alone and together hold more.
        self._reserved: dict[str, int] = {}
        #: replicas evicted to make room since start (a metric).
        self.evicted = 0
        make_shared_root(shm_root)  # the replica receiver may be the first of the host's jobs to use it
        _make_folders(self.root)
        for d, _, names in os.walk(self.root):  # a receiver killed mid-transfer left these
            for n in names:
                if n.endswith(".tmp"):
                    try:
                        os.unlink(os.path.join(d, n))
                    except OSError:
                        pass
            remove_stale_partials(d)
            if d != self.root:
                self._remove_unpublished(d, names)
        # A fetch into the arena killed mid-transfer (the agent was, on a node coming back) left its staging
        # file, allocated to the copy's full size, in the rank's folder: only a later fetch of that same rank
        # removed it, so with the rank restored from local memory or disk it held tmpfs memory for the job's
        # life, leaving the workers' own snapshots less room.
        job_dir = os.path.dirname(self.root)
        try:
            names = os.listdir(job_dir)
        except FileNotFoundError:
            names = []  # removed, being empty, by another agent of the job (see _make_folders)
        for n in names:
            if _RANK_DIR_RE.match(n):
                remove_stale_partials(os.path.join(job_dir, n))

    def _remove_unpublished(self, directory: str, names: list[str]) -> None:
        """Removes what a publisher killed mid-way left in a rank folder: a data file renamed into place whose
        manifest was never written (nothing lists it, so it held its memory until the job ended) and the
        manifest's temporary file. Under the folder's lock, which a live publisher holds throughout."""
        fd = _lock_dir(directory, wait=False)
        if fd < 0:
            return
        try:
            have = set(os.listdir(directory))
            for n in names:
                orphan = n.endswith(".data") and n[:-len(".data")] + ".manifest.json" not in have
                if orphan or ".manifest.json.tmp-" in n:
                    try:
                        os.unlink(os.path.join(directory, n))
                    except OSError:
                        pass
        finally:
            os.close(fd)

    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"rank_{rank:05d}")

    @staticmethod
    def _base(directory: str, step: int) -> str:
        return os.path.join(directory, f"step_{step:012d}")

    # -- listing ---------------------------------------------------------------------------------------------
    def replicas(self) -> list[Replica]:
        """Every complete replica of this store's location (damaged manifests skipped), oldest step first."""
        return [r for r in self._all() if self._ours(r)]

    def _ours(self, r: Replica) -> bool:
        return self.location is None or r.manifest.location == self.location

    def _all(self) -> list[Replica]:
        """Every complete replica, whatever its location, oldest step first."""
        out = []
        for rank, d, step in rank_files(self.root, _STEP_RE):
            base = self._base(d, step)
            try:
                man = read_manifest(base + ".manifest.json", self._manifests)
            except CorruptCheckpointError as exc:
                self._drop_unreadable(d, base, exc)
                continue
            except OSError:
                continue  # gone (evicted, or replaced right now): nothing to list
            r = Replica(rank, man.step, base + ".data", base + ".manifest.json", man)
            if self._short_file(r):
                continue
            out.append(r)
        return sorted(out, key=lambda r: (r.step, r.rank))

    def _drop_unreadable(self, directory: str, base: str, why: Exception) -> None:
        """Removes the copy at ``base`` whose manifest is damaged (unparseable, or numbers out of range).

        Unlisted, its data file kept its memory until the job ended, outside ``max_bytes`` too (only listed
        copies count). A published manifest is never half-written (it is renamed into place whole), so a damaged
        one is no write in progress; but a publisher replaces a copy at the same names in steps (manifest out,
        data in, manifest in), so the removal happens under the rank folder's lock that publishers hold
        throughout, and only if the manifest is still damaged then. Busy: left to the next listing.
        """
        fd = _lock_dir(directory, wait=False)
        if fd < 0:
            return
        try:
            try:
                with open(base + ".manifest.json", "rb") as f:
                    Manifest.from_json(f.read(), base + ".manifest.json")
                return  # a publisher replaced it with a good one meanwhile
            except FileNotFoundError:
                return
            except (OSError, CorruptCheckpointError):
                pass
            log.warning("the replica in %s has a damaged manifest (%s); its files are removed", base, why)
            for p in (base + ".manifest.json", base + ".data"):  # the manifest first, as everywhere
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("cannot remove %s: %s", p, exc)
                    return
            self._manifests.pop(base + ".manifest.json", None)
        finally:
            os.close(fd)  # releases the lock

    def _short_file(self, r: Replica) -> bool:
        """Whether ``r``'s data file lost bytes since it was published (truncated in the tmpfs: a tool, a user,
        a full disk's cleanup): such a copy cannot be served, so it is not listed, and it is removed.

        A published copy's data file has its full size before its manifest exists (the receiver allocates it
        whole, and renames it into place before writing the manifest). Listed, it was reported as held, the
        coordinator planned a replacement's restore from it, and every fetch failed on the serving side (mmap
        past the end of the file: "UNKNOWN: Exception iterating responses") until the next push replaced it.
        """
        try:
            size = os.stat(r.data).st_size
        except FileNotFoundError:
            size = -1
        except OSError:
            return False
        if size >= r.manifest.data_bytes:
            return False
        # Checked again under the rank folder's lock, which publishers hold across their steps: a copy of the
        # same step published again meanwhile (its manifest and data replaced after this listing read the old
        # manifest) is another copy, and a smaller one is not short. Busy: not listed now, the next listing sees.
        fd = _lock_dir(os.path.dirname(r.data), wait=False)
        if fd < 0:
            return True
        try:
            try:
                with open(r.manifest_path, "rb") as f:
                    now = Manifest.from_json(f.read(), r.manifest_path)
                size = os.stat(r.data).st_size
            except FileNotFoundError:
                now, size = r.manifest, -1
            except (OSError, CorruptCheckpointError):
                return True  # the next listing deals with a damaged manifest
            if size >= now.data_bytes:
                return True  # republished meanwhile: listed by the next listing, with its new manifest
            log.warning("the replica of rank %d step %d in %s is damaged: its data file has %d of %d bytes; "
                        "removed", r.rank, r.step, os.path.dirname(r.data), max(size, 0), now.data_bytes)
            self._remove(r)
            return True
        finally:
            os.close(fd)

    def newest(self, rank: int, min_step: int = -1) -> Replica | None:
        """The newest complete replica of ``rank`` of at least ``min_step``, or None."""
        mine = [r for r in self.replicas() if r.rank == rank and r.step >= min_step]
        return mine[-1] if mine else None

    def copy_of(self, rank: int, step: int) -> Replica | None:
        """The complete replica of ``rank`` at exactly ``step``, or None."""
        return next((r for r in self.replicas() if r.rank == rank and r.step == step), None)

    def holds(self, manifest: Manifest) -> bool:
        """Whether this exact copy (rank, step, size and every chunk checksum) is already held, complete."""
        r = self.newest(manifest.rank, manifest.step)
        return r is not None and r.step == manifest.step and r.manifest.data_bytes == manifest.data_bytes \
            and r.manifest.chunks == manifest.chunks

    def bytes_held(self) -> int:
        """Bytes of memory all complete replicas hold (other locations' too)."""
        return sum(r.nbytes for r in self._all())

    def bytes_reserved(self) -> int:
        """Bytes reserved by the copies being received now."""
        with self._lock:
            return sum(self._reserved.values())

    # -- writing ---------------------------------------------------------------------------------------------
    def begin(self, manifest: Manifest) -> "ReplicaWriter":
        """Makes room for and starts receiving a copy of ``manifest``'s rank and step, reserving its bytes until
        the writer publishes or drops it.

        Raises:
            ReplicaRefusedError: it cannot fit within ``max_bytes`` (with the copies being received now) or the
                tmpfs even after evicting every other complete replica (the message names the bound).
        """
        check_numbers(manifest)
        need = manifest.data_bytes
        what = f"the replica of rank {manifest.rank} step {manifest.step} ({need} bytes)"
        with self._lock:
            if self.max_bytes <= 0:
                raise ReplicaRefusedError(f"{what} refused: this node holds no replicas (its replica memory bound "
                                          f"is 0)")
            if need > self.max_bytes:
                raise ReplicaRefusedError(f"{what} is over the replica memory bound of {self.max_bytes} bytes")
            held = self._all()
            reserved = sum(self._reserved.values())
            # Evict other runs' copies first, then the oldest replicas of other ranks and other copies of this
            # rank, until the new one fits.
            victims = sorted((r for r in held if not (r.rank == manifest.rank and r.step == manifest.step)),
                             key=lambda r: self._ours(r))
            total = sum(r.nbytes for r in held)
            evictable = sum(v.nbytes for v in victims)
            # Refused before evicting anything when evicting every victim would not make room either (copies
            # being received hold the rest): evicting first left other nodes without their copy for nothing,
            # and their senders count it as held until their next snapshot.
            if total - evictable + reserved + need > self.max_bytes or \
                    free_bytes(self.root) + evictable < need + self.reserve_bytes:
                raise self._no_room(what, total, reserved)
            while victims and (total + reserved + need > self.max_bytes or self._short(need)):
                v = victims.pop(0)
                self._remove(v)
                total -= v.nbytes
                self.evicted += 1
            if total + reserved + need > self.max_bytes or self._short(need):
                raise self._no_room(what, total, reserved)
            d = self._rank_dir(manifest.rank)
            os.makedirs(d, exist_ok=True)
            partial = os.path.join(d, f".partial-{uuid.uuid4().hex}")
            self._reserved[partial] = need
            try:
                return ReplicaWriter(manifest, partial, self._publish, release=self._release)
            except BaseException:
                self._reserved.pop(partial, None)
                raise

    def _no_room(self, what: str, total: int, reserved: int) -> ReplicaRefusedError:
        mib = 1 << 20
        return ReplicaRefusedError(
            f"no room for {what}: replicas hold {total / mib:.1f} and copies being received reserve "
            f"{reserved / mib:.1f} of {self.max_bytes / mib:.1f} MiB, and the tmpfs has "
            f"{free_bytes(self.root) / mib:.1f} MiB free with {self.reserve_bytes / mib:.1f} MiB reserved for own "
            "snapshots; give this node a larger /dev/shm, or run it with --replica-memory-mib 0 so that it is "
            "nobody's buddy")

    def _release(self, partial: str) -> None:
        """Gives back the reservation of a copy that was dropped."""
        with self._lock:
            self._reserved.pop(partial, None)

    def _short(self, need: int) -> bool:
        return free_bytes(self.root) < need + self.reserve_bytes

    def _remove(self, r: Replica) -> None:
        for p in (r.manifest_path, r.data):  # the manifest first: the copy stops being listed at once
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def drop_damaged(self, replica: Replica, opened: os.stat_result) -> bool:
        """Removes ``replica``, found damaged while it was read, when its data file is still the one that was read
        (``opened``: its stat then); returns whether it did (or it was gone already).

        Left in place a damaged copy stayed listed: its node kept reporting it and the coordinator kept planning
        restores from it until the buddy's next push replaced it. Under the store's lock, which every replacement
        of a copy at the same paths takes: a good copy that landed there since the damaged one was opened is kept.
        """
        with self._lock:
            try:
                now = os.stat(replica.data)
            except FileNotFoundError:
                now = None  # removed under the reader: its manifest (if left) lists nothing servable
            except OSError:
                return False
            if now is not None and (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
                return False
            for p in (replica.manifest_path, replica.data):  # the manifest first: unlisted at once
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("cannot remove the damaged replica file %s: %s", p, exc)
                    return False
            return True

    def _publish(self, manifest: Manifest, partial: str) -> Replica:
        with self._lock:
            self._reserved.pop(partial, None)  # from here on the copy counts as published (or is gone)
            d = self._rank_dir(manifest.rank)
            base = self._base(d, manifest.step)
            # The folder's lock, across processes (two agents of a job on one host share it): a listing finding
            # a damaged manifest removes the copy's files under it, never between the steps below.
            lock = _lock_dir(d, wait=True)
            try:
                try:
                    os.unlink(base + ".manifest.json")  # a copy of the same step already here: replaced
                except FileNotFoundError:
                    pass
                os.replace(partial, base + ".data")
                # Unique: two agents of one job on one host share this folder, and a shared temp name made one's
                # rename fail on the other's (FileNotFoundError).
                tmp = f"{base}.manifest.json.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                with open(tmp, "wb") as f:
                    f.write(manifest.to_json())
                os.replace(tmp, base + ".manifest.json")  # the commit marker, last
            finally:
                os.close(lock)
            for r in self.replicas():
                # One copy per rank: the one its node pushed last, which is that node's newest snapshot. A higher
                # step held here is not newer but abandoned: the job went back to an older step (restored from
                # disk when memory could not serve every rank). Kept, it was served to a fetch asking for the
                # new run's step and counted by the restore plan, which could pick it over the new run's steps
                # or, once the new run reached that step on some ranks, mix the two runs in one restore.
                if r.rank == manifest.rank and r.step != manifest.step:  # (of this location only)
                    self._remove(r)
            return Replica(manifest.rank, manifest.step, base + ".data", base + ".manifest.json", manifest)

    def remove_all(self) -> None:
        """Deletes every replica (the job is over)."""
        shutil.rmtree(self.root, ignore_errors=True)


class ReplicaWriter:
    """One copy being received into ``partial``, published by ``publish(manifest, partial)`` once verified (see
    :meth:`ReplicaStore.begin` and :func:`arena_writer`); use as a context manager to abort on error.
    ``release(partial)`` is called once if the copy is dropped instead (its memory reservation ends)."""

    def __init__(self, manifest: Manifest, partial: str, publish: Callable[[Manifest, str], Any],
                 release: Callable[[str], None] | None = None) -> None:
        self.manifest, self.partial, self._publish, self._release = manifest, partial, publish, release
        self.received = 0
        self.fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # Held until the copy is published or dropped (or this process dies): marks the file as a live
        # transfer's to :func:`remove_stale_partials`.
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.posix_fallocate(self.fd, 0, max(manifest.data_bytes, 1))
        except OSError as exc:
            self.abort()
            raise ReplicaRefusedError(f"cannot allocate {manifest.data_bytes} bytes for a replica: {exc}") from exc

    def write(self, offset: int, data: bytes) -> None:
        """Writes one piece at ``offset``.

        Raises:
            ReplicaRefusedError: the piece lies outside the copy.
        """
        if offset < 0 or offset + len(data) > self.manifest.data_bytes:
            raise ReplicaRefusedError(f"piece at {offset} (+{len(data)}) is outside the copy's "
                                      f"{self.manifest.data_bytes} bytes")
        os.pwrite(self.fd, data, offset)
        self.received += len(data)

    def commit(self) -> Any:
        """Verifies every chunk, then publishes the copy atomically.

        Raises:
            ReplicaRefusedError: bytes missing or a chunk fails its checksum (nothing is published).
        """
        try:
            if self.received < self.manifest.data_bytes:
                raise ReplicaTornError(f"replica of rank {self.manifest.rank} step {self.manifest.step} is torn: "
                                          f"{self.received} of {self.manifest.data_bytes} bytes arrived")
            with mmap.mmap(self.fd, self.manifest.data_bytes, prot=mmap.PROT_READ) as m:
                view = memoryview(m)
                try:
                    verify_checksums(view, self.manifest, f"replica of rank {self.manifest.rank} step "
                                                          f"{self.manifest.step}")
                finally:
                    view.release()
        except CorruptCheckpointError as exc:
            self.abort()
            raise ReplicaRefusedError(str(exc)) from exc
        except BaseException:
            self.abort()
            raise
        try:
            published = self._publish(self.manifest, self.partial)
        except BaseException:
            self.abort()  # a partial file nothing lists would hold its memory until the next start
            raise
        os.close(self.fd)  # only now: closed before the rename, the file looked like a dead writer's
        self.fd = -1
        return published

    def abort(self) -> None:
        """Drops the partial copy (and its memory reservation)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.partial)
        except FileNotFoundError:
            pass
        if self._release is not None:
            self._release(self.partial)

    def __enter__(self) -> "ReplicaWriter":
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def arena_writer(shm_root: str, job: str, manifest: Manifest) -> ReplicaWriter:
    """Receives a copy of ``manifest``'s rank straight into this node's arena, as a memory-tier copy.

    A replacement node fetches its slot's snapshots from a buddy this way before its workers start, so they
    restore from local memory as after a plain process restart. The copy goes to a slot holding no complete copy
    (else the one holding the oldest step); on commit the data is renamed over the slot's file, the tag set and
    the slot manifest written last, exactly as the persist process leaves a slot.

    Raises:
        ReplicaRefusedError: no room for it (the tmpfs is full), or its manifest's numbers are out of range.
    """
    check_numbers(manifest)
    d = os.path.join(shm_root, job, f"rank_{manifest.rank:05d}")
    os.makedirs(d, exist_ok=True)
    remove_stale_partials(d)  # an earlier fetch killed mid-transfer

    def age(i: int) -> int:
        p = SlotPaths.of(d, i)
        tag = read_tag(p)
        return int(tag) if tag.isdigit() and os.path.exists(p.manifest) else -1

    # Every slot the rank's Checkpointer made (``memory.keep + 1`` of them), at least the two of the default.
    slots = sorted({0, 1} | {int(m.group(1)) for n in os.listdir(d) if (m := _SLOT_FILE_RE.match(n))})
    # A slot listing this very step (this node's own copy, which the scan found damaged, so the plan sent the
    # rank to a peer) is the one replaced: left listed beside the fetched copy, the restore's listing took
    # whichever had the later creation time (or, equal, came last in the folder), and took the damaged one as
    # often as not, falling back to disk with a good copy in memory.
    same = [i for i in slots if age(i) == manifest.step]
    index = same[0] if same else min(slots, key=age)

    def publish(man: Manifest, partial: str) -> SlotPaths:
        paths = SlotPaths.of(d, index)
        drop_manifests(paths)  # a retired manifest of the old bytes, too
        os.replace(partial, paths.data)
        write_tag(paths, str(man.step))
        tmp = paths.manifest + ".tmp"
        with open(tmp, "wb") as f:
            f.write(man.to_json())
        os.replace(tmp, paths.manifest)
        for i in slots:  # any other slot still naming this step holds the damaged copy: out of the listing
            other = SlotPaths.of(d, i)
            if i != index and read_tag(other) == str(man.step):
                drop_manifests(other)
        return paths

    if free_bytes(d) < manifest.data_bytes:
        raise ReplicaRefusedError(f"no room in {d} for rank {manifest.rank}'s copy of step {manifest.step} "
                                  f"({manifest.data_bytes} bytes)")
    return ReplicaWriter(manifest, os.path.join(d, f".partial-{uuid.uuid4().hex}"), publish)
