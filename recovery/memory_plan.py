"""Job-wide in-memory checkpoints: which steps every rank holds in memory somewhere, and a restore plan per rank.

Each node agent reports, in its heartbeat, the steps whose snapshots lie in its shared-memory arena and for which
saved ranks (:class:`MemoryHolding`; the agent verified each copy against its chunk checksums). From the latest
report of every live node the coordinator knows, per step, whether every rank's copy is in memory somewhere.
When it sends a new generation it attaches a :class:`RestorePlan`: the newest step every rank of the new table
can read from memory, and per rank where to read it:

==============  ====================================================================================
LOCAL_MEMORY    the rank's node holds the rank's copy of the plan's step (a process restart in place)
PEER_MEMORY     another node holds it (``peer_node``; a replacement node fetches it before its workers start)
STORAGE         nobody holds it in memory: the rank reads its own tiers (local disk, then remote)
==============  ====================================================================================

``memory_steps`` lists every step whose each rank's copy lies on the node that holds that rank in the new
table: a worker may restore those steps from its own node's memory even though the other ranks' copies are on
other hosts (the memory tier alone counts a step complete only when every copy is on one host). Ranks still
agree on one step among themselves, as they always did: a copy can fail its checksums, or be replaced by a newer
snapshot after the node's last report; the plan then costs a fallback, never a wrong restore.

Pure: plain types in, plain types out; no clock, no I/O (the coordinator and the tests call it directly).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainguard.recovery.ranks import NodeSlot


@dataclass(frozen=True)
class MemoryHolding:
    """Copies of one step a node holds in memory.

    Attributes:
        step: the checkpoint step.
        world_size: ranks of the job that saved it.
        ranks: saved ranks whose copy of ``step`` lies in the node's arena.
        replica_ranks: saved ranks of other nodes whose replica of ``step`` the node holds (peer replication).
    """

    step: int
    world_size: int
    ranks: tuple[int, ...]
    replica_ranks: tuple[int, ...] = ()


class RestoreSource(enum.IntEnum):
    """Where a rank reads its checkpoint (values equal the proto ``RestoreSource``)."""

    LOCAL_MEMORY = 1
    PEER_MEMORY = 2
    STORAGE = 3


@dataclass(frozen=True)
class RankRestore:
    """One rank's source in a restore plan.

    Attributes:
        rank: the rank in the new table.
        source: where it reads.
        peer_node: the node holding its copy (PEER_MEMORY only).
        peer_address: that node's replica server, host:port (PEER_MEMORY only).
        alternates: (node, replica server) of the other nodes holding the same copy, to try in order when
            ``peer_node`` fails (PEER_MEMORY only; ``--memory-replicas 2`` and more).
    """

    rank: int
    source: RestoreSource
    peer_node: str = ""
    peer_address: str = ""
    alternates: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RestorePlan:
    """Where every rank of a new generation reads its checkpoint (see the module docstring).

    Attributes:
        step: the newest step every rank can read from memory (its own node's or a peer's); -1 when none.
        memory_steps: steps whose each rank's copy lies on the node holding that rank, newest first, and ``step``
            (a rank sent to a peer's memory holds ``step`` locally once its node fetched it).
        ranks: one entry per rank of the table, in rank order.
    """

    step: int
    memory_steps: tuple[int, ...]
    ranks: tuple[RankRestore, ...]

    def source_counts(self) -> dict[str, int]:
        """Ranks per source name (for the log)."""
        out: dict[str, int] = {}
        for r in self.ranks:
            out[r.source.name.lower()] = out.get(r.source.name.lower(), 0) + 1
        return out


#: The holders of each step's copies: ``{step: {saved rank: node ids holding it}}``, for one world size.
StepHolders = dict[int, dict[int, tuple[str, ...]]]


def holders(reports: Mapping[str, Sequence[MemoryHolding]], world_size: int, replicas: bool = True) -> StepHolders:
    """Who holds which copy, counting only steps saved with ``world_size`` ranks.

    Args:
        reports: node id -> its latest holdings (live nodes only).
        world_size: the job's world size (a copy saved at another size is not restored from memory).
        replicas: count peer replicas too (else only each node's own arena).

    Returns:
        ``{step: {rank: node ids}}``; node ids sorted, so the result does not depend on report order.
    """
    acc: dict[int, dict[int, set[str]]] = {}
    for node, held in reports.items():
        for h in held:
            if h.world_size != world_size:
                continue
            per_rank = acc.setdefault(h.step, {})
            for r in h.ranks + (h.replica_ranks if replicas else ()):
                if 0 <= r < world_size:
                    per_rank.setdefault(r, set()).add(node)
    return {s: {r: tuple(sorted(ns)) for r, ns in per.items()} for s, per in acc.items()}


def complete_steps(reports: Mapping[str, Sequence[MemoryHolding]], world_size: int) -> list[int]:
    """Steps whose every rank's copy is in memory on some node, newest first."""
    return sorted((s for s, per in holders(reports, world_size).items() if len(per) == world_size), reverse=True)


def _rank_owner(slots: Sequence[NodeSlot]) -> dict[int, str]:
    return {s.first_rank + i: s.node_id for s in slots for i in range(s.local_world_size)}


def plan_restore(slots: Sequence[NodeSlot], world_size: int, reports: Mapping[str, Sequence[MemoryHolding]],
                 addresses: Mapping[str, str] | None = None) -> RestorePlan:
    """The restore plan of a new generation.

    Args:
        slots: the new table's node slots (which node holds which ranks).
        world_size: ranks in the new table.
        reports: node id -> latest memory holdings of every live node.
        addresses: node id -> its replica server (host:port); a peer without one cannot serve a copy.

    Returns:
        The plan: the newest step every rank can read from memory (own node first, then a peer holding it: one
        of the new table before one outside it, then by name; the other holders follow as alternates), and the
        steps each rank can read from its own
        node's memory. Ranks without a memory copy of
        the plan's step read STORAGE.
    """
    owner = _rank_owner(slots)
    in_table = {s.node_id for s in slots}
    addresses = addresses or {}
    own = holders(reports, world_size, replicas=False)
    anywhere = holders(reports, world_size)
    local_steps = {s for s, per in own.items() if all(owner.get(r) in per.get(r, ()) for r in range(world_size))}

    def servable(step: int, r: int) -> tuple[str, ...]:
        return tuple(n for n in anywhere.get(step, {}).get(r, ()) if n == owner.get(r) or addresses.get(n))

    full = [s for s in anywhere if all(servable(s, r) for r in range(world_size))]
    step = max(full, default=-1)
    ranks = []
    for r in range(world_size):
        me = owner.get(r, "")
        mine = own.get(step, {}).get(r, ())
        # Nodes of the new table first (healthy by the coordinator's account), then the rest by name: a node
        # replaced for a hardware fault may still serve its memory, but its buddy's replica is the safer source.
        peers = sorted((n for n in servable(step, r) if n != me), key=lambda n: (n not in in_table, n))
        if step >= 0 and me in mine:
            ranks.append(RankRestore(r, RestoreSource.LOCAL_MEMORY))
        elif step >= 0 and peers:
            ranks.append(RankRestore(r, RestoreSource.PEER_MEMORY, peers[0], addresses.get(peers[0], ""),
                                     tuple((n, addresses.get(n, "")) for n in peers[1:])))
        else:
            ranks.append(RankRestore(r, RestoreSource.STORAGE))
    if step >= 0:
        local_steps.add(step)
    return RestorePlan(step, tuple(sorted(local_steps, reverse=True)), tuple(ranks))


def buddies(slots: Sequence[NodeSlot], count: int, addresses: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """The nodes each node of a table replicates its ranks' snapshots to.

    Deterministic: walking the table's nodes in group-rank order (a ring) from one pod's length ahead, each node
    takes the first ``count`` nodes that serve replicas, those of another pod (failure domain) first and, only
    when there are too few of those, nodes of its own pod. With pods of equal size every node holds ``count``
    replicas.

    Args:
        slots: the table's node slots.
        count: replicas per node (0: none).
        addresses: node id -> replica server; nodes without one are never chosen.

    Returns:
        node id -> buddy node ids, nearest first.
    """
    order = sorted(slots, key=lambda s: s.group_rank)
    out: dict[str, tuple[str, ...]] = {}
    n = len(order)
    serving = [s for s in order if addresses.get(s.node_id)]
    per_pod: dict[str, int] = {}
    for s in serving:
        per_pod[s.pod_id] = per_pod.get(s.pod_id, 0) + 1
    pod_size: dict[str, int] = {}
    for s in order:
        pod_size[s.pod_id] = pod_size.get(s.pod_id, 0) + 1
    for i, me in enumerate(order):
        mine_serving = per_pod.get(me.pod_id, 0) - (1 if addresses.get(me.node_id) else 0)
        want_other = min(max(0, count), len(serving) - per_pod.get(me.pod_id, 0))
        want_same = min(max(0, count) - want_other, mine_serving)
        other: list[str] = []
        same: list[str] = []
        # Start one pod's length ahead: pods are contiguous in rank order, so with pods of equal size each node
        # lands on the node at its own offset in the next pod and every node holds one replica (starting at the
        # next node would pile a whole pod's replicas onto the next pod's first node). Walk only as far as needed.
        start = pod_size[me.pod_id] if pod_size[me.pod_id] < n else 1
        for k in itertools.chain(range(start, n), range(1, start)):
            if len(other) >= want_other and len(same) >= want_same:
                break
            s = order[(i + k) % n]
            if not addresses.get(s.node_id):
                continue
            if s.pod_id != me.pod_id:
                if len(other) < want_other:
                    other.append(s.node_id)
            elif len(same) < want_same:
                same.append(s.node_id)
        out[me.node_id] = tuple(other + same)
    return out
