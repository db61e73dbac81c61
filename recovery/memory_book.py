"""The coordinator's bookkeeping of the job-wide memory tier: who holds which in-memory checkpoint copies.

Each node's heartbeat carries its latest in-memory checkpoint holdings and the address of its replica server.
:class:`MemoryBook` keeps them, says whether a new generation's STARTs may go out yet (every slot holder reported
its holdings since the table was installed, or the wait ran out), builds the restore plan for the current table
(:func:`~trainguard.recovery.memory_plan.plan_restore`) and each node's replica targets
(:func:`~trainguard.recovery.memory_plan.buddies`), both cached per table and membership version.

It is not thread-safe on its own: :class:`~trainguard.recovery.coordinator.JobCoordinator` calls every method
with its lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainguard.recovery.domain import GenerationTable
from trainguard.recovery.memory_plan import MemoryHolding, RestorePlan, buddies, plan_restore

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split

#: A replica target as a heartbeat reply carries it: (buddy node id, its replica server address).
Target = tuple[str, str]


class MemoryBook:
    """Memory-tier state of one job (call with the coordinator's lock held).

    Args:
        job: the job name, for log lines.
        alive: whether a node id is a live member now.
    """

    def __init__(self, job: str, alive: Callable[[str], bool]) -> None:
        self._job = job
        self._alive = alive
        self._memory: dict[str, tuple[MemoryHolding, ...]] = {}
        self._plan_cache: tuple[tuple[object, int, int], RestorePlan | None] | None = None
        self._plan_said: tuple[int, int, tuple] | None = None  # the last plan logged: (generation, step, sources)
        self._fresh: set[str] = set()  # nodes whose holdings arrived after the current table was installed
        self._fresh_slots = 0  # how many of them hold a slot of the current table
        self._memory_known = False  # some node reported in-memory copies (else no plan and no wait)
        self._replica_addr: dict[str, str] = {}  # node -> its replica server (peer replication)
        self._holds_none: set[str] = set()  # nodes that hold no other node's replicas: never buddies
        self._buddy_cache: tuple[tuple[object, int], dict[str, tuple[Target, ...]]] | None = None
        self._formed_at = 0.0

    def record(self, node_id: str, memory: tuple[MemoryHolding, ...], replica_address: str,
               holds_none: bool = False) -> None:
        """Keeps a heartbeat's holdings, replica address and whether the node holds others' replicas
        (``holds_none``: ``--replica-memory-mib 0``); a change drops the cached plan (and targets)."""
        if self._memory.get(node_id, ()) != memory:
            self._memory[node_id] = memory
            self._memory_known = self._memory_known or bool(memory)
            self._plan_cache = None
        if self._replica_addr.get(node_id, "") != replica_address:
            self._replica_addr[node_id] = replica_address
            self._plan_cache = self._buddy_cache = None
        if (node_id in self._holds_none) != holds_none:
            if holds_none:
                self._holds_none.add(node_id)
            else:
                self._holds_none.discard(node_id)
            self._buddy_cache = None

    def forget(self, node_id: str) -> None:
        """Drops everything about a node the coordinator forgot (an expired member holding no slot)."""
        self._memory.pop(node_id, None)
        self._replica_addr.pop(node_id, None)
        self._holds_none.discard(node_id)
        self._fresh.discard(node_id)
        self._plan_cache = self._buddy_cache = None

    def table_installed(self, now: float) -> None:
        """A new table was installed at ``now``: no node's holdings are fresh for it yet."""
        self._fresh.clear()
        self._fresh_slots = 0
        self._formed_at = now

    def mark_fresh(self, node_id: str, table: GenerationTable | None) -> None:
        """The node's holdings were recorded since ``table`` was installed (call after the beat was handled)."""
        if node_id not in self._fresh:
            self._fresh.add(node_id)
            if table is not None and table.slot_of(node_id) is not None:
                self._fresh_slots += 1

    def holdings_fresh(self, table: GenerationTable | None, clock: Callable[[], float], interval_s: float) -> bool:
        """Whether every node of the current table reported its memory holdings since the table was installed
        (or nobody reports any, or two heartbeat intervals passed). A snapshot can land on a node between its
        last heartbeat and a fault; a plan from older holdings would send some ranks to disk while others read
        memory, so a new generation's STARTs wait at most that long for one fresh report from each node. ``clock``
        is read only when the answer depends on it."""
        if table is None or not self._memory_known or self._fresh_slots >= len(table.slots):
            return True
        return clock() - self._formed_at >= 2 * interval_s

    def live_replica_addresses(self) -> dict[str, str]:
        """Replica server addresses of the live nodes that serve one."""
        return {nid: a for nid, a in self._replica_addr.items() if a and self._alive(nid)}

    def replica_targets(self, table: GenerationTable | None, mver: int, replicas: int,
                        node_id: str) -> tuple[Target, ...]:
        """The node's replica targets (its buddies in the current table, see
        :func:`~.memory_plan.buddies`), cached per table and liveness (``mver``); () when it has none."""
        if table is None or replicas <= 0 or table.slot_of(node_id) is None:
            return ()
        cached = self._buddy_cache
        if cached is None or cached[0][0] is not table or cached[0][1] != mver:
            addr = self.live_replica_addresses()
            # A node holding no replicas still serves its own copies (restore plans), but is never a buddy: a
            # copy pushed to it would only be refused.
            takers = {n: a for n, a in addr.items() if n not in self._holds_none}
            chosen = buddies(table.slots, replicas, takers) if takers else {}
            cached = ((table, mver), {n: tuple((b, addr[b]) for b in bs) for n, bs in chosen.items()})
            self._buddy_cache = cached
        return cached[1].get(node_id, ())

    def restore_plan(self, table: GenerationTable | None, mver: int, committed: int = -1) -> RestorePlan | None:
        """Where each rank of the current table reads its checkpoint (see :mod:`.memory_plan`), from the live
        nodes' latest memory holdings; None while no node reported any, a plan of step -1 (every rank from
        storage) when none is new enough. Cached per table, holdings, liveness and ``committed``, so a
        generation's STARTs cost one plan.

        Holdings older than ``committed`` (the step every node committed to storage) are left out: a node back
        after a replacement still held its first life's step 19 in memory while step 89 was on disk, and the
        plan (and the log) said "step 19" though every rank restored 89 from disk, after a futile peer fetch.
        """
        if table is None:
            return None
        key = (table, mver, committed)
        cached = self._plan_cache
        if cached is not None and cached[0][0] is table and cached[0][1:] == key[1:]:
            return cached[1]
        held = {nid: h for nid, h in self._memory.items() if h and self._alive(nid)}
        live = {nid: kept for nid, h in held.items() if (kept := [x for x in h if x.step >= committed])}
        plan = plan_restore(table.slots, table.world_size, live, self.live_replica_addresses()) if held else None
        said = (table.generation, plan.step, tuple(sorted(plan.source_counts().items()))) if plan else None
        if said is not None and said != self._plan_said:
            # Once per generation and plan: re-planned on each membership change, the same plan was logged again.
            self._plan_said = said
            if plan.step < 0:  # read as "step -1 from storage" in every job's first generation
                log.info("job %s: generation %d restore plan: no step held in memory by every rank; each restores "
                         "from storage (its newest committed step, if any)", self._job, table.generation)
            else:
                log.info("job %s: generation %d restore plan: step %d, %s", self._job, table.generation,
                         plan.step, ", ".join(f"{n} rank(s) from {k.replace('_', ' ')}"
                                              for k, n in plan.source_counts().items()))
        self._plan_cache = (key, plan)
        return plan
