"""The public checkpointer: ``save`` (snapshot, then background persist), ``wait``, ``restore``, ``steps``.

Usage::

    from trainguard.checkpoint import Checkpointer, CheckpointConfig

    ckpt = Checkpointer(CheckpointConfig(directory="ckpt"), rank=0, world_size=1, job="demo")
    start = ckpt.restore({"model": model, "optim": opt}) or 0
    for step in range(start, n):
        loss = model(x).sum(); loss.backward()
        opt.step(); opt.zero_grad()
        ckpt.save({"model": model, "optim": opt, "step": step}, step, overlap_with=opt)
    ckpt.close()

See :mod:`.snapshot` for the overlap contract and :mod:`.service` for who runs the persist process.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.arena import Arena, write_tag
from trainguard.checkpoint.channel import PersistChannel, open_channel
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageUnavailableError,
    WorldSizeMismatchError,
)
from trainguard.checkpoint.events import EventSink
from trainguard.checkpoint.manifest import Manifest, plan_layout
from trainguard.checkpoint.reader import RankCopy
from trainguard.checkpoint.snapshot import PendingCopy, SnapshotCopier, storage_ptrs
from trainguard.checkpoint.storage import FsspecStore, LocalStore, StepStore, manifest_name
from trainguard.checkpoint.tree import capture, restore_into

log = logging.getLogger(__name__)

TIER_ORDER = ("memory", "disk", "remote")


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
        CheckpointError: the disk tier's directory cannot be written, the shared-memory arena cannot be created,
            or the persist process cannot be reached.
    """

    def __init__(self, config: CheckpointConfig, rank: int = 0, world_size: int = 1, job: str = "default",
                 on_event: Callable[[Any], None] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is outside world size {world_size}; pass 0 <= rank < world_size")
        if not job or "/" in job or job.startswith("."):
            raise CheckpointError(f"job name {job!r} is not a valid directory name; use letters, digits, -_")
        self.config = config
        self.rank, self.world_size, self.job = rank, world_size, job
        self.events = EventSink(on_event, rank)
        self.last_restore_tier: str | None = None
        self._lock = threading.Condition()
        self._status: dict[int, _StepStatus] = {}
        self._slot_busy: list[bool] = []
        self._slot_step: list[int] = []
        self._pending: PendingCopy | None = None
        self._hooked: dict[int, Any] = {}
        self._closed = False
        self._last_step: int | None = None
        self._copier = SnapshotCopier()
        self._staging: dict[int, torch.Tensor] = {}

        self.disk: LocalStore | None = None
        if config.disk.enabled:
            self.disk = LocalStore(config.disk_directory, job, fsync=config.disk.fsync)
            self.disk.check_writable()
        self._remote: FsspecStore | None = None
        if config.remote_url:
            try:
                self.remote_store()
            except StorageUnavailableError as exc:
                self.events.storage_failed("remote", None, str(exc), 0)
        nslots = (config.memory.keep + 1) if config.memory.enabled else 2
        self.arena = Arena(config.memory.directory, job, rank, nslots)
        self._slot_busy = [False] * self.arena.nslots
        # Slots surviving a crashed predecessor keep their step tags: reuse the oldest first, keep the newest.
        self._slot_step = [int(t) if (t := arena_mod.read_tag(self.arena.paths(i))).isdigit() else -1
                           for i in range(self.arena.nslots)]
        self.channel: PersistChannel = open_channel(config, job, rank, self._on_report)

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
            self._remote = FsspecStore(url, self.job, self.config.remote.storage_options)
        return self._remote

    def _expected_tiers(self) -> set[str]:
        t = set()
        if self.config.memory.enabled:
            t.add("memory")
        if self.config.disk.enabled:
            t.add("disk")
        if self.config.remote_url:
            t.add("remote")
        return t

    # ------------------------------------------------------------------ save
    def prepare(self, state: Mapping[str, Any]) -> int:
        """Allocates and pre-faults every staging slot for ``state``'s size, so no save pays that cost.

        Optional: the first saves allocate lazily otherwise (about 1.4 s per GiB of tmpfs on first touch).

        Args:
            state: the state that will be saved (only its tensor sizes are read).

        Returns:
            Bytes per slot.
        """
        cap = capture(state)
        _, data_bytes = plan_layout(
            ((c.key, str(c.tensor.dtype).removeprefix("torch."), tuple(c.tensor.shape)) for c in cap.tensors),
            self.config.persist.alignment)
        self.arena.preallocate(data_bytes)
        return data_bytes

    def save(self, state: Mapping[str, Any], step: int, overlap_with: Any = None) -> SaveHandle:
        """Snapshots ``state`` and hands it to the persist process; returns after the snapshot phase.

        Args:
            state: name -> tensor / container / scalar / Stateful (see :mod:`.tree`).
            step: training step number (>= 0); saving a step lower than or equal to a previous one is allowed
                (it replaces that step).
            overlap_with: an optimizer (or a list of them). Its parameters and state tensors are then copied in
                the background while the next forward/backward runs; a step pre-hook installed on it waits for
                the copy before the optimizer mutates them. Without it every tensor is copied before returning.

        Returns:
            A handle whose ``wait()`` blocks until the step is durable.

        Raises:
            CheckpointError: the state has an unsupported value, or the checkpointer is closed. Storage
                failures are not raised: they are reported through ``on_event`` and the log.
        """
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer; create a new one")
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        self._finish_pending()
        cap = capture(state)
        alignment = self.config.persist.alignment
        entries, data_bytes = plan_layout(
            ((c.key, str(c.tensor.dtype).removeprefix("torch."), tuple(c.tensor.shape)) for c in cap.tensors),
            alignment)
        manifest = Manifest(job=self.job, step=step, rank=self.rank, world_size=self.world_size, tensors=entries,
                            tree=cap.tree, data_bytes=data_bytes, alignment=alignment,
                            chunk_bytes=self.config.persist.chunk_mib << 20, replicated=self.config.replicated)
        index = self._acquire_slot()
        try:
            slot = self.arena.get(index, data_bytes)
            slot.lock(exclusive=True)
        except BaseException:
            self._release_slot(index)
            raise
        try:
            paths = slot.paths
            try:
                os.unlink(paths.manifest)  # the slot stops being a memory-tier copy before it is overwritten
            except FileNotFoundError:
                pass
            write_tag(paths, arena_mod.WRITING)
            staging = self._staging_of(index, slot)
            deferred_ptrs = storage_ptrs(_as_list(overlap_with)) if overlap_with is not None else set()
            eager, deferred = [], []
            for c, e in zip(cap.tensors, entries):
                if e.nbytes == 0:
                    continue
                dst = staging[e.offset:e.offset + e.nbytes].view(c.tensor.dtype).view(c.tensor.shape)
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
            self._status[step] = _StepStatus(expected=self._expected_tiers(), slot=index)
            self._slot_step[index] = step
            self._last_step = step
            # Forget old, finished steps so a long run does not grow this dict without bound.
            for old in sorted(s for s in self._status if self._status[s].released)[:-64]:
                del self._status[old]

        def publish(err: BaseException | None) -> None:
            try:
                if err is not None:
                    self._fail_step(step, f"snapshot copy failed: {err}")
                    return
                write_tag(paths, str(step))
            finally:
                slot.unlock()
            if err is None:
                self._submit(step, index, manifest, paths)

        if deferred:
            self._install_hooks(_as_list(overlap_with))
            self._pending = self._copier.copy_async(deferred, publish)
        else:
            publish(None)
        return SaveHandle(step, self)

    def _staging_of(self, index: int, slot: Any) -> torch.Tensor:
        t = self._staging.get(index)
        if t is None or t.numel() != slot.size:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.frombuffer(slot.map, dtype=torch.uint8)
            self._copier.pin(t)
            self._staging[index] = t
        return t

    def _submit(self, step: int, index: int, manifest: Manifest, paths: Any) -> None:
        cfg = self.config
        req = {
            "op": "persist", "id": step, "job": self.job, "rank": self.rank, "world_size": self.world_size,
            "step": step, "slot": paths.data[: -len(".data")],
            "manifest": arena_mod.manifest_dict(manifest),
            "memory": cfg.memory.enabled,
            "disk": {"root": cfg.disk_directory, "keep": cfg.disk.keep, "fsync": cfg.disk.fsync}
            if cfg.disk.enabled else None,
            "remote": {"url": cfg.remote_url, "keep": cfg.remote.keep, "storage_options": cfg.remote.storage_options}
            if cfg.remote_url else None,
            "bandwidth_mib_s": cfg.persist.bandwidth_mib_s,
        }
        try:
            self.channel.submit(req)
        except CheckpointError as exc:
            self._fail_step(step, str(exc))
            self.events.storage_failed("persist", step, str(exc), 0)

    def _fail_step(self, step: int, message: str) -> None:
        with self._lock:
            st = self._status.get(step)
            if st is not None:
                for t in st.expected - st.ok:
                    st.failed.setdefault(t, message)
                st.released = True
                if st.slot >= 0:
                    self._slot_busy[st.slot] = False
            self._lock.notify_all()

    def _on_report(self, msg: dict[str, Any]) -> None:
        """Receives persist outcomes (from the persist process's reader thread or inline)."""
        step = int(msg.get("step", -1))
        with self._lock:
            st = self._status.get(step)
            if msg.get("op") == "tier" and st is not None:
                if msg.get("ok"):
                    st.ok.add(msg["tier"])
                else:
                    st.failed[msg["tier"]] = msg.get("error", "failed")
            elif msg.get("op") == "released" and st is not None:
                st.released = True
                if st.slot >= 0:
                    self._slot_busy[st.slot] = False
            self._lock.notify_all()
        if msg.get("op") == "tier" and not msg.get("ok"):
            self.events.storage_failed(msg.get("tier", "?"), step, msg.get("error", ""), int(msg.get("errno", 0)))

    def _acquire_slot(self) -> int:
        """Picks a free slot holding the oldest step; waits while every slot is being persisted."""
        with self._lock:
            while True:
                free = [i for i, b in enumerate(self._slot_busy) if not b]
                if free:
                    i = min(free, key=lambda j: self._slot_step[j])
                    self._slot_busy[i] = True
                    return i
                if not self.channel.alive():
                    raise CheckpointError("the persist process died; create a new Checkpointer")
                self._lock.wait(0.5)

    def _release_slot(self, index: int) -> None:
        with self._lock:
            self._slot_busy[index] = False
            self._lock.notify_all()

    def _install_hooks(self, optimizers: Sequence[Any]) -> None:
        for opt in optimizers:
            if id(opt) in self._hooked:
                continue

            def pre_hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
                self._finish_pending(host=False)

            self._hooked[id(opt)] = opt.register_step_pre_hook(pre_hook)

    def _finish_pending(self, host: bool = True) -> None:
        pending = self._pending
        if pending is None:
            return
        if host:
            pending.wait_host()
            self._pending = None
        else:
            pending.wait_before_mutation()
            if pending.done:
                self._pending = None

    # ------------------------------------------------------------------ wait
    def wait(self, step: int | None = None, timeout: float | None = None) -> bool:
        """Blocks until this rank's copy of ``step`` is durable in every enabled tier (or failed).

        Args:
            step: the step; default the latest saved.
            timeout: seconds; None waits as long as needed.

        Returns:
            True when durable in every enabled tier; False when a tier failed for it (already reported through
            ``on_event``) or the timeout expired. Never raises for storage failures.

        Raises:
            CheckpointError: ``step`` was never saved by this checkpointer.
        """
        if step is None:
            step = self._last_step
            if step is None:
                return True
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
        found: dict[int, StepInfo] = {}
        for tier, committed in self._committed_by_tier():
            for s, ws in committed:
                found.setdefault(s, StepInfo(s, ws)).tiers.append(tier)
        return [found[s] for s in sorted(found)]

    def _committed_by_tier(self) -> list[tuple[str, list[tuple[int, int]]]]:
        out: list[tuple[str, list[tuple[int, int]]]] = []
        if self.config.memory.enabled:
            out.append(("memory", arena_mod.memory_committed(self.config.memory.directory, self.job)))
        if self.disk is not None:
            out.append(("disk", self.disk.committed_steps()))
        if self.config.remote_url:
            try:
                store = self.remote_store()
                if store is not None:
                    out.append(("remote", store.committed_steps()))
            except StorageUnavailableError as exc:
                log.warning("remote tier not listed: %s", exc)
        return out

    # ------------------------------------------------------------------ restore
    def restore(self, state: MutableMapping[str, Any], step: int | None = None) -> int | None:
        """Loads the newest complete step (or ``step``) into ``state`` in place, from the fastest valid tier.

        A copy failing its checksums is skipped with a logged reason; the next tier, then the previous complete
        step, is tried. ``last_restore_tier`` names the tier that served it.

        Args:
            state: the live state (same keys as saved): Stateful objects get ``load_state_dict``, tensors are
                filled with ``copy_``, other values are replaced in the mapping.
            step: restore exactly this step instead of the newest.

        Returns:
            The restored step, or None when no tier holds a complete checkpoint.

        Raises:
            WorldSizeMismatchError: the newest checkpoint has another world size and the state is not replicated.
            NoCheckpointError: ``step`` was given and no tier holds a valid copy of it.
            StateMismatchError: the checkpoint does not fit ``state``.
        """
        self._finish_pending()
        infos = self.steps()
        if step is not None:
            infos = [i for i in infos if i.step == step]
        reasons: list[str] = []
        for info in reversed(infos):
            src_rank = self._source_rank(info)
            for tier in info.tiers:
                where = f"{tier} copy of step {info.step} rank {src_rank}"
                try:
                    copy = self._open_copy(tier, info.step, src_rank, where)
                except (CorruptCheckpointError, StorageUnavailableError, OSError) as exc:
                    log.warning("not restoring from the %s: %s", where, exc)
                    reasons.append(str(exc))
                    continue
                try:
                    if self.config.verify_on_restore:
                        copy.verify()
                    restore_into(copy.manifest.tree, copy.loader(), state)
                except CorruptCheckpointError as exc:
                    log.warning("not restoring from the %s: %s; trying an older copy", where, exc)
                    reasons.append(str(exc))
                    continue
                finally:
                    copy.close()
                self.last_restore_tier = tier
                log.info("restored step %d (rank %d) from the %s tier", info.step, src_rank, tier)
                return info.step
        if step is not None:
            raise NoCheckpointError(f"no tier holds a valid copy of step {step} for job {self.job!r}"
                                    + (f" ({reasons[-1]})" if reasons else "") + "; run `trainguard ckpt ls`")
        self.last_restore_tier = None
        return None

    def _source_rank(self, info: StepInfo) -> int:
        if info.world_size == self.world_size:
            return self.rank
        if self.config.replicated:
            return self.rank % info.world_size
        raise WorldSizeMismatchError(
            f"step {info.step} was saved by {info.world_size} ranks but this job has {self.world_size}; restart "
            "with the same world size, or set replicated=True if every rank holds the same state (plain DDP)")

    def _open_copy(self, tier: str, step: int, rank: int, where: str) -> RankCopy:
        if tier == "memory":
            found = arena_mod.memory_manifests(self.config.memory.directory, self.job).get(step, {}).get(rank)
            if found is None:
                raise CorruptCheckpointError(f"{where} vanished")
            paths, man = found
            return RankCopy(man, paths.data, where, shared_lock=True)
        store: StepStore | None = self.disk if tier == "disk" else self.remote_store()
        assert store is not None
        try:
            raw = store.read_small(step, manifest_name(rank))
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{where}: manifest is missing") from exc
        man = Manifest.from_json(raw, where)
        if man.step != step or man.rank != rank:
            raise CorruptCheckpointError(f"{where}: manifest names step {man.step} rank {man.rank}")
        path = store.local_data_path(step, rank)
        if path is None:
            fd, path = tempfile.mkstemp(prefix="trainguard-restore-", suffix=".data",
                                        dir=self.config.disk_directory if self.disk else None)
            os.close(fd)
            try:
                store.fetch_data(step, rank, path)
                return RankCopy(man, path, where)
            finally:
                os.unlink(path)  # the mapping keeps the pages alive
        return RankCopy(man, path, where)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Waits for pending persists, stops the private persist process, releases the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            for h in self._hooked.values():
                h.remove()
            self._hooked.clear()
            with self._lock:
                deadline = time.monotonic() + 600
                while any(self._slot_busy) and self.channel.alive() and time.monotonic() < deadline:
                    self._lock.wait(0.5)
            self.channel.close()
            self._staging.clear()
            self._copier.unpin_all()
            remove = self.channel.owns_memory and not self.config.memory.keep_on_close
            self.arena.close(remove=remove)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


__all__ = ["Checkpointer", "SaveHandle", "StepInfo"]
