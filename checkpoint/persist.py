"""The persist phase of one snapshot: checksum, publish in memory, write to disk, upload, commit, retain.

:func:`persist_snapshot` runs inside the persist process (the agent-owned checkpoint service or a private one),
reading the snapshot straight from its shared-memory slot: tensors never travel through a pipe, only the small
JSON request below does. No torch import.

Request (a JSON object)::

    {"op": "persist", "id": 7, "job": "demo", "rank": 0, "world_size": 2, "step": 120,
     "slot": "/dev/shm/trainguard/demo/rank_00000/slot_1",       # prefix of .data/.tag/.manifest.json
     "slot_data": "/proc/4711/fd/12",                             # optional: data elsewhere (memfd staging)
     "manifest": "{...}",                         # Manifest JSON without chunk checksums (or the decoded object)
     "memory": true, "disk": {"root": "/ckpt", "keep": 3, "fsync": true} | null,
     "remote": {"url": "s3://b/p", "keep": 5, "storage_options": {},
                "retry_s": 30.0, "backoff_s": 0.0, "retry_in_s": 0.0} | null,  # the worker's back-off state
     "bandwidth_mib_s": 0}

Each outcome is reported as a JSON object through ``report``: ``{"op": "tier", "id", "step", "tier", "ok":
true}`` or ``{"op": "tier", ..., "ok": false, "error": "one line", "errno": 28}`` (with ``"unreachable": true``
for the failure that begins a remote outage, ``"quiet": true`` for a step skipped or failed during it: one health
event per outage); ``{"op": "slot_free", "id",
"step"}`` once the staging slot may be reused (the memory and disk tiers are done: an upload reads the disk
copy), and ``{"op": "released", "id", "step"}`` once every tier has reported. With an
:class:`~trainguard.checkpoint.uploads.UploadQueue` the upload runs there, after ``slot_free``, so a slow or
hung remote never holds a slot (and so never blocks ``save()``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Any, Callable, Iterator

import xxhash

from trainguard.checkpoint.arena import SlotPaths, read_tag
from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError, StorageUnavailableError
from trainguard.checkpoint.fileio import PendingFile, Throttle, storage_error
from trainguard.checkpoint.manifest import Manifest, TensorEntry
from trainguard.checkpoint.storage import FsspecStore, LocalStore, manifest_name
from trainguard.checkpoint.uploads import UNREACHABLE, InlineUploads, UploadQueue

log = logging.getLogger(__name__)

Report = Callable[[dict[str, Any]], None]


def _manifest_from(d: dict[str, Any] | str) -> Manifest:
    if isinstance(d, str):
        # The trainer sends the manifest's own JSON text: decoding it there to nest it as an object cost the
        # training thread a second JSON pass per save (seconds at 40,000 tensors). Its checksum is checked here.
        return Manifest.from_json(d.encode(), "the persist request's manifest")
    d = dict(d)
    d.pop("self_xxh3", None)
    d["tensors"] = [TensorEntry(**t) for t in d["tensors"]]
    return Manifest(**d)


def _errno_of(exc: BaseException) -> int:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return int(exc.errno)
        exc = exc.__cause__  # type: ignore[assignment]
    return 0


def persist_snapshot(req: dict[str, Any], report: Report,
                     uploads: UploadQueue | InlineUploads | None = None) -> None:
    """Persists one snapshot described by ``req`` (see module docstring); never raises for storage failures.

    Args:
        req: the persist request.
        report: receives one JSON-ready dict per outcome.
        uploads: where the remote upload goes once the slot is free; None uploads here, before returning, with
            no back-off (an :class:`InlineUploads` uploads here too, before returning, but backs off).
    """
    rid, step = req.get("id"), int(req["step"])
    paths = SlotPaths(req.get("slot_data") or req["slot"] + ".data", req["slot"] + ".tag",
                      req["slot"] + ".manifest.json")
    upload: Callable[[], None] | None = None
    try:
        fd = os.open(paths.data, os.O_RDONLY)
    except OSError as exc:
        report({"op": "tier", "id": rid, "step": step, "tier": "memory", "ok": False,
                "error": f"staging slot {paths.data} vanished: {exc}", "errno": exc.errno or 0})
        report({"op": "slot_free", "id": rid, "step": step})
        report({"op": "released", "id": rid, "step": step})
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if read_tag(paths) != str(step):
            # The slot was reused (its writer died and a successor took it): nothing consistent to persist.
            log.warning("skipping persist of step %d: staging slot %s now holds %r", step, paths.data,
                        read_tag(paths))
            report({"op": "tier", "id": rid, "step": step, "tier": "memory", "ok": False,
                    "error": f"staging slot of step {step} was reused before it was persisted", "errno": 0})
            return
        # Read with pread, never mapped: a slot is a plain tmpfs file that anyone may truncate (an operator, a
        # cleanup; a truncation ignores the lock), and a page past the new end of a mapping raised SIGBUS, which
        # killed the persist process (and in the agent's service, every job's persists). A cut slot now fails
        # the step's tiers, with no file written.
        slot = _SlotData(fd, f"staging slot {paths.data} of step {step}")
        uploading = uploads.steps_of(req.get("job")) if uploads is not None else set()
        try:
            upload = _persist_locked(req, slot, paths, report, uploading)
        except CorruptCheckpointError as exc:
            log.error("checkpoint step %d rank %s: not persisted: %s", step, req.get("rank"), exc)
            for tier in ("memory", "disk") if req.get("disk") else ("memory",):
                report({"op": "tier", "id": rid, "step": step, "tier": tier, "ok": False, "errno": 0,
                        "error": f"not persisted: {exc}"})
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        report({"op": "slot_free", "id": rid, "step": step})
        if upload is None:
            report({"op": "released", "id": rid, "step": step})
    if upload is None:
        return

    def run(ongoing: bool = False) -> object:
        try:
            return upload(False, ongoing)
        finally:
            report({"op": "released", "id": rid, "step": step})

    if uploads is None:
        run()
        return

    def drop(newer: int) -> None:
        if newer == step:
            # The same step saved again: its new copy is uploaded instead, so nothing is missing from the remote.
            # Quiet: a health event for it sent the operator after a slow remote that was not the cause.
            log.info("step %d rank %s: upload replaced by a new save of the same step", step, req.get("rank"))
            report({"op": "tier", "id": rid, "step": step, "tier": "remote", "ok": False, "errno": 0, "quiet": True,
                    "error": f"not uploaded: step {step} was saved again before this upload started; that save "
                             "is uploaded instead"})
        else:
            log.warning("step %d rank %s: upload dropped, step %d came before it started (the remote is slower "
                        "than the saves)", step, req.get("rank"), newer)
            report({"op": "tier", "id": rid, "step": step, "tier": "remote", "ok": False, "errno": 0,
                    "error": f"not uploaded: step {newer} was saved before this upload could start (the remote "
                             "is slower than the save interval, or hung); the newer step is uploaded instead"})
        report({"op": "released", "id": rid, "step": step})

    remote = req["remote"]

    def defer(retry_in: float, first: bool = False) -> None:
        # Quiet: the failure that began the outage sent the health event; one per step flooded the operator. But
        # each rank hears of it once (``first``): in a service shared by the node's ranks another rank's upload
        # may have found it, and this rank's Session.errors and log said nothing while its steps stayed local.
        report({"op": "tier", "id": rid, "step": step, "tier": "remote", "ok": False, "errno": 0,
                **({"unreachable": True} if first else {"quiet": True}),
                "error": f"not uploaded: the remote {remote.get('url')} was unreachable moments ago and is not "
                         f"dialed again for {retry_in:.1f} s (checkpoint.remote.retry_s); the step is on the "
                         "local tiers, and the newest step is uploaded once the remote answers"})
        report({"op": "released", "id": rid, "step": step})

    uploads.put((req.get("job"), req.get("rank"), remote.get("url")), step, run, drop, defer=defer,
                catch_up=lambda ongoing: upload(True, ongoing), remote=remote.get("url"),
                retry_s=float(remote.get("retry_s") or 30.0), down_for=float(remote.get("retry_in_s") or 0.0),
                backoff=float(remote.get("backoff_s") or 0.0))


class _SlotData:
    """The staging slot's bytes, read with ``pread`` in cache-sized pieces (see :func:`persist_snapshot`)."""

    PIECE = 1 << 20

    def __init__(self, fd: int, where: str) -> None:
        self.fd, self.where = fd, where
        self._buf = bytearray(self.PIECE)

    def pieces(self, start: int, end: int) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` as successive views of one reused buffer (each valid until the next).

        Raises:
            CorruptCheckpointError: the slot ends before ``end`` (cut short since the snapshot was taken).
        """
        view = memoryview(self._buf)
        try:
            at = start
            while at < end:
                n = os.preadv(self.fd, [view[:min(self.PIECE, end - at)]], at)
                if n == 0:
                    raise CorruptCheckpointError(f"{self.where} ends at byte {at}, inside the snapshot: it was "
                                                 "cut short (truncated) before it was persisted")
                piece = view[:n]
                try:
                    yield piece
                finally:
                    piece.release()
                at += n
        finally:
            view.release()

    def checksums(self, data_bytes: int, chunk_bytes: int) -> list[str]:
        """Chunk checksums of ``[0, data_bytes)`` (same digests as :func:`chunk_checksum` on each chunk)."""
        out = []
        for o in range(0, data_bytes, chunk_bytes):
            h = xxhash.xxh3_64()
            for piece in self.pieces(o, min(o + chunk_bytes, data_bytes)):
                h.update(piece)
            out.append(h.hexdigest())
        return out


def _persist_locked(req: dict[str, Any], view: _SlotData, paths: SlotPaths, report: Report,
                    uploading: set[int]) -> Callable[[], None] | None:
    """The memory and disk tiers of one snapshot; returns its remote upload to run once the slot is free
    (None: no remote tier). Disk retention spares ``uploading``: steps whose uploads still read their disk copy."""
    rid, step, rank, ws = req.get("id"), int(req["step"]), int(req["rank"]), int(req["world_size"])
    man = _manifest_from(req["manifest"])
    man.created = time.time()
    throttle = Throttle(float(req.get("bandwidth_mib_s") or 0) * (1 << 20))
    disk = req.get("disk")
    local: LocalStore | None = None
    disk_error: BaseException | None = None
    chunks: list[str] = []
    evicted: list[int] = []  # older steps removed to make room on a full disk: reported with the disk outcome
    if disk:
        # One pass over the snapshot: each chunk is hashed right before it is written (cache-hot), and the data
        # reaches the page cache before the memory tier is published; the fsync comes after that.
        local = LocalStore(disk["root"], man.job, fsync=bool(disk.get("fsync", True)))
        try:
            local.uncommit_rank(step, rank)
            abandoned = local.abandon_above(step, rank)
            if abandoned:
                log.info("rank %d went back to step %d: its copies of steps %s on %s are removed (a run the job "
                         "left)", rank, step, abandoned, local.describe())
            _remove_stale_tmp(local, rank)
            full: OSError | None = None
            try:
                pending = _write_data(local, step, rank, view, man, throttle, chunks)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                full = exc.with_traceback(None)
            if full is not None:
                if not _make_room(local, step, rank, _room_needed(man), int(disk.get("keep", 3)), uploading,
                                  evicted):
                    raise full
                chunks.clear()
                pending = _write_data(local, step, rank, view, man, throttle, chunks)
        except OSError as exc:
            exc.with_traceback(None)
            disk_error = storage_error(exc, f"write step {step} to {local.describe()}")
            disk_error.__cause__ = exc  # keeps the errno for the event kind (disk_full...)
            pending = None
    else:
        pending = None
    if len(chunks) != man.n_chunks:
        chunks = view.checksums(man.data_bytes, man.chunk_bytes)
    man.chunks = chunks
    man_json = man.to_json()
    digest = json.loads(man_json)["self_xxh3"]

    def outcome(tier: str, exc: BaseException | None, evicted: list[int] | None = None,
                catch_up: bool = False, ongoing: bool = False) -> None:
        msg: dict[str, Any] = {"op": "tier", "id": rid, "step": step, "tier": tier, "ok": exc is None}
        if evicted:
            msg["evicted"] = sorted(evicted)
        if tier == "remote" and exc is not None and _unreachable(exc):
            msg["unreachable"] = True  # the worker's listings back off as well
            if ongoing:
                msg["quiet"] = True  # the outage's first failure said it: one health event per outage
        if catch_up:
            # The step was reported (not uploaded) when the remote was backing off: this is its late upload.
            msg["catch_up"] = True
        if exc is not None:
            msg["error"] = str(exc).splitlines()[0] if str(exc) else repr(exc)
            msg["errno"] = _errno_of(exc)
            log.error("checkpoint step %d rank %d: %s tier failed: %s", step, rank, tier, msg["error"])
        report(msg)

    if req.get("memory"):
        tmp = paths.manifest + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(man_json)
            os.replace(tmp, paths.manifest)
        except OSError as exc:
            # A /dev/shm filled by another process: only the memory tier fails. Before, the error left this
            # function and the disk copy, already written, was never committed.
            err = storage_error(exc.with_traceback(None), f"publish step {step} in memory")
            err.__cause__ = exc  # keeps the errno for the event kind
            outcome("memory", err)
        else:
            outcome("memory", None)

    disk_ok = False
    if disk and local is not None:
        try:
            if disk_error is not None:
                raise disk_error
            try:
                assert pending is not None
                pending.commit()  # fsync, rename, directory fsync
                try:
                    _write_commit(local, step, rank, ws, man_json, digest)
                except OSError as exc:
                    # The data fitted but its manifest or marker did not. Without room made here the step stayed
                    # torn, newer than the newest complete one, which make_room never removes: on a disk of ~2.5
                    # steps a 2-rank job then failed every later step (steps 15-99 of 100 measured).
                    if exc.errno != errno.ENOSPC or not _make_room(
                            local, step, rank, len(man_json) + _SMALL_FILES_BYTES, int(disk.get("keep", 3)),
                            uploading, evicted):
                        raise
                    _write_commit(local, step, rank, ws, man_json, digest)
            except OSError as exc:
                raise storage_error(exc, f"write step {step} to {local.describe()}") from exc
            disk_ok = True
            outcome("disk", None, evicted)
            try:
                local.retain(int(disk.get("keep", 3)), protect={step, *uploading})
            except OSError as exc:
                log.warning("disk retention of %s failed: %s", local.describe(), exc)
        except CheckpointError as exc:
            _discard(local, step, rank)
            outcome("disk", exc)

    remote = req.get("remote")
    if not (remote and remote.get("url")):
        return None

    def upload(catch_up: bool, ongoing: bool = False) -> object:
        """Uploads the disk copy; returns :data:`UNREACHABLE` when the remote could not be reached (``ongoing``:
        it was unreachable before this try)."""
        # Reads only the disk copy (and the manifest JSON): the staging slot may hold the next snapshot by now.
        store: FsspecStore | None = None
        failed: BaseException | None = None
        try:
            if not disk_ok or local is None:
                raise StorageUnavailableError(f"step {step} was not written to local disk, so it cannot be "
                                              "uploaded; fix the disk tier first")
            if catch_up and not os.path.exists(local.local_data_path(step, rank)):
                return None  # removed from the disk meanwhile (retention after a newer step): nothing to send
            # Connecting anew after a failure: fsspec's cached filesystem may hold the dead connection.
            store = FsspecStore(remote["url"], man.job, remote.get("storage_options") or {},
                                fresh=catch_up or ongoing)
            src = local.local_data_path(step, rank)
            foreign_above = remote.get("foreign_above")
            if foreign_above is not None:
                foreign = store.rank_steps_above(max(step, int(foreign_above)), rank)
                if foreign:
                    # Uploading would remove them below (a run that did not restore: another run's newer steps).
                    raise CheckpointError(
                        f"step {step} not uploaded: {store.describe()} holds rank {rank}'s checkpoints of higher "
                        f"steps {', '.join(map(str, foreign[:4]))}{' ...' if len(foreign) > 4 else ''} of an "
                        "earlier run of this job, which this upload would delete, and this run did not restore; "
                        "call restore() to continue that run, use another job name or location to keep both, or "
                        "set checkpoint.overwrite = true to replace them")
            store.uncommit_rank(step, rank)
            store.abandon_above(step, rank)  # as on disk: this rank's copies of the run the job went back from
            store.write_data(step, rank, src, man.data_bytes, man.chunk_bytes, throttle)
            store.write_small(step, manifest_name(rank), man_json)
            store.commit_rank(step, rank, ws, digest)
            outcome("remote", None, catch_up=catch_up, ongoing=ongoing)
            if catch_up:
                log.warning("step %d rank %d uploaded to %s: the remote answers again", step, rank, store.describe())
            try:
                store.retain(int(remote.get("keep", 5)), protect=step)
            except CheckpointError as exc:
                log.warning("remote retention of %s failed: %s", store.describe(), exc)
        except CheckpointError as exc:
            failed = exc
            _discard_remote(store, step, rank, exc)
            outcome("remote", exc, catch_up=catch_up, ongoing=ongoing)
        except OSError as exc:
            failed = exc
            _discard_remote(store, step, rank, exc)
            err = StorageUnavailableError(f"cannot upload step {step}: {exc}")
            err.__cause__ = exc
            outcome("remote", err, catch_up=catch_up, ongoing=ongoing)
        except Exception as exc:  # noqa: BLE001 - an fsspec backend's own error types: still the remote tier's
            failed = exc
            _discard_remote(store, step, rank, exc)
            err = StorageUnavailableError(f"cannot upload step {step}: {exc!r}")
            err.__cause__ = exc
            outcome("remote", err, catch_up=catch_up, ongoing=ongoing)
        return UNREACHABLE if failed is not None and _unreachable(failed) else None

    return upload


def _write_commit(local: LocalStore, step: int, rank: int, world_size: int, man_json: bytes, digest: str) -> None:
    """Writes a rank's manifest, then its commit marker (and the job's commit record when the step is complete)."""
    local.write_small(step, manifest_name(rank), man_json)
    local.commit_rank(step, rank, world_size, digest)


def _write_data(local: LocalStore, step: int, rank: int, view: _SlotData, man: Manifest, throttle: Throttle,
                chunks: list[str]) -> PendingFile:
    """Writes a rank's data file under its temporary name, hashing each chunk into ``chunks``.

    Raises:
        OSError: the write failed; the temporary file is gone.
        CorruptCheckpointError: the slot was cut short; the temporary file is gone.
    """
    pending = local.begin_data(step, rank)
    try:
        _write_hashing(pending.fd, view, man.data_bytes, man.chunk_bytes, throttle, chunks)
    except BaseException:
        pending.abort()
        raise
    return pending


#: Room asked, besides the manifest's own size, for the small files written after a rank's data file (commit
#: marker, the job's commit record): a block each, with margin.
_SMALL_FILES_BYTES = 16 << 10
#: Bytes of one chunk checksum in the manifest's JSON (16 hex digits, quotes, comma), with margin.
_CHECKSUM_JSON_BYTES = 24


def _room_needed(man: Manifest) -> int:
    """Bytes a rank's step takes on disk: its data, its manifest (with the chunk checksums it will hold) and the
    small files. A fixed 256 KiB allowance made a job whose steps are a few hundred KiB never find room."""
    return man.data_bytes + len(man.to_json()) + _CHECKSUM_JSON_BYTES * man.n_chunks + _SMALL_FILES_BYTES


def _make_room(local: LocalStore, step: int, rank: int, needed: int, keep: int, uploading: set[int],
               evicted: list[int]) -> bool:
    """After ENOSPC: removes older steps so this one fits; True when the write should be tried once more (steps
    were removed, or there is room already: another rank's persist removed steps since the write failed). The
    steps removed are added to ``evicted``: a save that succeeds only by them still tells the job its disk is full.

    With retention K, K steps may fit on the filesystem but not K+1, and retention removes the oldest step only
    after the new one commits: without this, every later save failed and the disk tier stayed K steps old.
    """
    try:
        removed = local.make_room(needed, protect={step, *uploading})
    except OSError as exc:
        log.warning("cannot make room for step %d in %s: %s", step, local.describe(), exc)
        return False
    if not removed:
        try:
            st = os.statvfs(local.job_dir)
            if st.f_bavail * st.f_frsize >= needed:
                return True  # another rank's persist removed steps meanwhile (its retention, or its make_room)
        except OSError:
            pass
        log.info("step %d rank %d: the disk is full and removing older steps would not make room for %.1f MiB "
                 "(the newest complete step, and steps being written or read, stay)", step, rank,
                 needed / 2**20)
        return False
    evicted.extend(removed)
    log.warning("step %d rank %d: the disk of %s is full; removed older step(s) %s to make room for %.1f MiB (the "
                "newest complete step stays); retention keep=%d does not fit on this filesystem: lower "
                "checkpoint.disk.keep or free space", step, rank, local.describe(),
                ", ".join(map(str, removed)), needed / 2**20, keep)
    return True


def _discard(local: LocalStore, step: int, rank: int) -> None:
    """After this rank's disk save of ``step`` failed: removes what it wrote of it, and the step folder when it is
    left empty (see :meth:`LocalStore.discard_rank`); a failure here only logs, the save's own error is reported."""
    try:
        local.discard_rank(step, rank)
    except OSError as exc:
        log.warning("cannot remove the files of the failed save of step %d rank %d in %s: %s", step, rank,
                    local.describe(), exc)


def _discard_remote(store: FsspecStore | None, step: int, rank: int, exc: BaseException) -> None:
    """After this rank's upload of ``step`` failed with ``exc``: removes what it wrote there (see
    :meth:`FsspecStore.discard_rank`); best effort, the upload's own error is the one reported."""
    if store is None:
        return  # the remote was never reached: nothing was written
    if _unreachable(exc):
        return  # the cleanup would only wait out the same timeout in the upload queue
    try:
        store.discard_rank(step, rank)
    except Exception as exc:  # noqa: BLE001 - an unreachable remote fails this too
        log.info("cannot remove the files of the failed upload of step %d rank %d from %s: %s", step, rank,
                 store.describe(), exc)


#: errnos of a remote that cannot be reached (besides ConnectionError and TimeoutError)
_UNREACHABLE_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}


def _unreachable(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) says the remote could not be reached: connection
    refused or reset, a timeout, an unreachable network or host, a name that does not resolve."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if isinstance(cause, OSError) and cause.errno in _UNREACHABLE_ERRNOS:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _remove_stale_tmp(local: LocalStore, rank: int) -> None:
    """Before writing: a persist process killed mid-write left its temporary file (as large as a rank's data) in
    its step folder until retention removed the folder; on a nearly full disk it failed this write."""
    try:
        removed = local.remove_stale_tmp(rank)
    except OSError as exc:
        log.warning("cannot remove stale temporary files in %s: %s", local.describe(), exc)
        return
    if removed:
        log.info("removed %d temporary file(s) of writers killed mid-write in %s: %s", len(removed),
                 local.describe(), ", ".join(sorted(removed)[:4]) + (" ..." if len(removed) > 4 else ""))


def _write_hashing(fd: int, view: _SlotData, nbytes: int, chunk_bytes: int, throttle: Throttle,
                   chunks: list[str]) -> None:
    """Writes the slot's ``[0, nbytes)`` to ``fd`` chunk by chunk, appending each chunk's checksum to ``chunks``."""
    off = 0
    while off < nbytes:
        end = min(off + chunk_bytes, nbytes)
        h = xxhash.xxh3_64()
        for piece in view.pieces(off, end):
            h.update(piece)
            while piece:
                n = os.write(fd, piece)
                piece = piece[n:]
        chunks.append(h.hexdigest())
        throttle.account(end - off)
        off = end


__all__ = ["persist_snapshot"]
