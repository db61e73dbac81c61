"""The node's part in the job-wide memory tier, as the node agent composes it (one object, a few hooks).

:class:`JobMemory` puts together the node's verified holdings (:class:`~trainguard.agent.memory_tier.MemoryTier`)
and its peer replication (:class:`~trainguard.agent.replica_agent.ReplicaAgent`), and gives
:class:`~trainguard.agent.node.NodeAgent` what it needs at each point of its loop:

* :meth:`heartbeat_fields` — the holdings, replica address and replica memory every heartbeat carries (a
  :class:`~trainguard.agent.parts.HeartbeatContent`, merged with the supervisor's by :class:`HeartbeatParts`);
* :meth:`follow` — every heartbeat answer: the buddies, and the restore plan of a START/RESTART;
* :meth:`before_spawn` — a new generation's worker specs before they start: the ranks the plan sends to a peer
  are fetched into this node's arena, then each worker gets its part of the plan in its environment;
* :meth:`fill_health` — the replica figures of ``trainguard status``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from trainguard.agent.memory_tier import MemoryTier, apply_restore_plan
from trainguard.agent.replica_agent import ReplicaAgent, ReplicaConfig
from trainguard.proto import agent_pb2, coordinator_pb2

log = logging.getLogger(__name__)


class JobMemory:
    """Holdings, replicas and the restore plan of one job on this node.

    Args:
        tier: the node's memory tier.
        replicas: its peer replication, or None when off.
    """

    def __init__(self, tier: MemoryTier, replicas: ReplicaAgent | None) -> None:
        self.tier, self.replicas = tier, replicas
        self.plan: coordinator_pb2.MemoryRestorePlan | None = None

    @classmethod
    def for_node(cls, checkpoint_dir: str | None, job: str, mode: str, replica: ReplicaConfig, node_id: str,
                 address: str) -> "JobMemory | None":
        """The node's job memory, or None when the job does not checkpoint or ``mode`` is ``"host"``."""
        if mode != "job":
            return None
        tier = MemoryTier.for_checkpoint_dir(checkpoint_dir, job)
        if tier is None:
            return None
        return cls(tier, ReplicaAgent(replica, tier, node_id, address) if replica.enabled else None)

    def start(self) -> None:
        """Starts scanning, serving and pushing."""
        self.tier.start()
        if self.replicas is not None:
            self.replicas.start()

    def stop(self) -> None:
        """Stops everything :meth:`start` started."""
        self.tier.stop()
        if self.replicas is not None:
            self.replicas.stop()

    def heartbeat_fields(self) -> Mapping[str, object]:
        """Holdings (scanned now, so a snapshot that landed just before a fault is in), replica server, replica
        memory, and whether the node holds others' replicas at all (``--replica-memory-mib 0``: its server
        still serves its own copies, but the coordinator never makes it a buddy) (implements
        :class:`~trainguard.agent.parts.HeartbeatContent`)."""
        if self.replicas is None:
            return {"memory": self.tier.scan(), "replica_address": "", "replica_bytes": 0}
        return {"memory": self.tier.scan(), "replica_address": self.replicas.address,
                "replica_bytes": self.replicas.store.bytes_held(),
                "replica_holds_none": self.replicas.store.max_bytes <= 0}

    def follow(self, resp: coordinator_pb2.NodeHeartbeatResponse, current_generation: int) -> None:
        """Takes the buddies of every answer, and the restore plan of a START/RESTART of a new generation."""
        if self.replicas is not None:
            self.replicas.set_targets(resp.replica_targets)
        if resp.command in (coordinator_pb2.NODE_COMMAND_START, coordinator_pb2.NODE_COMMAND_RESTART) \
                and resp.rank_table.generation != current_generation:
            self.plan = resp.restore_plan if resp.HasField("restore_plan") else None

    def before_spawn(self, specs: Sequence, generation: int, tick: Callable[[], None] | None = None) -> None:
        """Fetches the peer-memory ranks of this node into its arena, then hands each worker its part of the plan."""
        if self.replicas is not None:
            self.replicas.fetch_planned(self.plan, [s.rank for s in specs], tick=tick)
        apply_restore_plan(specs, self.plan, generation)

    def fill_health(self, h: agent_pb2.NodeHealth) -> None:
        """The replica memory held, its bound and the buddies, for ``trainguard status``."""
        if self.replicas is not None:
            h.replica_bytes, h.replica_limit_bytes = self.replicas.store.bytes_held(), self.replicas.store.max_bytes
            h.replica_buddies.extend(self.replicas.buddies)


class HeartbeatParts:
    """Several :class:`~trainguard.agent.parts.HeartbeatContent` as one (their fields merged).

    Args:
        parts: the contents (None entries are skipped).
    """

    def __init__(self, *parts: object) -> None:
        self.parts = [p for p in parts if p is not None]

    def heartbeat_fields(self) -> Mapping[str, object]:
        """Every part's fields."""
        out: dict[str, object] = {}
        for p in self.parts:
            out.update(p.heartbeat_fields())
        return out
