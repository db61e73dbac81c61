"""The node agent's view of the job's in-memory checkpoints: what this node holds, and where its ranks restore from.

The agent-owned checkpoint service keeps each local rank's newest snapshots in the node's shared-memory arena
(``<memory directory>/<job>/rank_NNNNN/``, :mod:`trainguard.checkpoint.arena`), and they outlive crashed workers.
:class:`MemoryTier` rescans that arena in a background thread, verifies every new copy once against its chunk
checksums (a copy failing them is never reported), and keeps the result ready for the heartbeat, which carries it
to the coordinator (``NodeHeartbeatRequest.memory``). The coordinator answers a new generation with a restore plan
(:mod:`trainguard.recovery.memory_plan`); :func:`apply_restore_plan` hands each local worker its part of it in
:data:`~trainguard.checkpoint.config.RESTORE_PLAN_ENV`, so the worker's Checkpointer may restore the job-wide
memory steps from its own node's memory although the other ranks' copies lie on other hosts.

Arena root: the memory directory of the workers' checkpoint config (``$TRAINGUARD_CHECKPOINT_SHM_DIR``, default
``/dev/shm/trainguard``); nodes sharing one host (the netns drill) each set their own.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.config import RESTORE_PLAN_ENV, CheckpointConfig, MemoryTierConfig
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.manifest import Manifest, verify_file_checksums
from trainguard.proto import coordinator_pb2

log = logging.getLogger(__name__)

#: Names of the proto ``RestoreSource`` values as workers see them.
SOURCE_NAMES = {
    coordinator_pb2.RESTORE_SOURCE_LOCAL_MEMORY: "local_memory",
    coordinator_pb2.RESTORE_SOURCE_PEER_MEMORY: "peer_memory",
    coordinator_pb2.RESTORE_SOURCE_STORAGE: "storage",
}


@dataclass(frozen=True)
class _CopyKey:
    """Identifies one copy in one slot: a slot reused for a new snapshot is a new copy."""

    data: str
    step: int
    rank: int
    created: float


class MemoryTier:
    """Verified in-memory checkpoint holdings of one job on this node.

    Args:
        shm_root: the arena root (the workers' ``checkpoint.memory.directory``).
        job: job name.
        location: checkpoint location of the job (copies of another location sharing the job name are ignored).
        interval_s: seconds between two rescans (unchanged manifests are not parsed again). Default 0.05.
    """

    def __init__(self, shm_root: str, job: str, location: str, interval_s: float = 0.05, replicas=None) -> None:
        self.shm_root, self.job, self.location = shm_root, job, location
        #: the node's :class:`~trainguard.checkpoint.replica_store.ReplicaStore`, whose copies are reported as
        #: ``replica_ranks`` (verified when they arrived); None without peer replication.
        self.replicas = replicas
        self._own: dict[int, tuple[int, arena_mod.SlotPaths, Manifest]] = {}
        self._own_steps: dict[tuple[int, int], tuple[arena_mod.SlotPaths, Manifest]] = {}  # (rank, step): verified
        self._manifests: dict[str, tuple[int, int, Manifest]] = {}  # parsed manifests, by path and mtime
        #: called (from the scanning thread) when a rank's newest own copy changed: the replica sender wakes.
        self.on_new_copy: Callable[[], None] | None = None
        self.interval_s = interval_s
        self._verified: dict[_CopyKey, bool] = {}
        self._holdings: list[coordinator_pb2.MemoryHolding] = []
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()  # the thread and the heartbeat both scan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: copies that failed their checksums since start (reported, never restored from memory).
        self.corrupt = 0

    @classmethod
    def for_checkpoint_dir(cls, checkpoint_dir: str | None, job: str) -> "MemoryTier | None":
        """The tier of a job checkpointing to ``checkpoint_dir`` (None when it does not checkpoint)."""
        if not checkpoint_dir:
            return None
        try:
            location = CheckpointConfig(directory=checkpoint_dir).location
        except CheckpointError as exc:
            log.warning("memory tier not reported: %s", exc)
            return None
        return cls(MemoryTierConfig().directory, job, location)

    # -- scanning ---------------------------------------------------------------------------------------------
    def scan(self) -> list[coordinator_pb2.MemoryHolding]:
        """Lists the arena, verifies copies not seen before, and stores the holdings :meth:`holdings` returns.

        The heartbeat calls it too, so the coordinator hears of a snapshot that landed just before a fault; the
        background thread has normally verified the new copies by then, leaving the heartbeat a directory listing.
        """
        with self._scan_lock:
            return self._scan()

    def _scan(self) -> list[coordinator_pb2.MemoryHolding]:
        found = arena_mod.memory_manifests(self.shm_root, self.job, self.location, self._manifests)
        live = {p.manifest for ranks in found.values() for p, _ in ranks.values()}
        for path in set(self._manifests) - live:
            del self._manifests[path]
        seen: set[_CopyKey] = set()
        own: dict[int, tuple[int, arena_mod.SlotPaths, Manifest]] = {}
        own_steps: dict[tuple[int, int], tuple[arena_mod.SlotPaths, Manifest]] = {}
        by_step: dict[tuple[int, int], list[int]] = {}
        for step, ranks in found.items():
            for rank, (paths, man) in ranks.items():
                key = _CopyKey(paths.data, step, rank, man.created)
                seen.add(key)
                ok = self._verified.get(key)
                if ok is None:
                    ok = self._verify(paths, man)
                    if ok is not None:
                        self._verified[key] = ok
                if ok:
                    by_step.setdefault((step, man.world_size), []).append(rank)
                    own_steps[(rank, step)] = (paths, man)
                    if rank not in own or own[rank][0] < step:
                        own[rank] = (step, paths, man)
        for key in set(self._verified) - seen:
            del self._verified[key]
        replicated: dict[tuple[int, int], list[int]] = {}
        if self.replicas is not None:
            for r in self.replicas.replicas():
                replicated.setdefault((r.step, r.manifest.world_size), []).append(r.rank)
        out = [coordinator_pb2.MemoryHolding(step=s, world_size=ws, ranks=sorted(by_step.get((s, ws), ())),
                                             replica_ranks=sorted(replicated.get((s, ws), ())))
               for (s, ws) in sorted(set(by_step) | set(replicated), reverse=True)]
        with self._lock:
            self._holdings = out
            changed = {r: c[0] for r, c in own.items()} != {r: c[0] for r, c in self._own.items()}
            self._own = own
            self._own_steps = own_steps
        if changed and self.on_new_copy is not None:
            self.on_new_copy()
        return out

    def own_copies(self) -> dict[int, tuple[int, arena_mod.SlotPaths, Manifest]]:
        """rank -> (step, slot paths, manifest) of the newest verified copy of each rank in this node's arena."""
        with self._lock:
            return dict(self._own)

    def own_copy(self, rank: int, step: int | None = None) -> tuple[str, Manifest] | None:
        """(data path, manifest) of this node's newest verified copy of ``rank`` (with ``step``: of exactly that
        step, in whichever slot holds it), or None."""
        if step is not None:
            with self._lock:
                c = self._own_steps.get((rank, step))
            return (c[0].data, c[1]) if c is not None else None
        c = self.own_copies().get(rank)
        return (c[1].data, c[2]) if c is not None else None

    def recheck(self, data_path: str) -> None:
        """Forgets that the copies in the slot at ``data_path`` were verified, so the next scan checks them again.

        Called when serving or pushing that slot found it damaged (a checksum mismatch, or the file cut short):
        verified once when it appeared, a copy that rotted later stayed reported, and the coordinator kept
        planning restores from it. A slot merely rewritten by a newer snapshot is a new copy anyway."""
        with self._scan_lock:  # the scan reads and fills the cache
            for key in [k for k in self._verified if k.data == data_path]:
                del self._verified[key]

    def _verify(self, paths: arena_mod.SlotPaths, man) -> bool | None:
        """True when the slot still holds this copy and every chunk matches; None when it changed meanwhile."""
        try:
            fd = arena_mod.open_locked(paths)  # shared lock: the writer cannot reuse the slot now
        except (CheckpointError, OSError):
            return None
        try:
            if arena_mod.read_tag(paths) != str(man.step) or not os.path.exists(paths.manifest):
                return None
            # pread, not a mapping: a slot cut short under a mapping raised SIGBUS here and killed the agent.
            verify_file_checksums(fd, man, f"memory copy of step {man.step} rank {man.rank} ({paths.data})")
            return True
        except CheckpointError as exc:
            self.corrupt += 1
            log.error("not reporting a corrupt in-memory checkpoint: %s", exc)
            return False
        except OSError as exc:  # an I/O error reading the slot: a damaged copy too, never a crashed scan
            self.corrupt += 1
            log.error("not reporting an unreadable in-memory checkpoint %s: %s", paths.data, exc)
            return False
        finally:
            os.close(fd)

    def holdings(self) -> list[coordinator_pb2.MemoryHolding]:
        """The latest verified holdings (what the heartbeat carries)."""
        with self._lock:
            return list(self._holdings)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> "MemoryTier":
        """Rescans every ``interval_s`` in a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="memory-tier", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - the scan must never take the agent down; the next one retries
                log.exception("scanning the in-memory checkpoints failed")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stops the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def plan_for_rank(plan: coordinator_pb2.MemoryRestorePlan, rank: int, generation: int) -> str:
    """The JSON a worker of ``rank`` gets in :data:`RESTORE_PLAN_ENV`."""
    entry = next((r for r in plan.ranks if r.rank == rank), None)
    source = SOURCE_NAMES.get(entry.source, "storage") if entry is not None else "storage"
    return json.dumps({"generation": generation, "step": plan.step, "memory_steps": list(plan.memory_steps),
                       "source": source, "peer_node": entry.peer_node if entry is not None else ""},
                      separators=(",", ":"))


def apply_restore_plan(specs: Sequence, plan: coordinator_pb2.MemoryRestorePlan | None, generation: int) -> None:
    """Puts each local worker's part of ``plan`` into its environment (nothing without a plan)."""
    for spec in specs:
        spec.env.pop(RESTORE_PLAN_ENV, None)
        if plan is not None:
            spec.env[RESTORE_PLAN_ENV] = plan_for_rank(plan, spec.rank, generation)
