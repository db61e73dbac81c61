"""Persistent tiers (local disk, fsspec remote) behind one small contract, and the file-based commit protocol.

Layout under ``<root>/<job>/`` (identical on disk and remote)::

    step_000000000120/rank_00000.data            raw aligned tensor bytes
    step_000000000120/rank_00000.manifest.json   manifest (see .manifest)
    step_000000000120/rank_00000.commit          commit marker, written last, after data+manifest are durable
    COMMITTED.json                               per-job commit record: newest complete step

A step is *complete* when the markers of ranks ``0..world_size-1`` all exist. The rank that completes a step
(whichever is last) rewrites the commit record. Readers trust markers, so a crash between the last marker and
the record loses nothing. No torch import: the persist process uses this module.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, Callable

from trainguard.checkpoint.errors import CheckpointConfigError, CheckpointError, StorageUnavailableError
from trainguard.checkpoint.fileio import (
    PendingFile,
    Throttle,
    atomic_write,
    fsync_dir,
    read_file,
    remove_stale_tmp,
    storage_error,
    write_file_from,
)
from trainguard.checkpoint.manifest import complete_world_size

log = logging.getLogger(__name__)

COMMIT_RECORD = "COMMITTED.json"
# 12 digits, more without a leading zero for steps from 10**12 on (tokens seen): those folders were written but
# never listed, so a restore resumed from an older step and retention never removed them.
_STEP_RE = re.compile(r"^step_(\d{12}|[1-9]\d{12,})\Z")
_MARKER_RE = re.compile(r"^rank_(\d{5})\.commit\Z")
#: stray files named like a step already reported by this process (the persist process lists at every save).
_warned_strays: set[str] = set()


def _skip_stray(path: str) -> None:
    """Warns once per process about a plain file named like a step, which every listing skips."""
    if path not in _warned_strays:
        _warned_strays.add(path)
        log.warning("ignoring %s: a file named like a checkpoint step, not a step folder; remove or rename it", path)


def check_job_name(job: str) -> str:
    """Returns ``job`` when it can name the job's folder under a checkpoint root.

    Raises:
        CheckpointError: the name is empty, holds ``/`` or starts with ``.``: the folder would not be a direct
            child of the root (``../evil``) or would be hidden from job listings; it holds a control character
            (a NUL raised a bare ValueError from the first file call); or it is named like a step folder
            (``step_000000000001``): a job folder so named was taken for a step of the root by every ``ckpt``
            command.
    """
    if not isinstance(job, str) or not job or "/" in job or job.startswith("."):
        raise CheckpointError(f"job name {job!r} is not a valid directory name (it is empty, holds '/' or starts "
                              "with '.'); use letters, digits, -_")
    if any(ord(c) < 32 or ord(c) == 127 for c in job):
        raise CheckpointError(f"job name {job!r} holds a control character; use letters, digits, -_")
    if is_step_dirname(job):
        raise CheckpointError(f"job name {job!r} is named like a step folder, which the `ckpt` commands would take "
                              "for a step; use another name")
    return job


def step_dirname(step: int) -> str:
    """Directory name of a step."""
    return f"step_{step:012d}"


def is_step_dirname(name: str) -> bool:
    """Whether ``name`` is named like a step directory (:func:`step_dirname`)."""
    return bool(_STEP_RE.match(name))


def data_name(rank: int) -> str:
    """Data file name of a rank."""
    return f"rank_{rank:05d}.data"


def manifest_name(rank: int) -> str:
    """Manifest file name of a rank."""
    return f"rank_{rank:05d}.manifest.json"


def marker_name(rank: int) -> str:
    """Commit marker name of a rank."""
    return f"rank_{rank:05d}.commit"


class StepStore(ABC):
    """One persistent tier holding steps of one job (see module docstring for the layout)."""

    #: tier name reported to users: ``"disk"`` or ``"remote"``.
    tier: str = ""

    @abstractmethod
    def describe(self) -> str:
        """Human-readable location (path or URL)."""

    @abstractmethod
    def check_writable(self) -> None:
        """Raises StorageUnavailableError when the tier cannot be written."""

    @abstractmethod
    def write_data(self, step: int, rank: int, source: Any, nbytes: int, chunk_bytes: int,
                   throttle: Throttle | None) -> None:
        """Durably writes a rank's data file; ``source`` is a memoryview (disk) or a local file path (remote)."""

    @abstractmethod
    def write_small(self, step: int | None, name: str, data: bytes) -> None:
        """Atomically writes a small file in a step directory (or the job directory when step is None)."""

    @abstractmethod
    def read_small(self, step: int | None, name: str) -> bytes:
        """Reads a small file; raises OSError/FileNotFoundError when missing."""

    @abstractmethod
    def list_steps(self) -> list[int]:
        """Every step directory present (complete or not), ascending."""

    @abstractmethod
    def list_names(self, step: int) -> list[str]:
        """File names inside a step directory."""

    @abstractmethod
    def remove_step(self, step: int) -> None:
        """Deletes a step directory (markers first, so a half-deleted step never looks complete)."""

    def local_data_path(self, step: int, rank: int) -> str | None:
        """Path of the data file on the local filesystem, or None when the tier is remote."""
        return None

    @abstractmethod
    def fetch_data(self, step: int, rank: int, dest: str) -> None:
        """Copies a rank's data file to a local path."""

    # ------------------------------------------------------------------ commit protocol
    def markers(self, step: int) -> dict[int, dict[str, Any]]:
        """Parsed commit markers of a step, by rank (unreadable markers are skipped)."""
        out = {}
        for name in self.list_names(step):
            m = _MARKER_RE.match(name)
            if not m:
                continue
            try:
                marker = json.loads(self.read_small(step, name))
            except (OSError, ValueError):
                continue
            if isinstance(marker, dict) and _int_field(marker, "world_size") > 0:
                out[int(m.group(1))] = marker
        return out

    def is_complete(self, step: int) -> tuple[bool, int]:
        """Whether every rank committed ``step``; returns ``(complete, world_size)``."""
        ws = complete_world_size({r: _int_field(m, "world_size") for r, m in self.markers(step).items()})
        return ws > 0, ws

    def uncommit_rank(self, step: int, rank: int) -> None:
        """Removes this rank's marker before its files of ``step`` are rewritten (a step saved again)."""
        if marker_name(rank) in self.list_names(step):
            self.delete_small(step, marker_name(rank))

    @abstractmethod
    def delete_small(self, step: int, name: str) -> None:
        """Deletes one file of a step directory (durably)."""

    def rank_steps_above(self, step: int, rank: int) -> list[int]:
        """The steps above ``step`` holding ``rank``'s commit marker."""
        return [s for s in self.list_steps() if s > step and marker_name(rank) in self.list_names(s)]

    def abandon_above(self, step: int, rank: int) -> list[int]:
        """Removes ``rank``'s files (its commit marker first) from every step above ``step``: this rank is saving
        ``step``, so the job went back to an older step and those copies belong to the run it left. Kept, the
        old copy of a rank killed before its next save met the other ranks' new copies of that step, and the
        step counted as complete: a restore loaded two runs' states as one step. A step folder left empty (the
        last rank's files gone) goes too: kept, ``ckpt ls`` listed the abandoned steps as incomplete for good,
        and ``ckpt gc`` never removed them (newer than the newest commit), on disk and on a remote alike.

        Returns:
            The steps this rank's files were removed from.
        """
        gone = []
        for s in self.list_steps():
            if s <= step or marker_name(rank) not in (names := self.list_names(s)):
                continue
            self.delete_small(s, marker_name(rank))
            for name in (manifest_name(rank), data_name(rank)):
                if name in names:
                    try:
                        self.delete_small(s, name)
                    except FileNotFoundError:
                        pass
            gone.append(s)
        for s in gone:
            self.discard_rank(s, rank)
        return gone

    @abstractmethod
    def discard_rank(self, step: int, rank: int) -> object:
        """Removes what ``rank`` wrote of ``step`` (unless its copy is committed), then the step folder when
        nothing else is in it."""

    def commit_rank(self, step: int, rank: int, world_size: int, manifest_digest: str) -> bool:
        """Writes this rank's commit marker, then the commit record if the step is now complete.

        Returns:
            True when the step is complete (every rank committed).
        """
        marker = json.dumps({"step": step, "rank": rank, "world_size": world_size,
                             "manifest_xxh3": manifest_digest, "time": time.time()}).encode()
        self.write_small(step, marker_name(rank), marker)
        complete, _ = self.is_complete(step)
        if complete:
            self._update_record(step, world_size)
        return complete

    def _update_record(self, step: int, world_size: int) -> None:
        record = self.record()
        # A record naming a higher step that is no longer complete (the job went back, or a run with
        # ``checkpoint.overwrite`` replaced that run's steps) is replaced too: kept, ``ckpt ls`` named a step
        # that no longer existed as the newest committed one.
        if record is None or step >= record["step"] or not self.is_complete(record["step"])[0]:
            self.write_small(None, COMMIT_RECORD, json.dumps(
                {"step": step, "world_size": world_size, "time": time.time()}).encode())

    def committed_steps(self) -> list[tuple[int, int]]:
        """``(step, world_size)`` of every complete step, ascending."""
        out = []
        for s in self.list_steps():
            ok, ws = self.is_complete(s)
            if ok:
                out.append((s, ws))
        return out

    def record(self) -> dict[str, Any] | None:
        """The per-job commit record, or None when it is missing or damaged.

        Damaged includes valid JSON of the wrong shape (``[1]``, ``{"step": "x"}``): the record is only a hint
        (readers trust the markers), so it must never fail a commit. Before, such a record raised in every
        commit: the persist process failed each step and retention never ran, and ``ckpt ls`` printed a
        traceback.
        """
        try:
            record = json.loads(self.read_small(None, COMMIT_RECORD))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or _int_field(record, "step") < 0:
            log.warning("ignoring the damaged commit record %s/%s; the step markers decide", self.describe(),
                        COMMIT_RECORD)
            return None
        return record

    def retain(self, keep: int, protect: int | Collection[int] | None = None) -> list[int]:
        """Deletes all but the ``keep`` newest complete steps, and torn steps older than the oldest kept one.

        Args:
            keep: retention K (>= 1).
            protect: steps never to delete (the one just written; on the disk tier, steps still being uploaded
                from it).

        Returns:
            The deleted steps.
        """
        complete = [s for s, _ in self.committed_steps()]
        if len(complete) <= keep:
            return []
        kept = complete[-keep:]
        oldest_kept = kept[0]
        spared = {protect} if isinstance(protect, int) else set(protect or ())
        removed = []
        for s in self.list_steps():
            if s < oldest_kept and s not in spared:
                self.remove_step(s)
                removed.append(s)
        return removed


def _int_field(obj: dict[str, Any], key: str) -> int:
    """``obj[key]`` when it is an int (not a bool), else -1: marker and record files are read, not trusted."""
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _lock_unused(directory: str) -> tuple[list[int], int] | None:
    """Takes an exclusive flock on every file of a step folder, held until the caller closes the descriptors.

    Returns:
        ``(descriptors, bytes allocated to the files)``, or None when a file is in use (a reader's shared flock,
        a writer's exclusive one) and the folder must stay. Where flock is unsupported, files count as unused.
    """
    fds: list[int] = []
    allocated = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return fds, 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or not a plain file of ours
        fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            for f in fds:
                os.close(f)
            return None
        except OSError:
            pass  # no flock here (or NFS, where an exclusive lock needs write access): as retention, unchecked
        allocated += os.fstat(fd).st_blocks * 512
    return fds, allocated


class LocalStore(StepStore):
    """The local disk tier (fsync'ed temp file + rename + directory fsync for every file).

    Args:
        root: checkpoint root directory.
        job: job name (a subdirectory of root).
        fsync: fsync files and directories (off voids crash safety; benchmarks only).

    Raises:
        CheckpointError: the job name is not a valid folder name (see :func:`check_job_name`).
    """

    tier = "disk"

    def __init__(self, root: str, job: str, fsync: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.job_dir = os.path.join(self.root, check_job_name(job))
        self.fsync = fsync

    def describe(self) -> str:
        return self.job_dir

    def writable_problem(self) -> tuple[str, int] | None:
        """Why the tier could not be written, found without writing anything; None when it looks writable.

        Returns:
            ``(one-line message, errno)`` for a read-only filesystem, a missing permission or a full disk.
        """
        d = self.job_dir
        while d and not os.path.isdir(d):
            if os.path.islink(d) and not os.path.exists(d):
                return (f"the checkpoint directory {self.job_dir} lies under {d}, a symbolic link to "
                        f"{os.readlink(d)}, which does not exist (a filesystem not mounted?); saves will fail: mount "
                        "it or fix the link", errno.ENOENT)
            if os.path.lexists(d):
                # checkpoint_dir="model.pt": every save failed, and the restore raised a bare NotADirectoryError.
                return (f"the checkpoint directory {self.job_dir} lies under {d}, which is a file, not a directory; "
                        "saves will fail: give a directory (a folder for checkpoints), not a file", errno.ENOTDIR)
            d = os.path.dirname(d)
        d = d or "/"
        try:
            st = os.statvfs(d)
        except OSError as exc:
            return str(storage_error(exc, f"inspect the checkpoint directory {self.job_dir}")), exc.errno or 0
        if st.f_flag & os.ST_RDONLY:
            return (f"the checkpoint directory {self.job_dir} is on a read-only filesystem; saves will fail "
                    "(restores still work): remount it read-write or choose another directory", errno.EROFS)
        if not os.access(d, os.W_OK | os.X_OK):
            return (f"the checkpoint directory {self.job_dir} is not writable by this process (permission denied); "
                    "saves will fail (restores still work): fix the permissions", errno.EACCES)
        if st.f_bavail == 0:
            return (f"the filesystem of {self.job_dir} is full; saves will fail (restores still work): free space "
                    "or lower the retention", errno.ENOSPC)
        return None

    def check_writable(self) -> None:
        try:
            os.makedirs(self.job_dir, exist_ok=True)
            probe = os.path.join(self.job_dir, f".probe.{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as exc:
            raise storage_error(exc, f"write the checkpoint directory {self.job_dir}") from exc

    def _step_dir(self, step: int | None, create: bool = False) -> str:
        d = self.job_dir if step is None else os.path.join(self.job_dir, step_dirname(step))
        if create and not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            if self.fsync:
                fsync_dir(os.path.dirname(d))
        return d

    def _in_step_dir(self, step: int | None, fn: Callable[[str], Any]) -> Any:
        """``fn(step folder)``, the folder created first. Another rank's failed save of the same step removes the
        folder when it finds it empty (:meth:`discard_rank`), so it may vanish between its creation and ``fn``
        creating a file in it: created again then."""
        for attempt in range(3):
            d = self._step_dir(step, create=True)
            try:
                return fn(d)
            except FileNotFoundError:
                if attempt == 2 or os.path.isdir(d):
                    raise

    def write_data(self, step: int, rank: int, source: Any, nbytes: int, chunk_bytes: int,
                   throttle: Throttle | None) -> None:
        self._in_step_dir(step, lambda d: write_file_from(os.path.join(d, data_name(rank)), source, nbytes,
                                                          chunk_bytes, throttle, self.fsync))

    def begin_data(self, step: int, rank: int) -> PendingFile:
        """Opens a rank's data file for writing under a temporary name (see :class:`PendingFile`).

        Raises:
            OSError: the step directory or the file cannot be created.
        """
        return self._in_step_dir(step, lambda d: PendingFile(os.path.join(d, data_name(rank)), self.fsync))

    def discard_rank(self, step: int, rank: int) -> bool:
        """After a failed save of ``step``: removes ``rank``'s data file and manifest of it, then the step folder
        if nothing else is in it. Left behind, a full disk's failed save kept an empty or half-written
        ``step_<n>/`` that ``ckpt ls`` listed as an incomplete step and ``ckpt gc`` never removed (it is newer
        than the newest commit), and its data file took the room the next save needed.

        Nothing is removed once the rank's commit marker exists (its copy is complete), nor other ranks' files.

        Returns:
            True when the step folder is gone.
        """
        d = self._step_dir(step)
        names = self.list_names(step)
        if marker_name(rank) in names:
            return False
        for name in (data_name(rank), manifest_name(rank)):
            if name in names:
                try:
                    os.unlink(os.path.join(d, name))
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(d)  # only when empty: another rank's files (or temporary files being written) keep it
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if self.fsync:
            try:
                fsync_dir(self.job_dir)
            except OSError:
                pass  # the removal is only less durable: a folder that comes back is empty, as before
        return True

    def remove_stale_tmp(self, rank: int) -> list[str]:
        """Removes the temporary files of ``rank``'s files (data, manifest, commit marker) that writers killed
        mid-write left in the step folders (see :func:`~trainguard.checkpoint.fileio.remove_stale_tmp`: a live
        writer's stays). Only the rank's own: the other ranks' may be written from other hosts, where a flock
        is not always shared (NFS ``local_lock``, Lustre ``localflock``).

        Returns:
            The paths removed, relative to the job's folder.
        """
        targets = {data_name(rank), manifest_name(rank), marker_name(rank)}
        removed = []
        for step in self.list_steps():
            removed += [os.path.join(step_dirname(step), name)
                        for name in remove_stale_tmp(self._step_dir(step), targets)]
        return removed

    def write_small(self, step: int | None, name: str, data: bytes) -> None:
        self._in_step_dir(step, lambda d: atomic_write(os.path.join(d, name), data, self.fsync))

    def read_small(self, step: int | None, name: str) -> bytes:
        return read_file(os.path.join(self._step_dir(step), name))  # a FIFO there is an error, not a hang

    def delete_small(self, step: int, name: str) -> None:
        os.unlink(os.path.join(self._step_dir(step), name))
        if self.fsync:
            fsync_dir(self._step_dir(step))

    def list_steps(self) -> list[int]:
        try:
            entries = list(os.scandir(self.job_dir))
        except FileNotFoundError:
            return []
        steps = []
        for e in entries:
            if m := _STEP_RE.match(e.name):
                if e.is_dir():
                    steps.append(int(m.group(1)))
                else:
                    _skip_stray(e.path)
        return sorted(steps)

    def list_names(self, step: int) -> list[str]:
        try:
            return os.listdir(self._step_dir(step))
        except FileNotFoundError:
            return []

    def remove_step(self, step: int) -> None:
        d = self._step_dir(step)
        for name in self.list_names(step):
            if _MARKER_RE.match(name):
                try:
                    os.unlink(os.path.join(d, name))
                except OSError:
                    pass
        if self.fsync and os.path.isdir(d):
            fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)

    def make_room(self, needed: int, protect: Collection[int] = ()) -> list[int]:
        """Frees ``needed`` bytes on a full filesystem by removing the oldest steps older than the newest complete
        one (complete or torn: retention would remove those torn steps too once the complete steps before them
        are gone), oldest first, and only as many as it takes.

        Never removed: the newest complete step (a restore's first choice), steps newer than it (being written),
        ``protect`` (the step being written, steps an upload still reads), and steps with a file in use: a
        restore holds a shared flock on the data files it reads, a writer an exclusive one on its temporary file
        (a flock is not seen across hosts on every filesystem, as for :func:`remove_stale_tmp`). When removing
        every candidate would still not free ``needed`` bytes, nothing is removed.

        Args:
            needed: bytes the failed write needs (data file plus its small files).
            protect: steps never to remove.

        Returns:
            The removed steps, ascending; empty when nothing could make room.

        Raises:
            OSError: the filesystem cannot be inspected.
        """
        complete = [s for s, _ in self.committed_steps()]
        if len(complete) < 2:
            return []
        st = os.statvfs(self.job_dir)
        free = st.f_bavail * st.f_frsize
        spared = set(protect)
        plan: list[tuple[int, list[int]]] = []
        for s in self.list_steps():
            if free >= needed or s >= complete[-1]:
                break
            if s in spared:
                continue
            held = _lock_unused(self._step_dir(s))
            if held is None:
                continue
            plan.append((s, held[0]))
            free += held[1]
        try:
            if free < needed:
                return []
            for s, _ in plan:
                self.remove_step(s)
            return [s for s, _ in plan]
        finally:
            for _, fds in plan:
                for fd in fds:
                    os.close(fd)

    def local_data_path(self, step: int, rank: int) -> str | None:
        return os.path.join(self._step_dir(step), data_name(rank))

    def fetch_data(self, step: int, rank: int, dest: str) -> None:
        shutil.copyfile(self.local_data_path(step, rank), dest)


def _missing_backend(url: str, exc: ImportError) -> str:
    """The message for a remote URL whose fsspec backend cannot be imported: fsspec's own advice ("Install s3fs
    to access S3"), the package(s) to install, and the Python that lacks them."""
    import fsspec
    from fsspec.registry import known_implementations

    packages = []
    for part in url.split("::"):  # a chained URL (simplecache::s3://...) names several protocols
        protocol = part.split("://", 1)[0].lower() if "://" in part else part.lower()
        known = known_implementations.get(protocol)
        if known:
            top = known["class"].split(".", 1)[0]
            try:
                fsspec.get_filesystem_class(protocol)
            except ImportError:
                packages.append(top)
    hint = f"pip install {' '.join(dict.fromkeys(packages))}" if packages else "install the package it names"
    return (f"remote checkpoint storage {url}: {exc} (its fsspec backend is not installed in {sys.executable}); "
            f"{hint} wherever checkpoints are saved or restored, or use another checkpoint.remote.url")


class FsspecStore(StepStore):
    """The remote tier through any fsspec filesystem (uploads whole files; the marker goes last).

    Args:
        url: fsspec URL of the checkpoint root.
        job: job name.
        storage_options: keyword arguments for the filesystem.
        fresh: a new filesystem object (and connection), not fsspec's cached one for this URL.

    Raises:
        StorageUnavailableError: the filesystem cannot be created (unknown protocol, unreachable server...).
        CheckpointConfigError: the URL's protocol needs a package that is not installed here (names it).
        CheckpointError: the job name is not a valid folder name (see :func:`check_job_name`).
    """

    tier = "remote"

    def __init__(self, url: str, job: str, storage_options: dict[str, Any] | None = None,
                 fresh: bool = False) -> None:
        import fsspec

        check_job_name(job)
        self.url = url.rstrip("/")
        options = dict(storage_options or {})
        if fresh:
            # fsspec hands out one cached filesystem per URL and options; after a failure it may hold a dead
            # connection (an FTP control connection the restarted server dropped: EOFError for ever after).
            options["skip_instance_cache"] = True
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as exc:
            # The protocol's backend package is not installed in this Python (s3:// without s3fs). Reported as
            # "cannot reach" it was taken for an outage: the tier was retried for ever and the job ran without it.
            raise CheckpointConfigError(_missing_backend(url, exc)) from exc
        except Exception as exc:  # fsspec raises anything: ConnectionRefusedError, ValueError...
            raise StorageUnavailableError(f"cannot reach remote checkpoint storage {url}: {exc!r:.200} "
                                          "(check the URL, credentials and network)") from exc
        self.job_dir = f"{root.rstrip('/')}/{job}"

    def describe(self) -> str:
        return f"{self.url}/{self.job_dir.rsplit('/', 1)[-1]}"

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # A full NFS mount (file://) or a quota: the network hint sent users to the wrong place.
                hint = "the remote storage is full or over quota; free space or lower checkpoint.remote.keep"
            else:
                hint = "check the URL, credentials and network"
            raise StorageUnavailableError(f"cannot {what} on remote {self.url}: {exc!r:.200} ({hint})") from exc

    def check_writable(self) -> None:
        probe = f"{self.job_dir}/.probe.{os.getpid()}"
        self._guard("write", lambda: (self.fs.makedirs(self.job_dir, exist_ok=True), self.fs.pipe_file(probe, b"x"),
                                      self.fs.rm(probe)))

    def _path(self, step: int | None, name: str | None = None) -> str:
        d = self.job_dir if step is None else f"{self.job_dir}/{step_dirname(step)}"
        return d if name is None else f"{d}/{name}"

    def write_data(self, step: int, rank: int, source: Any, nbytes: int, chunk_bytes: int,
                   throttle: Throttle | None) -> None:
        dest = self._path(step, data_name(rank))

        def upload() -> None:
            self.fs.makedirs(self._path(step), exist_ok=True)
            with open(source, "rb") as src, self.fs.open(dest, "wb") as out:
                while True:
                    buf = src.read(chunk_bytes)
                    if not buf:
                        break
                    out.write(buf)
                    if throttle is not None:
                        throttle.account(len(buf))

        self._guard(f"upload {dest}", upload)

    def write_small(self, step: int | None, name: str, data: bytes) -> None:
        def put() -> None:
            self.fs.makedirs(self._path(step), exist_ok=True)
            self.fs.pipe_file(self._path(step, name), data)

        self._guard(f"write {name}", put)

    def delete_small(self, step: int, name: str) -> None:
        self._guard(f"delete {name}", lambda: self.fs.rm(self._path(step, name)))

    def read_small(self, step: int | None, name: str) -> bytes:
        return self._guard(f"read {name}", lambda: self.fs.cat_file(self._path(step, name)))

    def list_steps(self) -> list[int]:
        try:
            entries = self._guard("list", lambda: self.fs.ls(self.job_dir, detail=True))
        except FileNotFoundError:
            return []
        steps = set()
        for e in entries:
            if m := _STEP_RE.match(e["name"].rstrip("/").rsplit("/", 1)[-1]):
                # An object store may hold an object and a prefix of one name: the prefix is the step.
                if e.get("type") == "file":
                    _skip_stray(f"{self.url}/{self.job_dir.rsplit('/', 1)[-1]}/{m.group(0)}")
                else:
                    steps.add(int(m.group(1)))
        return sorted(steps)

    def list_names(self, step: int) -> list[str]:
        try:
            entries = self._guard("list", lambda: self.fs.ls(self._path(step), detail=False))
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def remove_step(self, step: int) -> None:
        for name in self.list_names(step):
            if _MARKER_RE.match(name):
                self._guard("delete", lambda n=name: self.fs.rm(self._path(step, n)))
        try:
            self._guard("delete", lambda: self.fs.rm(self._path(step), recursive=True))
        except FileNotFoundError:
            pass

    def fetch_data(self, step: int, rank: int, dest: str) -> None:
        self._guard("download", lambda: self.fs.get_file(self._path(step, data_name(rank)), dest))

    def discard_rank(self, step: int, rank: int) -> None:
        """After a failed upload of ``step``: removes what this rank wrote of it (files are written in place here,
        so a full remote kept a truncated data file, an empty manifest or an empty commit marker), then the step
        folder when nothing else is in it (only where the filesystem has folders: an empty prefix of an object
        store is gone already). A valid commit marker of the rank means its copy is complete: nothing is removed.

        Raises:
            StorageUnavailableError: the remote cannot be listed or written.
        """
        names = self.list_names(step)
        if marker_name(rank) in names and rank in self.markers(step):
            return
        for name in (marker_name(rank), manifest_name(rank), data_name(rank)):  # the marker first, as always
            if name in names:
                try:
                    self.delete_small(step, name)
                except FileNotFoundError:
                    pass
        if not self.list_names(step):
            try:
                self.fs.rmdir(self._path(step))
            except Exception:  # noqa: BLE001 - not empty (another rank), no folders here, or gone: all fine
                pass
