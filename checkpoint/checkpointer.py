"""The public checkpointer: ``save`` (snapshot, then background persist), ``wait``, ``restore``, ``steps``.

Usage::

    from trainguard.checkpoint import Checkpointer, CheckpointConfig

    ckpt = Checkpointer(CheckpointConfig(directory="ckpt"), rank=0, world_size=1, job="demo")
    last = ckpt.restore({"model": model, "optim": opt})   # None: nothing saved yet
    start = 0 if last is None else last + 1
    for step in range(start, n):
        loss = model(x).sum(); loss.backward()
        opt.step(); opt.zero_grad()
        ckpt.save({"model": model, "optim": opt, "step": step}, step, overlap_with=opt)
    ckpt.close()

See :mod:`.snapshot` for the overlap contract, :mod:`.service` for who runs the persist process, and
:mod:`.shards` for sharded (DTensor) state and resharding.

A Checkpointer that only restores never touches the staging area or starts a persist process: the arena's lease
(one writer per job and rank, see :mod:`.arena`), the staging slots and the persist channel come with the first
``prepare()`` or ``save()``.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from trainguard.checkpoint import agreement
from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.arena import Arena, write_tag
from trainguard.checkpoint.channel import PersistChannel, open_channel
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StateMismatchError,
    StorageUnavailableError,
    WorldSizeMismatchError,
)
from trainguard.checkpoint.events import EventSink
from trainguard.checkpoint.fileio import storage_error
from trainguard.checkpoint.location import is_local_url
from trainguard.checkpoint.manifest import Manifest, TensorEntry, plan_layout
from trainguard.checkpoint.reader import RankCopy
from trainguard.checkpoint.restore_plan import job_memory_steps_from_env, own_memory_steps
from trainguard.checkpoint.shards import ShardedLoader
from trainguard.checkpoint.snapshot import PendingCopy, SnapshotCopier, storage_ptrs
from trainguard.checkpoint.staging import StagingArea
from trainguard.checkpoint.storage import (FsspecStore, LocalStore, StepStore, check_job_name, manifest_name,
                                          marker_name)
from trainguard.checkpoint.tree import capture, check_fits_before_loading, restore_into
from trainguard.checkpoint.uploads import REMOTE_BACKOFF_CAP
from trainguard.steps import MAX_STEP

log = logging.getLogger(__name__)

TIER_ORDER = ("memory", "disk", "remote")
_REMOTE_BACKOFF_CAP = REMOTE_BACKOFF_CAP  # the persist process's uploads back off alike
#: A failed dial of the remote that took this long was a timeout, not a refusal: a restore within the back-off
#: that follows does not pay it again (see ``_list_remote``).
SLOW_REMOTE_FAILURE_S = 1.0


@dataclass
class StepInfo:
    """A committed step and the tiers holding a complete copy of it (fastest first)."""

    step: int
    world_size: int
    tiers: list[str] = field(default_factory=list)


@dataclass
class SaveHandle:
    """What :meth:`Checkpointer.save` returns; ``wait()`` blocks until the step is durable in every tier."""

    step: int
    _owner: "Checkpointer"

    def wait(self, timeout: float | None = None) -> bool:
        """Same as ``Checkpointer.wait(self.step, timeout)``."""
        return self._owner.wait(self.step, timeout)

    @property
    def tiers_done(self) -> list[str]:
        """Tiers where this rank's copy is already durable."""
        st = self._owner._status.get(self.step)
        return sorted(st.ok, key=TIER_ORDER.index) if st else []


@dataclass
class _StepStatus:
    expected: set[str]
    ok: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    released: bool = False
    slot: int = -1
    slot_freed: bool = False  # the slot was handed back (it may hold a newer step now: never free it twice)
    request: int = 0  # the persist request's id: reports of an earlier save of the same step are not this one's


def _index(name: str, value: Any) -> int:
    """``value`` as an int (numpy integers too), or a CheckpointError naming ``name``: ``os.environ["RANK"]``
    passed as it is (a string) failed deep inside with a bare TypeError."""
    import operator

    if isinstance(value, bool):
        raise CheckpointError(f"{name} must be an integer, got the boolean {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        hint = "; pass int(...) of it (environment variables are strings)" if isinstance(value, str) else ""
        raise CheckpointError(f"{name} must be an integer, got {type(value).__name__} {value!r}{hint}") from None




def _one_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a :class:`Checkpointer` method under its ``_save_lock``."""
    @functools.wraps(method)
    def run(self: "Checkpointer", *args: Any, **kwargs: Any) -> Any:
        with self._save_lock:
            return method(self, *args, **kwargs)
    return run

def _layout(cap: Any, alignment: int) -> tuple[list[TensorEntry], int]:
    """The data-file layout of a captured state (see :func:`~trainguard.checkpoint.manifest.plan_layout`)."""
    names: dict[torch.dtype, str] = {}  # str(dtype) per tensor was a tenth of a save of 40,000 small tensors

    def name(dtype: torch.dtype) -> str:
        if (n := names.get(dtype)) is None:
            n = names[dtype] = str(dtype).removeprefix("torch.")
        return n
    return plan_layout(((c.key, name(c.tensor.dtype), c.tensor.shape) for c in cap.tensors), alignment)

class Checkpointer:
    """Tiered asynchronous checkpoints for one rank of one job.

    Args:
        config: the configuration.
        rank: this process's rank (0-based).
        world_size: number of ranks; a step is committed when all of them committed it.
        job: job name; separates jobs sharing a directory or host.
        on_event: called with a :class:`~trainguard.detectors.events.HealthEvent` when a save or persist fails
            (full disk, unwritable directory, unreachable remote); exceptions it raises are logged, never
            propagated.

    Raises:
        CheckpointError: bad rank or job name. The constructor writes nothing (a worker restarting on a full or
            read-only disk can still restore); an unwritable disk tier is reported through ``on_event`` here and
            raised by :meth:`prepare`.
    """

    def __init__(self, config: CheckpointConfig, rank: int = 0, world_size: int = 1, job: str = "default",
                 on_event: Callable[[Any], None] | None = None) -> None:
        rank, world_size = _index("rank", rank), _index("world_size", world_size)
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is outside world size {world_size}; pass 0 <= rank < world_size")
        check_job_name(job)
        self.config = config
        self.rank, self.world_size, self.job = rank, world_size, job
        self.events = EventSink(on_event, rank)
        self.last_restore_tier: str | None = None
        #: bytes verified (so read) per saved rank by the last restore: a reshard touches only the ranks and
        #: checksum chunks its shards overlap.
        self.last_restore_read: dict[int, int] = {}
        self._memory_listing: dict[int, dict[int, Any]] | None = None
        self._torn_into: tuple[int, str] | None = None  # (step, tier) of a load that failed part-way: see _restore_from
        #: steps the coordinator's restore plan says every rank holds in its own node's memory (see
        #: :data:`~trainguard.checkpoint.config.RESTORE_PLAN_ENV`); this rank restores them from local memory.
        self.job_memory_steps: frozenset[int] = job_memory_steps_from_env()
        self._lock = threading.Condition()
        self._status: dict[int, _StepStatus] = {}
        #: request id -> the status of an earlier save of a step saved again before that save was released (its
        #: upload may still run): its own outcomes still reach it, so a thread in its wait() returns
        self._superseded: dict[int, _StepStatus] = {}
        self._requests = 0  # persist requests sent (their ids)
        self._slot_busy: list[bool] = []
        self._slot_step: list[int] = []
        self._pending: PendingCopy | None = None
        #: ``id(optimizer) -> (weak reference to it, its step pre-hook's handle)``
        self._hooked: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self._closed = False
        self._last_step: int | None = None
        #: restore() returned, or a save passed :meth:`_refuse_fresh_over_newer`: lower steps saved from now on
        #: mean the job went back, and this rank's copies of higher steps are removed as a run it left.
        self._resumed = False
        self._restored = False  # restore() returned: see _foreign_above
        self._max_saved = -1  # the highest step this Checkpointer saved
        self._copier = SnapshotCopier()
        self._staging: dict[int, torch.Tensor] = {}
        # slot index -> (its staging buffer, the layout, each tensor's view of the buffer): see _slot_views
        self._views: dict[int, tuple[torch.Tensor, list[TensorEntry], list[torch.Tensor | None]]] = {}

        self.disk: LocalStore | None = None
        if config.disk.enabled:
            self.disk = LocalStore(config.disk_directory, job, fsync=config.disk.fsync)
            problem = self.disk.writable_problem()
            if problem:
                self.events.storage_failed("disk", None, problem[0], problem[1])
        self._remote: FsspecStore | None = None
        #: an unreachable remote is left out of listings until this monotonic time (see :meth:`_list_remote`)
        self._remote_retry_at = 0.0
        self._remote_backoff = 0.0  # its current back-off in seconds; 0 while it answers
        self._remote_failed_once = False  # then each new FsspecStore bypasses fsspec's instance cache
        # How long the remote's last failed dial took (0: a quick refusal, or none yet): see _list_remote.
        self._remote_fail_s = 0.0
        if config.remote_url:
            t0 = time.monotonic()
            try:
                self.remote_store()
            except StorageUnavailableError as exc:
                self._remote_fail_s = time.monotonic() - t0
                note = self._remote_failed(exc, said=True)
                self.events.storage_failed("remote", None, f"{exc}; {note}", 0)
        nslots = (config.memory.keep + 1) if config.memory.enabled else 2
        self._stage = StagingArea(config, job, rank, nslots, self.events)  # slots come with the first save
        self._channel: PersistChannel | None = None
        # The overlapped copy publishes from its own thread while the trainer may call wait(): without this lock
        # both could start a persist process (and a reader thread) of their own on first use.
        self._channel_lock = threading.Lock()
        # save() and prepare() from two threads at once: the second of two first saves took the arena's lease
        # away from the first and failed, blaming "another Checkpointer". One at a time, in call order.
        self._save_lock = threading.RLock()

    # ------------------------------------------------------------------ writer resources
    @property
    def channel(self) -> PersistChannel:
        """The persist channel (started on first use).

        Raises:
            CheckpointError: the persist process cannot be started or reached.
        """
        with self._channel_lock:
            if self._channel is None:
                self._channel = open_channel(self.config, self.job, self.rank, self._on_report)
            return self._channel

    @property
    def arena(self) -> Arena | None:
        """The staging slots (None until the first ``prepare()``/``save()``)."""
        return self._stage.arena

    @property
    def staging(self) -> str | None:
        """Where snapshots are staged: "memory" (the shared-memory tier) or a fallback for a too-small /dev/shm
        ("disk": local files; "host": anonymous memory, page-locked with CUDA); None before the first save."""
        return self._stage.kind

    def _ensure_arena(self, nbytes: int) -> Arena:
        """The staging arena, opened on first use (see :class:`.staging.StagingArea`).

        Raises:
            ArenaOwnedError: another live process writes this job and rank.
            StorageUnavailableError: neither the memory directory nor the fallback can hold the slots.
        """
        if self._stage.arena is not None:
            return self._stage.arena
        arena = self._stage.ensure(nbytes)
        self._slot_busy = [False] * arena.nslots
        # Slots surviving a crashed predecessor keep their step tags: reuse the oldest first, keep the newest.
        self._slot_step = [int(t) if (t := arena_mod.read_tag(arena.paths(i))).isdigit() else -1
                           for i in range(arena.nslots)]
        return arena

    def _outgrow_memory(self, nbytes: int, exc: StorageUnavailableError) -> Arena:
        """Moves staging to the fallback when the state outgrew the shared-memory slots sized at the first save.

        ``prepare()`` often runs before the optimizer creates its state, so the slots it sized in a small
        /dev/shm stop fitting at the first real save; a storage failure must not raise into training. Waits for
        the persists still reading the memory slots (their release messages name slot indexes), unmaps the
        memory arena (its committed copies stay listed in the memory tier; its lease is kept so ``close()``
        removes them as it would the arena in use) and opens the fallback exactly as a
        first save that does not fit would (one warning, one ``checkpoint.staging_fallback`` event).

        Raises:
            StorageUnavailableError: staging was not in shared memory (the fallback itself is full) or no
                fallback is possible; ArenaOwnedError: another process writes the fallback area.
        """
        if self._stage.kind != "memory":
            raise self._stage.outgrown(nbytes, exc) from exc
        log.info("staging slots outgrown in %s (%s); falling back", self.config.memory.directory, exc)
        with self._lock:
            while any(self._slot_busy) and self.channel.alive():
                self._lock.wait(0.5)
        self._staging.clear()
        self._views.clear()
        self._copier.unpin_all()
        self._stage.retire_memory()
        try:
            short = max(1, arena_mod.staging_shortfall(
                arena_mod.rank_dir(self.config.memory.directory, self.job, self.rank), self._stage.nslots, nbytes))
        except OSError:
            short = self._stage.nslots * nbytes
        arena = self._stage.fall_back(nbytes, short)
        self._slot_busy = [False] * arena.nslots
        self._slot_step = [int(t) if (t := arena_mod.read_tag(arena.paths(i))).isdigit() else -1
                           for i in range(arena.nslots)]
        return arena

    def _reopen_vanished_arena(self) -> None:
        """Opens new staging slots when the arena's folder was removed under this process (an operator's
        ``rm`` or a cleaner of /dev/shm): the old slots are unlinked files nobody else can open, so every later
        save would fail on them. Waits for the persists still reading them first, as :meth:`_outgrow_memory`
        does; the copies they held are gone from the memory tier either way."""
        log.warning("checkpoint staging area %s was removed by another process; allocating new slots (the "
                    "in-memory copies it held are lost, the other tiers are not)", self._stage.arena.dir)
        with self._lock:
            while any(self._slot_busy) and self.channel.alive():
                self._lock.wait(0.5)
        self._close_arena(remove=False)

    def _close_arena(self, remove: bool, remove_outgrown: bool = False) -> None:
        """Unmaps the slots and gives the lease back (removing the area only when ``remove``; the shared-memory
        slots the state outgrew only when ``remove_outgrown``)."""
        self._staging.clear()
        self._views.clear()
        self._copier.unpin_all()
        self._stage.close(remove, remove_outgrown)

    # ------------------------------------------------------------------ tiers
    def remote_store(self) -> FsspecStore | None:
        """The remote tier (created lazily so an unreachable remote is retried), or None when not configured.

        Raises:
            StorageUnavailableError: the remote cannot be reached.
        """
        url = self.config.remote_url
        if url is None:
            return None
        if self._remote is None:
            # After a failure, a new connection: the cached filesystem may hold a dead one (see _list_remote).
            self._remote = FsspecStore(url, self.job, self.config.remote.storage_options,
                                       fresh=self._remote_failed_once)
        return self._remote

    def _expected_tiers(self) -> set[str]:
        t = set()
        if self.config.memory.enabled and self.staging == "memory":
            t.add("memory")
        if self.config.disk.enabled:
            t.add("disk")
        if self.config.remote_url:
            t.add("remote")
        return t

    # ------------------------------------------------------------------ save
    @_one_at_a_time
    def prepare(self, state: Mapping[str, Any]) -> int:
        """Allocates and pre-faults every staging slot for ``state``'s size, so no save pays that cost.

        Optional: the first saves allocate lazily otherwise (about 1.4 s per GiB of tmpfs on first touch). When
        the memory directory (``/dev/shm``) is too small for the slots, they go to local disk instead: one
        warning and a ``checkpoint.staging_fallback`` health event say so (see ``memory.fallback``).

        Args:
            state: the state that will be saved (only its tensor sizes are read).

        Returns:
            Bytes per slot.

        Raises:
            StorageUnavailableError: the disk tier cannot be written, or no staging directory can hold the slots.
            ArenaOwnedError: another live process already writes checkpoints for this job and rank.
            UnsupportedValueError: the state holds a value the format cannot store.
        """
        if self.disk is not None:
            self.disk.check_writable()
        cap = capture(state)
        _, data_bytes = _layout(cap, self.config.persist.alignment)
        arena = self._ensure_arena(data_bytes)
        try:
            arena.preallocate(data_bytes)
        except StorageUnavailableError as exc:
            self._outgrow_memory(data_bytes, exc).preallocate(data_bytes)
        return data_bytes

    @_one_at_a_time
    def save(self, state: Mapping[str, Any], step: int, overlap_with: Any = None) -> SaveHandle:
        """Snapshots ``state`` and hands it to the persist process; returns after the snapshot phase.

        Safe to call from several threads: calls run one at a time, in the order they take the lock.

        Args:
            state: name -> tensor / container / scalar / Stateful (see :mod:`.tree`).
            step: training step number (>= 0); saving a step lower than or equal to a previous one is allowed
                (it replaces that step, and a lower step means the job went back: this rank's copies of the
                higher steps, a run it left, are removed from every tier).
            overlap_with: an optimizer (or a list of them). Its parameters and state tensors are then copied in
                the background while the next forward/backward runs; a step pre-hook installed on it waits for
                the copy before the optimizer mutates them. Without it every tensor is copied before returning.

        Returns:
            A handle whose ``wait()`` blocks until the step is durable.

        Raises:
            CheckpointError: the state has an unsupported value, ``step`` is no integer in 0..2**53-1, the
                checkpointer is closed, or (first save of a run that did not ``restore()``) this location holds
                this rank's checkpoints of higher steps, which saving ``step`` would delete: see
                ``CheckpointConfig.overwrite``. Storage failures are not raised: they are reported through
                ``on_event`` and the log.
        """
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer; create a new one")
        step = step_number(step)
        if not 0 <= step <= MAX_STEP:
            # Past 2**53-1 the coordinator refuses the step in every heartbeat (the job loses its lease) and the
            # peers refuse its replicas: refused here, where the caller can still act on it.
            raise CheckpointError(f"step must be in 0..{MAX_STEP} (2**53-1), got {step}")
        if not self._resumed:
            self._refuse_fresh_over_newer(step)
        foreign_above = self._foreign_above(step)
        self._finish_pending()
        cap = capture(state)
        alignment = self.config.persist.alignment
        entries, data_bytes = _layout(cap, alignment)
        manifest = Manifest(job=self.job, step=step, rank=self.rank, world_size=self.world_size, tensors=entries,
                            tree=cap.tree, data_bytes=data_bytes, alignment=alignment,
                            chunk_bytes=self.config.persist.chunk_mib << 20, replicated=self.config.replicated,
                            sharded=cap.sharded, location=self.config.location)
        if self._stage.arena is not None and not os.path.isdir(self._stage.arena.dir):
            self._reopen_vanished_arena()
        arena = self._ensure_arena(data_bytes)
        self._abandon_newer(arena, step)
        index = self._acquire_slot(step)
        try:
            slot = self._take_slot(arena, index, data_bytes)
        except StorageUnavailableError as exc:
            self._release_slot(index)
            arena = self._outgrow_memory(data_bytes, exc)
            index = self._acquire_slot(step)
            try:
                slot = self._take_slot(arena, index, data_bytes)
            except BaseException:
                self._release_slot(index)
                raise
        except BaseException:
            self._release_slot(index)
            raise
        try:
            paths = slot.paths
            staging = self._staging_of(index, slot)
            deferred_ptrs = storage_ptrs(_as_list(overlap_with)) if overlap_with is not None else set()
            eager, deferred = [], []
            for c, dst in zip(cap.tensors, self._slot_views(index, staging, cap, entries)):
                if dst is None:
                    continue
                src = c.tensor
                if src.untyped_storage().data_ptr() in deferred_ptrs:
                    deferred.append((src, dst))
                else:
                    eager.append((src, dst))
            self._copier.copy_now(eager)
        except BaseException:
            slot.unlock()
            self._release_slot(index)
            raise
        with self._lock:
            self._requests += 1
            earlier = self._status.get(step)
            if earlier is not None and not earlier.released:
                self._superseded[earlier.request] = earlier
            self._status[step] = _StepStatus(expected=self._expected_tiers(), slot=index, request=self._requests)
            self._slot_step[index] = step
            self._last_step = step
            # Forget old, finished steps so a long run does not grow this dict without bound.
            for old in sorted(s for s in self._status if self._status[s].released)[:-64]:
                del self._status[old]

        def publish(err: BaseException | None) -> None:
            try:
                # Each lost step is said (log and health event) like a failed persist: the hook and the agent learnt
                # of neither failure below, and wait() returning False was the only sign.
                if err is not None:
                    why = f"snapshot copy failed: {err!r:.300}"
                    self._fail_step(step, why)
                    self.events.storage_failed("persist", step, why, getattr(err, "errno", 0) or 0)
                    return
                try:
                    write_tag(paths, str(step))
                except OSError as exc:  # a full tmpfs (see _take_slot): this step is lost, not the training
                    err = storage_error(exc, f"tag staging slot {index} of {arena.dir} with step {step}")
                    why = f"snapshot not published: {err}"
                    self._fail_step(step, why)
                    self.events.storage_failed("persist", step, why, exc.errno or 0)
                    return
            finally:
                slot.unlock()
            self._submit(step, index, manifest, paths, foreign_above)

        if deferred:
            self._install_hooks(_as_list(overlap_with))
            with self._lock:  # see _finish_pending
                self._pending = self._copier.copy_async(deferred, publish)
        else:
            publish(None)
        return SaveHandle(step, self)

    def _refuse_fresh_over_newer(self, step: int) -> None:
        """Refuses the first save of a run that did not restore when this location holds this rank's copies of
        higher steps of the job (unless ``checkpoint.overwrite``).

        Saving a lower step removes this rank's copies of every higher step from every tier (the job went back,
        see :meth:`save`). A run started from scratch in an old job name and directory (no ``restore()``, or a
        different experiment reusing the name) thus deleted the earlier run's newer checkpoints at its first save
        and then its own steps to retention, silently. Frameworks refuse or warn there instead (Hugging Face's
        ``overwrite_output_dir``, Lightning's "Checkpoint directory exists and is not empty"): refused here,
        before anything is written. The disk and memory tiers are listed here; the remote tier is not (a remote
        that hangs would hang the training step): the persist process refuses the upload instead (see
        :meth:`_foreign_above`).

        Raises:
            CheckpointError: such copies exist (the message names the steps, where, and what to do).
        """
        if self.config.overwrite:
            self._resumed = True
            return
        found: dict[str, list[int]] = {}
        if self.disk is not None:
            mine = marker_name(self.rank)
            try:
                higher = [s for s in self.disk.list_steps() if s > step and mine in self.disk.list_names(s)]
            except OSError:
                higher = []
            if higher:
                found[f"disk ({self.disk.describe()})"] = higher
        if self.config.memory.enabled:
            try:
                listed = arena_mod.memory_manifests(self.config.memory.directory, self.job, self.config.location,
                                                    retired=True)
            except OSError:
                listed = {}
            higher = sorted(s for s, ranks in listed.items() if s > step and self.rank in ranks)
            if higher:
                found[f"memory ({self.config.memory.directory})"] = higher
        if not found:
            self._resumed = True
            return
        where = "; ".join(f"{tier}: steps {_steps_text(steps)}" for tier, steps in found.items())
        raise CheckpointError(
            f"rank {self.rank}: job {self.job!r} at {self.config.directory} already holds checkpoints of higher "
            f"steps than {step} ({where}), and this run did not restore. Saving step {step} would delete them (a "
            "lower step saved means the job went back). To continue that run call restore() before saving; to "
            "keep both, give this run another job name or checkpoint directory; to start over and replace them, "
            "set checkpoint.overwrite = true (CheckpointConfig(overwrite=True)).")

    def _foreign_above(self, step: int) -> int | None:
        """For the remote upload of ``step``: None when this run may remove this rank's remote copies of higher
        steps (it restored, or ``checkpoint.overwrite``); else the step above which such copies are another
        run's (the higher of ``step`` and the highest step this run saved), and the upload is refused while the
        remote holds any: the first save of a fresh run on a node whose disk is empty (a new node, another
        ``local_cache``) removed the earlier run's newer steps from the remote at its upload."""
        previous = self._max_saved
        self._max_saved = max(previous, step)
        if self._restored or self.config.overwrite or not self.config.remote_url:
            return None
        return max(step, previous)

    def _abandon_newer(self, arena: Arena, step: int) -> None:
        """Takes this rank's in-memory copies of steps above ``step`` out of the tier (listed and retired): saving
        a lower step means the job went back (``restore(step=...)``, ranks agreeing on an older step), so they
        belong to the run it left. Kept, a rank killed before its next save left its old copy of a step beside
        the other ranks' new copies of that step, and a restore loaded the two runs' states as one step. Waits for
        the persists still publishing such a copy, so none is listed again after it is dropped."""
        if self._stage.kind != "memory":
            return
        with self._lock:
            while True:
                if self._channel is not None and not self._channel.alive():
                    # Its slots are freed here, so their copies are dropped below: a persist killed between
                    # publishing a newer step in memory and freeing its slot left that step of the run the job left
                    # listed (the busy slot was skipped), and the next restore loaded it.
                    self._persist_died()
                newer = [i for i, s in enumerate(self._slot_step) if s > step]
                if not any(self._slot_busy[i] for i in newer) or self._channel is None:
                    break
                self._lock.wait(0.5)
            for i in newer:
                if not self._slot_busy[i]:
                    arena_mod.drop_manifests(arena.paths(i))
                    self._slot_step[i] = -1  # reused first, never trimmed as a copy of its old step

    def _take_slot(self, arena: Arena, index: int, nbytes: int) -> Any:
        """Slot ``index`` of ``arena``, sized for ``nbytes``, locked and tagged as being written.

        The slot stops being a memory-tier copy (listed or retired) before it is overwritten. Tagging it creates
        a small file: on a /dev/shm that another process filled after the slots were allocated (DataLoader
        workers share tensors there) it fails with ENOSPC. That used to raise out of ``save()`` at every step
        (no step reached disk either); now the caller stages on the fallback, as for slots that do not fit.

        Raises:
            StorageUnavailableError: the slot cannot be sized, locked or tagged (the folder removed under us, a
                full tmpfs).
        """
        slot = arena.get(index, nbytes)
        slot.lock(exclusive=True)
        try:
            arena_mod.drop_manifests(slot.paths)
            write_tag(slot.paths, arena_mod.WRITING)
        except OSError as exc:
            slot.unlock()
            raise storage_error(exc, f"mark staging slot {index} of {arena.dir} as being written") from exc
        return slot

    def _slot_views(self, index: int, staging: torch.Tensor, cap: Any, entries: list[TensorEntry],
                    ) -> list[torch.Tensor | None]:
        """Each captured tensor's place in slot ``index``'s staging buffer (None for an empty tensor).

        Kept per slot while its buffer and the layout stay the same, as they do from one save to the next: three
        tensor views per tensor were half of ``save()`` for a state of 40,000 small tensors.
        """
        cached = self._views.get(index)
        if cached is not None and cached[0] is staging and cached[1] == entries:
            return cached[2]
        views: list[torch.Tensor | None] = [
            staging[e.offset:e.offset + e.nbytes].view(c.tensor.dtype).view(c.tensor.shape) if e.nbytes else None
            for c, e in zip(cap.tensors, entries)]
        self._views[index] = (staging, entries, views)
        return views

    def _staging_of(self, index: int, slot: Any) -> torch.Tensor:
        t = self._staging.get(index)
        if t is None or t.numel() != slot.size:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.frombuffer(slot.map, dtype=torch.uint8)
            if self.staging != "disk":
                # File-backed slots on a real filesystem cannot be page-locked (cudaHostRegister fails with
                # invalid value on an H200 node), and their copies end on disk anyway.
                self._copier.pin(t)
            self._staging[index] = t
        return t

    def _submit(self, step: int, index: int, manifest: Manifest, paths: Any, foreign_above: int | None = None,
                ) -> None:
        cfg = self.config
        req = {
            "op": "persist", "id": self._status[step].request, "job": self.job, "rank": self.rank, "world_size": self.world_size,
            "step": step, "slot": paths.tag[: -len(".tag")],
            "slot_data": paths.data,  # differs from "<slot>.data" for anonymous (memfd) staging
            "manifest": manifest.to_json().decode(),
            "memory": cfg.memory.enabled and self.staging == "memory",
            # Absolute paths only: an agent-owned persist process runs in the launcher's working directory, not in
            # this worker's (a script that chdirs, Hydra's run folder).
            "disk": {"root": self.disk.root, "keep": cfg.disk.keep, "fsync": cfg.disk.fsync}
            if self.disk is not None else None,
            # The listings' back-off travels along: while the remote is marked unreachable here, the persist
            # process does not dial it for this step either (see uploads.py).
            "remote": {"url": cfg.remote_url, "keep": cfg.remote.keep, "storage_options": cfg.remote.storage_options,
                       "retry_s": cfg.remote.retry_s, "backoff_s": self._remote_backoff,
                       "retry_in_s": max(0.0, self._remote_retry_at - time.monotonic()),
                       "foreign_above": foreign_above}
            if cfg.remote_url else None,
            "bandwidth_mib_s": cfg.persist.bandwidth_mib_s,
        }
        try:
            self.channel.submit(req)
        except Exception as exc:  # noqa: BLE001 - any failure must free the slot: a taken slot blocks later saves
            # Not only CheckpointError: a request that cannot be encoded (a config changed after validation) raised
            # out of the snapshot thread or save() and kept the slot taken, so the third save blocked for ever.
            why = (str(exc) if isinstance(exc, CheckpointError)
                   else f"cannot hand step {step} to the persist process: {exc!r:.300}")
            self._fail_step(step, why)
            self.events.storage_failed("persist", step, why, 0)

    def _fail_step(self, step: int, message: str) -> None:
        with self._lock:
            st = self._status.get(step)
            if st is not None:
                for t in st.expected - st.ok:
                    st.failed.setdefault(t, message)
                st.released = True
                self._free_slot(st)
            self._lock.notify_all()

    def _free_slot(self, st: _StepStatus) -> None:
        """Hands ``st``'s staging slot back, once. Caller holds ``self._lock``."""
        if st.slot >= 0 and not st.slot_freed:
            st.slot_freed = True
            self._slot_busy[st.slot] = False

    def _on_report(self, msg: dict[str, Any]) -> None:
        """Receives persist outcomes (from the persist process's reader thread or inline)."""
        if msg.get("op") == "channel_closed":
            # The reader's last word only wakes waiters, which also look at the channel every 0.5 s. A thread that
            # holds the lock while it closes the dead channel (_persist_died) joins this reader: taking the lock
            # here made that save wait out the join's 5 s.
            if self._lock.acquire(blocking=False):
                try:
                    self._lock.notify_all()
                finally:
                    self._lock.release()
            return
        step = int(msg.get("step", -1))
        with self._lock:
            current = st = self._status.get(step)
            if st is not None and msg.get("id") not in (None, st.request):
                # An earlier save of this step (its upload can outlive it): its outcomes are not this save's, but
                # that save's own (a thread may be in its wait()). Its slot was freed when its slot_free arrived,
                # before this save took the slot.
                st = self._superseded.get(msg["id"])
            if msg.get("op") == "tier" and st is not None:
                if msg.get("ok"):
                    st.ok.add(msg["tier"])
                    st.failed.pop(msg["tier"], None)  # a catch-up upload of a step skipped during an outage
                else:
                    st.failed[msg["tier"]] = msg.get("error", "failed")
            elif msg.get("op") in ("slot_free", "released") and st is not None:
                # slot_free: the memory and disk tiers are done, the upload (if any) reads the disk copy, so the
                # slot takes the next snapshot while a slow remote still works on this one.
                if msg["op"] == "released":
                    st.released = True
                    self._superseded.pop(st.request, None)
                self._free_slot(st)
            stale = (self._stale_memory_copies(step, st.slot) if msg.get("op") == "tier" and msg.get("tier") ==
                     "memory" and msg.get("ok") and st is not None and st is current else [])
            for paths in stale:
                # Out of the tier's listing, but its bytes stay intact until a later save reuses the slot: a
                # restore whose ranks agree on that step (another rank was killed before its next copy was
                # complete) reads it. Under the lock: retired after it, a save could take the slot meanwhile and
                # its new copy was retired instead (the newest step vanished from steps() and the agent's scan).
                arena_mod.retire_manifest(paths)
            self._lock.notify_all()
        if (msg.get("op") == "tier" and msg.get("tier") == "disk" and msg.get("ok")
                and self._stage.outgrown_lease is not None):
            # The slots the state outgrew were all persisted before staging moved (see _outgrow_memory), so this
            # disk copy is of a newer save: their copies are now older than the disk's and were only holding
            # the small /dev/shm (1.6 of 2 MiB measured) until close().
            directory = self.config.memory.directory
            if self._stage.drop_outgrown():
                log.info("step %d is on disk: removed the shared-memory staging slots the state outgrew in %s",
                         step, directory)
        if msg.get("op") == "tier" and msg.get("tier") == "remote":
            if msg.get("ok") and self._remote_backoff:
                self._remote_backoff = self._remote_retry_at = 0.0  # it answers: listed again at once
                self._remote_fail_s = 0.0
            elif not msg.get("ok") and msg.get("unreachable") and not msg.get("quiet"):
                # An upload found it unreachable: listings back off too (the event below says it). How long that
                # took is not known here: a restore asks it again rather than trust an older slow failure.
                self._remote_fail_s = 0.0
                self._remote_failed(StorageUnavailableError(str(msg.get("error", ""))), said=True)
        if msg.get("op") == "tier" and not msg.get("ok") and msg.get("quiet"):
            log.debug("step %s: %s tier: %s", step, msg.get("tier"), msg.get("error"))
        elif msg.get("op") == "tier" and not msg.get("ok"):
            self.events.storage_failed(msg.get("tier", "?"), step, msg.get("error", ""), int(msg.get("errno", 0)))
        elif msg.get("op") == "tier" and msg.get("evicted"):
            # Saved, but only by removing older steps from a full disk: fewer steps are kept than configured, and
            # the next save may find no step left to remove. The operator hears of it now, not at that failure.
            evicted = ", ".join(str(int(n)) for n in msg["evicted"])
            self.events.notice(
                "checkpoint.disk_full",
                f"checkpoint {msg.get('tier', '?')} tier is full: step {step} fitted only after older step(s) "
                f"{evicted} were removed; free space or lower checkpoint.disk.keep",
                {"tier": str(msg.get("tier", "?")), "step": str(step), "evicted": evicted})

    def _stale_memory_copies(self, step: int, slot: int) -> list[Any]:
        """Slots (paths) whose memory copies fall outside ``memory.keep`` now that ``step`` is in memory.

        The arena has ``keep + 1`` slots so a save never overwrites a copy being persisted; without this the
        memory tier would list ``keep + 1`` steps. Only idle slots holding older steps are trimmed. Caller holds
        ``self._lock``.
        """
        arena = self._stage.arena
        if arena is None or self._stage.kind != "memory" or slot < 0:
            return []
        older = sorted((i for i, s in enumerate(self._slot_step)
                        if i != slot and 0 <= s < step and not self._slot_busy[i]),
                       key=lambda i: self._slot_step[i], reverse=True)
        return [arena.paths(i) for i in older[max(0, self.config.memory.keep - 1):]]

    def _acquire_slot(self, step: int) -> int:
        """Picks a free slot holding the oldest step; waits while every slot is being persisted.

        A step saved again goes into the slot already holding it (waiting for that slot's persist), so the memory
        tier never holds two copies of one step and serves the newer one.
        """
        with self._lock:
            while True:
                if self._channel is not None and not self._channel.alive():
                    self._persist_died()  # before the snapshot, so this save goes to the new persist process
                same = [i for i, s in enumerate(self._slot_step) if s == step]
                if same:
                    if not self._slot_busy[same[0]]:
                        self._slot_busy[same[0]] = True
                        return same[0]
                    if not self.channel.alive():
                        self._persist_died()
                        continue
                    self._lock.wait(0.5)
                    continue
                free = [i for i, b in enumerate(self._slot_busy) if not b]
                if free:
                    i = min(free, key=lambda j: self._slot_step[j])
                    self._slot_busy[i] = True
                    return i
                if not self.channel.alive():
                    self._persist_died()
                    continue
                self._lock.wait(0.5)

    def _persist_died(self) -> None:
        """The persist process is gone (killed, OOM): the steps it had not finished failed in their unfinished
        tiers (reported, not raised: a save must not kill training), their slots are free again, and the next
        use of :attr:`channel` starts a new persist process (or reconnects to the agent's). Caller holds
        ``self._lock``."""
        lost = sorted(s for s, st in self._status.items() if not st.released)
        why = "the persist process died before this step was durable in every tier"
        for st in [self._status[s] for s in lost] + list(self._superseded.values()):
            for t in st.expected - st.ok:
                st.failed.setdefault(t, why)
            st.released = True
            self._free_slot(st)
        self._superseded.clear()
        with self._channel_lock:
            dead, self._channel = self._channel, None
        if dead is not None:
            try:
                dead.close()
            except Exception:  # noqa: BLE001 - it is already gone; closing only tidies our side
                pass
        self.events.storage_failed("persist", lost[-1] if lost else None,
                                   f"{why} (steps {lost}); starting a new persist process", 0)
        self._lock.notify_all()

    def _release_slot(self, index: int) -> None:
        with self._lock:
            self._slot_busy[index] = False
            self._lock.notify_all()

    def _install_hooks(self, optimizers: Sequence[Any]) -> None:
        for opt in optimizers:
            known = self._hooked.get(id(opt))
            if known is not None and known[0]() is opt:
                continue
            # An id alone is not the optimizer: one freed after a save (a training phase's local optimizer) leaves
            # its id to the next one, which then stepped without waiting for the overlapped copy of its
            # parameters, so the snapshot mixed values from before and after that step.

            def pre_hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
                self._finish_pending(host=False)

            self._hooked[id(opt)] = (weakref.ref(opt), opt.register_step_pre_hook(pre_hook))

    def _finish_pending(self, host: bool = True) -> None:
        pending = self._pending
        if pending is None:
            return
        if host:
            pending.wait_host()
        else:
            pending.wait_before_mutation()
            # Only once its persist request was sent: forgotten when the copy was done, the next save did not
            # wait for that request, and its own (a faster copy) could reach the persist process first, which
            # then took the older step for the job going back and removed the newer one from disk (1 CI run).
            if not pending.settled:
                return
        with self._lock:
            # Only the copy waited for: a wait() on another thread that woke after the trainer's next save had
            # started a newer copy forgot that one, with the same loss, and the pre-hook then let the optimizer
            # change parameters that copy was still reading (a step saved with later values).
            if self._pending is pending:
                self._pending = None

    # ------------------------------------------------------------------ wait
    def wait(self, step: int | None = None, timeout: float | None = None) -> bool:
        """Blocks until this rank's copy of ``step`` is durable in every enabled tier (or failed).

        Args:
            step: the step; default the latest saved.
            timeout: seconds; None waits as long as needed.

        Returns:
            True when durable in every enabled tier; False when a tier failed for it (already reported through
            ``on_event``, except an upload replaced by a new save of the same step: that save uploads the step)
            or the timeout expired. Never raises for storage failures.

        Raises:
            CheckpointError: ``step`` was never saved by this checkpointer.
        """
        if step is None:
            step = self._last_step
            if step is None:
                return True
        step = step_number(step)
        self._finish_pending()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            st = self._status.get(step)
            if st is None:
                raise CheckpointError(f"step {step} was not saved by this checkpointer; wait() on a saved step")
            while not st.released:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self.channel.alive():
                    return False
                self._lock.wait(0.5 if left is None else min(left, 0.5))
            return st.expected <= st.ok

    # ------------------------------------------------------------------ listing
    def steps(self) -> list[StepInfo]:
        """Committed steps (every rank's copy complete in some tier), ascending, with their tiers fastest first.

        A remote tier that cannot be listed is skipped (and logged).
        """
        return self._list_steps(retired=False)

    def _list_steps(self, retired: bool, restoring: bool = False) -> list[StepInfo]:
        """:meth:`steps`; with ``retired``, the memory tier also counts copies trimmed from it but still intact
        (a restore's candidates: with ``memory.keep = 1`` a kill between two ranks' completions of step N+1 leaves
        one rank's N retired and the other's listed, and every byte of N still in memory). ``restoring`` lists
        the remote tier even while it backs off (see :meth:`_list_remote`)."""
        found: dict[int, StepInfo] = {}
        for tier, committed in self._committed_by_tier(retired, restoring):
            for s, ws in committed:
                found.setdefault(s, StepInfo(s, ws)).tiers.append(tier)
        return [found[s] for s in sorted(found)]

    def _committed_by_tier(self, retired: bool = False,
                           restoring: bool = False) -> list[tuple[str, list[tuple[int, int]]]]:
        out: list[tuple[str, list[tuple[int, int]]]] = []
        if self.config.memory.enabled:
            mem = arena_mod.memory_committed(self.config.memory.directory, self.job, self.config.location,
                                             retired=retired)
            if self.job_memory_steps:
                mem = sorted(set(mem) | {(s, self.world_size) for s in own_memory_steps(
                    self.config, self.job, self.rank, self.world_size, self.job_memory_steps)})
            out.append(("memory", mem))
        if self.disk is not None:
            try:
                committed = self.disk.committed_steps()
            except NotADirectoryError as exc:  # checkpoint_dir="model.pt": a bare OSError left restore()
                raise storage_error(exc, f"list the checkpoint directory {self.disk.describe()}") from exc
            out.append(("disk", self._own_disk_steps(committed)))
        if self.config.remote_url:
            committed = self._list_remote(restoring)
            if committed is not None:
                out.append(("remote", committed))
        return out

    def _list_remote(self, restoring: bool = False) -> list[tuple[int, int]] | None:
        """The remote tier's complete steps, or None when it is unreachable or backing off after a failure.

        Each listing used to connect again: with the remote down, every ``steps()`` paid the connect timeout and
        logged a warning. A failure now leaves it out of listings for ``remote.retry_s``, doubled at each failure
        in a row (bounded); the failure is logged once, its return once too. A restore (``restoring``) tries it
        regardless, unless its last dial here took :data:`SLOW_REMOTE_FAILURE_S` or more to fail within the
        back-off (a silent endpoint: asked again, a restart paid its timeout twice): restores are rare, and the
        remote may hold the only copy of the newest step (a new node, a lost disk); skipped, the job would resume
        from an older step or from scratch. It says so each time it fails or is skipped.
        """
        now = time.monotonic()
        if now < self._remote_retry_at:
            if not restoring:
                return None
            if self._remote_fail_s >= SLOW_REMOTE_FAILURE_S:
                # It has just taken seconds not to answer (a silent endpoint: the connect timeout): asked again
                # at once, a restarting job paid that timeout twice before it could resume (FTP: 30 s in the
                # constructor, 30 s more here). A remote that refused at once is asked again: that costs nothing.
                log.warning("restore: the remote tier did not answer %.0f s ago (it took %.0f s to fail); restoring "
                            "from the other tiers without asking it again, which may hold only older steps",
                            now - (self._remote_retry_at - self._remote_backoff), self._remote_fail_s)
                return None
        t0 = now
        try:
            store = self.remote_store()
            assert store is not None
            committed = store.committed_steps()
        except StorageUnavailableError as exc:
            # The next try connects anew: a remote restarted meanwhile (an FTP server) left the kept filesystem
            # a dead connection, and every listing and restore failed with EOFError for the rest of the job.
            self._remote = None
            self._remote_failed_once = True
            self._remote_fail_s = time.monotonic() - t0
            self._remote_failed(exc, said=restoring)
            if restoring:
                log.warning("restore: the remote tier is unreachable (%s); restoring from the other tiers, which "
                            "may hold only older steps", exc)
            return None
        self._remote_fail_s = 0.0
        if self._remote_backoff:
            self._remote_backoff = 0.0
            log.info("remote tier %s answers again; listed again", self.config.remote_url)
        return committed

    def _remote_failed(self, exc: StorageUnavailableError, said: bool = False) -> str:
        """Leaves the remote out of listings for the next back-off period; logs the first failure in a row
        (unless the caller ``said`` it), the next ones at debug level only.

        Returns:
            What happens next, for the caller's own message.
        """
        base = float(self.config.remote.retry_s)
        first = self._remote_backoff == 0
        self._remote_backoff = base if first else min(self._remote_backoff * 2, base * _REMOTE_BACKOFF_CAP)
        self._remote_retry_at = time.monotonic() + self._remote_backoff
        note = (f"it is left out of listings and retried in {self._remote_backoff:g} s (then less often, at most "
                f"every {base * _REMOTE_BACKOFF_CAP:g} s; checkpoint.remote.retry_s); saves do not upload meanwhile, the newest "
                "step is uploaded once it answers")
        if first and not said:
            log.warning("remote tier not listed: %s; %s", exc, note)
        elif not first:
            log.debug("remote tier still unreachable (%s); retried in %g s", exc, self._remote_backoff)
        return note

    def _own_disk_steps(self, committed: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``committed`` without the steps another location wrote, when the disk tier caches a remote location.

        That cache is only keyed by the folder: a ``local_cache`` given to two URLs holds both jobs of one name,
        and restoring the other URL's step would silently load another experiment. Rank 0's manifest decides for
        every rank, so all ranks list the same steps. A local checkpoint directory is not checked: it stays the
        same checkpoint when moved or mounted at another path.
        """
        if is_local_url(self.config.directory) or self.disk is None:
            return committed
        own = self.config.location
        out = []
        for s, ws in committed:
            try:
                written_for = Manifest.from_json(self.disk.read_small(s, manifest_name(0))).location
            except (OSError, CorruptCheckpointError):
                written_for = ""  # a damaged copy: the restore reports it
            if written_for and written_for != own:
                log.warning("not restoring step %d from the disk tier %s: it was written for %s, not for this "
                            "checkpointer's %s; give each location its own checkpoint.local_cache", s,
                            self.disk.describe(), written_for, own)
                continue
            out.append((s, ws))
        return out

    # ------------------------------------------------------------------ restore
    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                corrupt_ok: bool = False) -> int | None:
        """Loads the newest complete step (or ``step``) into ``state`` in place, from the fastest valid tier.

        A copy failing its checksums is skipped with a logged reason; the next tier, then the previous complete
        step, is tried. ``last_restore_tier`` names the tier that served it.

        Of ``world_size`` > 1 ranks outside a process group (before ``init_process_group``), a restore without
        ``step`` loads the newest committed step or raises: this rank cannot tell the others to fall back with it.
        Inside a process group of ``world_size`` ranks (``torch.distributed`` initialized) a restore without
        ``step`` is a collective, called by every rank: the ranks agree on one step (see :mod:`.agreement`). A
        rank whose copy of the newest step is torn falls back to an older one, the others follow it (each logs
        which steps the ranks restored), and when any rank's restore raises, every rank raises. With ``step`` it is
        a collective too (every rank passes the same step): every rank restores ``step``, or every rank raises the
        same error naming the ranks that could not load it and why (no rank falls back to another step).

        Sharded state (DTensors: FSDP2, tensor parallel) is placed into the live layout whatever the saving
        layout was: the same mesh (each rank copies its own shard), another world size, or plain tensors on one
        rank; each rank reads only the byte ranges its shards overlap (see :mod:`.shards`). Non-DTensor values of
        a sharded checkpoint are taken as replicated (as ``torch.distributed.checkpoint`` does) and read from
        rank ``rank % saved_world_size``.

        Args:
            state: the live state (same keys as saved): Stateful objects get ``load_state_dict``, tensors are
                filled with ``copy_``, other values are replaced in the mapping.
            step: restore exactly this step instead of the newest.
            corrupt_ok: when committed steps exist but every copy of every one fails verification, return None
                (a fresh start, ``state`` untouched) instead of raising. Default False: training must not silently
                restart from zero. A reshard then verifies every copy before writing (it reads each whole); a
                copy failing after part of it was loaded (a read error) raises CorruptCheckpointError instead.

        Returns:
            The restored step, or None when no tier holds a committed step (an empty directory).

        Raises:
            CorruptCheckpointError: committed steps exist but none could be loaded (the message names each step
                and why); not raised with ``corrupt_ok=True``.
            WorldSizeMismatchError: the newest checkpoint has another world size and holds neither sharded nor
                replicated state.
            NoCheckpointError: ``step`` was given and no tier holds a valid copy of it.
            StateMismatchError: the checkpoint does not fit ``state`` (the message names the key).
            CheckpointError: inside a process group, another rank's restore raised, or some ranks found no
                checkpoint while others restored one. With ``step`` in a process group every rank raises the same
                error when any rank cannot load it: NoCheckpointError (or StateMismatchError,
                WorldSizeMismatchError) when every failing rank failed so, else CheckpointError.
        """
        if step is not None:
            step = step_number(step)
        result = self._restore(state, step, corrupt_ok)
        self._restored = True
        self._resumed = True  # its saves continue (or go back in) the job's history: see _refuse_fresh_over_newer
        return result

    def _restore(self, state: MutableMapping[str, Any], step: int | None, corrupt_ok: bool) -> int | None:
        if not agreement.in_group(self.world_size):
            if self.world_size > 1 and step is None:
                return self._restore_newest_alone(state)
            return self._restore_local(state, step, corrupt_ok)
        if step is not None:
            return self._restore_step_together(state, step)
        try:
            mine = self._restore_local(state, None, corrupt_ok)
        except Exception:
            agreement.exchange(agreement.FAILED)  # the other ranks must not wait for this one, nor train
            raise
        while True:
            lowest, highest = agreement.exchange(agreement.NOTHING if mine is None else mine)
            if lowest == agreement.FAILED:
                raise CheckpointError(f"rank {self.rank}: another rank could not restore job {self.job!r} (see "
                                      "its log: corrupt copies or a state mismatch); no rank starts training")
            if lowest == highest:
                return mine
            if lowest == agreement.NOTHING:
                raise CheckpointError(
                    f"rank {self.rank}: some ranks of job {self.job!r} have no checkpoint while others restored "
                    f"up to step {highest}; check each rank's files with `trainguard ckpt verify`")
            log.warning("rank %d: ranks restored steps %d..%d of job %r; every rank resumes from step %d",
                        self.rank, lowest, highest, self.job, lowest)
            if mine != lowest:
                try:
                    mine = self._restore_local(state, None, corrupt_ok=False, at_most=lowest)
                except Exception:
                    agreement.exchange(agreement.FAILED)
                    raise

    def _restore_newest_alone(self, state: MutableMapping[str, Any]) -> int | None:
        """``restore(state)`` of one of ``world_size`` > 1 ranks with no process group to agree in (``restore``
        called before ``init_process_group`` under torchrun): the newest committed step, or an error.

        Every rank lists the same committed steps, so the newest is one step for all; only a rank that cannot load
        it would differ. Falling back alone (what a lone process does) resumed that rank from an older step than
        the others, a silent divergence of the model; the others cannot be told without a group, so this rank
        raises instead and names the way out.

        Raises:
            CorruptCheckpointError: the newest committed step cannot be loaded on this rank.
        """
        infos = self._list_steps(retired=True, restoring=True)
        if not infos:
            self._finish_pending()
            self.last_restore_tier = None
            return None
        newest = infos[-1].step
        try:
            return self._restore_local(state, newest, corrupt_ok=False)
        except NoCheckpointError as exc:
            raise CorruptCheckpointError(
                f"rank {self.rank} of {self.world_size} cannot load step {newest} of job {self.job!r} ({exc}), and "
                "outside a process group the other ranks cannot fall back with it: call "
                "torch.distributed.init_process_group() before restore() so the ranks agree on an older step, "
                "or run `trainguard ckpt verify`") from exc

    def _say_record_not_restored(self, listed: list[int]) -> None:
        """Warns when the disk tier's commit record names a step newer than every restorable one whose commit
        markers are no longer all there (deleted, or damaged): the restore silently went to an older step, with
        only an INFO "restored step 20" while the record said 30, where every other kind of damage is said."""
        if self.disk is None:
            return
        try:
            record = self.disk.record()
            if record is None or record["step"] in listed or (listed and record["step"] < listed[-1]):
                return
            newest = int(record["step"])
            if newest not in self.disk.list_steps() or self.disk.is_complete(newest)[0]:
                return  # removed as a whole (retention, a job that went back), or complete but not this run's
            ws = record.get("world_size")
            valid = set(self.disk.markers(newest))
            lacking = sorted(set(range(ws)) - valid) if isinstance(ws, int) and 0 < ws <= 1 << 20 else []
        except (OSError, ValueError, TypeError, KeyError):
            return  # the record is a hint; a listing that fails here fails the restore itself next
        who = f"of rank(s) {', '.join(map(str, lacking[:16]))}" if lacking else "of some rank"
        log.warning("not restoring step %d from the disk tier: the job's commit record names it as committed, but "
                    "the commit marker %s is missing or damaged, so the step cannot be trusted (`trainguard ckpt "
                    "verify --step %d` checks its files); restoring an older step", newest, who, newest)

    def _restore_step_together(self, state: MutableMapping[str, Any], step: int) -> int:
        """``restore(state, step=step)`` inside a process group: every rank loads ``step``, or every rank raises.

        A rank whose copy of ``step`` was missing or torn used to raise alone while the others went on with
        ``step`` and then hung in (or mismatched) their next collective. Now one exchange tells every rank
        whether all loaded it; if not, a second tells every rank which ranks failed and why, and every rank raises
        the same error (the failing ranks chain their own cause). Ranks that did load ``step`` keep it in
        ``state``; no rank returns.

        Raises:
            NoCheckpointError, StateMismatchError, WorldSizeMismatchError: every failing rank raised that kind.
            CheckpointError: the failing ranks raised different kinds, or the ranks asked for different steps.
        """
        failure: Exception | None = None
        try:
            self._restore_local(state, step, corrupt_ok=False)
        except Exception as exc:  # noqa: BLE001 - every kind must reach the exchange, or the others hang in it
            failure = exc
        lowest, highest = agreement.exchange(agreement.FAILED if failure is not None else step)
        if failure is None and lowest == highest == step:
            return step
        why = "" if failure is None else f"{type(failure).__name__}: {_first_line(failure)}"
        reports = [json.loads(r) for r in agreement.gather_text(_report(step, why, agreement.TEXT_LIMIT))]
        asked = sorted({r["step"] for r in reports})
        failed = {rank: r["error"] for rank, r in enumerate(reports) if r["error"]}
        kinds = {e.split(":", 1)[0] for e in failed.values()}
        cls = _SAME_KIND.get(kinds.pop()) if len(kinds) == 1 else None
        if len(asked) > 1:
            cls = None
            msg = (f"restore(step=...) of job {self.job!r} was called with different steps by the ranks ({asked}); "
                   "pass every rank the same step")
        else:
            msg = (f"restore(step={step}) of job {self.job!r}: {len(failed)} of {self.world_size} ranks could not "
                   f"load step {step}: " + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
                   + "; every rank raises, none trains from it (`trainguard ckpt verify` checks each rank's files)")
        err = (cls or CheckpointError)(msg)
        raise err from failure

    def _restore_local(self, state: MutableMapping[str, Any], step: int | None, corrupt_ok: bool,
                       at_most: int | None = None) -> int | None:
        """:meth:`restore` on this rank alone; ``at_most`` leaves out newer steps (another rank's fallback)."""
        self._finish_pending()
        infos = self._list_steps(retired=True, restoring=True)  # the newest step still wins; retired copies only add older ones
        listed = [i.step for i in infos]
        if step is None and at_most is None:
            self._say_record_not_restored(listed)
        if step is not None:
            infos = [i for i in infos if i.step == step]
        if at_most is not None:
            infos = [i for i in infos if i.step <= at_most]
        reasons: list[str] = []
        self._torn_into = None
        batch, infos = infos, []
        for _ in range(_RELISTS + 1):
            infos += batch
            for info in reversed(batch):
                for tier in info.tiers:
                    try:
                        if self._restore_from(tier, info, state, check_all_first=corrupt_ok):
                            return info.step
                    except (CorruptCheckpointError, StorageUnavailableError, OSError) as exc:
                        log.warning("not restoring step %d from the %s tier: %s", info.step, tier, exc)
                        reasons.append(f"step {info.step} ({tier}): "
                                       f"{str(exc).splitlines()[0] if str(exc) else exc!r}")
            if step is not None or at_most is not None or not infos:
                break
            # Every listed copy failed. A live trainer's retention removes the oldest steps as it commits new ones,
            # so a process reading its directory (an evaluation job) can find every step it listed gone: those are
            # no corrupt checkpoints. Try the steps committed since the listing before saying so.
            batch = [i for i in self._list_steps(retired=True) if i.step > infos[-1].step]  # remote tried just now
            if not batch:
                break
            log.info("every step listed was removed or failed while restoring; trying the newer steps %s",
                     [i.step for i in batch])
        self.last_restore_tier = None
        if step is not None:
            if reasons:
                raise NoCheckpointError(f"no tier holds a valid copy of step {step} for job {self.job!r} "
                                        f"({reasons[-1]}); run `trainguard ckpt verify`")
            # A mistyped step (or one retention removed) used to get only "run `trainguard ckpt ls`": name them.
            raise NoCheckpointError(f"job {self.job!r} has no committed step {step}; its committed steps are "
                                    f"{_steps_text(listed) or 'none'}")
        if infos and not corrupt_ok:
            raise CorruptCheckpointError(
                f"every committed step of job {self.job!r} ({', '.join(str(i.step) for i in infos)}) failed to "
                f"load: {'; '.join(reasons)}.{self._torn_text()} Run `trainguard ckpt verify`; pass "
                "restore(corrupt_ok=True) only if starting from scratch is acceptable")
        if self._torn_into is not None:
            # None promises the caller its own (fresh) state, untouched; this one holds part of a step.
            raise CorruptCheckpointError(
                f"every committed step of job {self.job!r} failed to load ({'; '.join(reasons)}), and the state "
                f"cannot start fresh as corrupt_ok=True asks:{self._torn_text()} Build the model and optimizer "
                "again before training from scratch, or run `trainguard ckpt verify`")
        if infos:
            log.error("every committed step failed to load (%s); starting fresh as corrupt_ok=True asks",
                      "; ".join(reasons))
        return None

    def _torn_text(self) -> str:
        if self._torn_into is None:
            return ""
        step, tier = self._torn_into
        return (f" The {tier} copy of step {step} failed after part of step {step} was already loaded into the "
                "state, which is now neither fresh nor any step.")

    def _restore_from(self, tier: str, info: StepInfo, state: MutableMapping[str, Any], *,
                      check_all_first: bool = False) -> bool:
        """Loads ``info.step`` from ``tier`` into ``state``.

        ``check_all_first``: a reshard, which reads other ranks' copies lazily (each byte range checked as it is
        read), opens and verifies every rank's copy before writing anything, so that a bad copy leaves ``state``
        as it was (``corrupt_ok=True`` returns it as the fresh start). It reads every copy whole, once more.
        A copy failing after ``state`` was partly written sets ``_torn_into``.

        Raises:
            CorruptCheckpointError, StorageUnavailableError, OSError: this copy cannot be used (try another).
            WorldSizeMismatchError, StateMismatchError: no copy of this step can fit ``state``.
        """
        src_rank = self.rank % info.world_size
        where = f"{tier} copy of step {info.step} rank {src_rank}"
        self._memory_listing = None  # one listing of the shared-memory manifests per restore attempt
        man = self._read_manifest(tier, info.step, src_rank, where)
        if info.world_size != self.world_size and not (man.replicated or man.sharded or self.config.replicated):
            raise WorldSizeMismatchError(
                f"step {info.step} was saved by {info.world_size} ranks but this job has {self.world_size}; "
                "restart with the same world size, save sharded state (DTensors), or set replicated=True if "
                "every rank holds the same state (plain DDP)")
        copies: dict[int, RankCopy] = {}
        # Same world size: this rank's own copy holds (nearly) everything it needs; read and verify it whole.
        # A reshard reads only the byte ranges it needs from every copy, its source rank's included.
        whole = info.world_size == self.world_size or not man.sharded
        try:
            own = copies[src_rank] = self._open_data(tier, info.step, src_rank, man, where, populate=whole)
            if self.config.verify_on_restore and whole:
                own.verify()
            loader: Any = own.loader()
            if man.sharded:
                manifests: dict[int, Manifest] = {src_rank: man}

                def all_manifests() -> dict[int, Manifest]:
                    for r in range(info.world_size):
                        if r not in manifests:
                            manifests[r] = self._read_manifest(tier, info.step, r, f"{tier} copy of step "
                                                               f"{info.step} rank {r}")
                    return manifests

                def open_rank(r: int) -> RankCopy:
                    if r not in copies:
                        copies[r] = self._open_data(tier, info.step, r, all_manifests()[r],
                                                    f"{tier} copy of step {info.step} rank {r}", populate=False)
                    return copies[r]

                own_verified = whole
                if check_all_first and not whole:
                    for r in range(info.world_size):
                        if self.config.verify_on_restore:
                            open_rank(r).verify()
                        else:
                            open_rank(r)  # opening checks each file's size: a torn one fails here
                    own_verified = self.config.verify_on_restore
                loader = ShardedLoader(own, open_rank, all_manifests, verify=self.config.verify_on_restore,
                                       own_verified=own_verified)
            check_fits_before_loading(man.tree, man.tensors, state, loader=loader)
            try:
                restore_into(man.tree, loader, state)
            except BaseException:
                self._torn_into = (info.step, tier)
                raise
        finally:
            self.last_restore_read = {r: c.bytes_touched for r, c in copies.items() if c.bytes_touched}
            for c in copies.values():
                c.close()
        self.last_restore_tier = tier
        log.info("restored step %d (rank %d's copy) from the %s tier", info.step, src_rank, tier)
        return True

    def _memory_copy(self, step: int, rank: int) -> Any:
        if self._memory_listing is None:
            self._memory_listing = arena_mod.memory_manifests(self.config.memory.directory, self.job,
                                                              self.config.location, retired=True)
        return self._memory_listing.get(step, {}).get(rank)

    def _read_manifest(self, tier: str, step: int, rank: int, where: str) -> Manifest:
        if tier == "memory":
            found = self._memory_copy(step, rank)
            if found is None:
                raise CorruptCheckpointError(f"{where} vanished")
            return found[1]
        store: StepStore | None = self.disk if tier == "disk" else self.remote_store()
        assert store is not None
        try:
            raw = store.read_small(step, manifest_name(rank))
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{where}: manifest is missing") from exc
        return Manifest.from_json(raw, where).check_place(step, rank, where)

    def _open_data(self, tier: str, step: int, rank: int, man: Manifest, where: str, populate: bool) -> RankCopy:
        if tier == "memory":
            found = self._memory_copy(step, rank)
            if found is None or found[1].created != man.created:
                raise CorruptCheckpointError(f"{where} was replaced while restoring")
            copy = RankCopy(man, found[0].data, where, shared_lock=True, populate=populate)
            # Under the shared lock the writer cannot reuse the slot; check it was not reused before we took it.
            if arena_mod.read_tag(found[0]) != str(step) or not (os.path.exists(found[0].manifest)
                                                                  or os.path.exists(found[0].retired)):
                copy.close()
                raise CorruptCheckpointError(f"{where} was replaced while restoring")
            return copy
        store: StepStore | None = self.disk if tier == "disk" else self.remote_store()
        assert store is not None
        path = store.local_data_path(step, rank)
        if path is None:
            tmpdir = self.config.disk_directory if self.disk and os.path.isdir(self.config.disk_directory) else None
            fd, path = tempfile.mkstemp(prefix="trainguard-restore-", suffix=".data", dir=tmpdir)
            os.close(fd)
            try:
                store.fetch_data(step, rank, path)
                return RankCopy(man, path, where, populate=populate)
            finally:
                os.unlink(path)  # the copy's open descriptor keeps the file readable
        return RankCopy(man, path, where, populate=populate, advisory_lock=True)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Waits for pending persists, stops the private persist process, releases the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            for _, h in self._hooked.values():
                h.remove()
            self._hooked.clear()
            with self._lock:
                deadline = time.monotonic() + 600
                while (any(self._slot_busy) and self._channel is not None and self._channel.alive()
                       and time.monotonic() < deadline):
                    self._lock.wait(0.5)
            channel = self._channel
            if channel is not None:
                channel.close()
            # Only the lease holder removes its area, and only when no agent-owned service keeps it for a
            # restarted worker. A Checkpointer that never saved holds no lease and removes nothing.
            remove_memory = (channel is None or channel.owns_memory) and not self.config.memory.keep_on_close
            # Fallback staging is not a tier: nothing to keep for a successor.
            remove = remove_memory or self.staging not in (None, "memory")
            self._close_arena(remove=remove, remove_outgrown=remove_memory)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: How often a restore lists the steps again when every listed one failed and newer ones were committed meanwhile.
_RELISTS = 3

#: Error kinds a collective ``restore(step=...)`` raises on every rank when every failing rank raised that kind.
_SAME_KIND: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (NoCheckpointError, StateMismatchError, WorldSizeMismatchError)}


def _report(step: int, why: str, limit: int) -> str:
    """``{"step": step, "error": why}`` as JSON of at most ``limit`` bytes, ``why`` shortened to fit: cut at the
    byte limit, a long reason (a deep checkpoint path) left JSON no rank could parse, and every rank raised a
    JSONDecodeError instead of the restore's error."""
    text = json.dumps({"step": step, "error": why})  # ASCII (escapes): its length is its size in bytes
    keep = len(why)
    while len(text) > limit and keep > 0:
        # escapes make a character up to 12 bytes: shrink in proportion to the overshoot, then by a tenth
        keep = min(keep - max(1, keep // 10), keep * limit // len(text))
        text = json.dumps({"step": step, "error": why[:max(0, keep)] + "..."})
    return text


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else repr(exc)


def step_number(step: Any) -> int:
    """``step`` as a plain ``int``: numpy integers (a loop over ``np.arange``) and integer 0-d tensors are taken.

    The step travels to the persist process as JSON and names the slot's tag and the step folder: an
    ``np.int64`` step failed the JSON encoding in the snapshot thread, leaving its staging slot taken for ever, so
    with ``overlap_with`` the third save blocked training; a float ``5.0`` tagged the slot "5.0", which the
    persist process took for a reused slot, and no save ever reached a tier.

    Raises:
        CheckpointError: ``step`` is not an integer (a float, a bool, a string).
    """
    if not isinstance(step, bool) and not (isinstance(step, torch.Tensor) and step.dtype == torch.bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise CheckpointError(f"step must be an integer, got {type(step).__name__} {step!r}; pass int(step)")


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


__all__ = ["Checkpointer", "SaveHandle", "StepInfo"]


def _steps_text(steps: list[int]) -> str:
    """``1, 2, 3`` or, for many steps, ``1, 2, ... 9 (7 steps)``."""
    steps = sorted(steps)
    if len(steps) <= 4:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ... {steps[-1]} ({len(steps)} steps)"
