"""A registered node as the coordinator tracks it, and the rules for who may register.

:class:`Member` is the coordinator's record of one node. :func:`superseded_instances` and
:func:`check_slot_claim` are the admission rules of :meth:`~trainguard.recovery.coordinator.JobCoordinator.register`:
one live agent per node id, and one live claim per slot that a replacement node takes over. Pure functions; the
coordinator calls them with its lock held, on its own members.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from trainguard.recovery.domain import NodeRecord
from trainguard.recovery.errors import DuplicateNodeError, SlotTakenError
from trainguard.recovery.ranks import NodeSpec, RankLayout


@dataclass
class Member:
    """A registered node as the coordinator tracks it."""

    info: NodeRecord
    lease_id: str
    instance: str
    last_seen: float
    alive: bool = True
    free_port: int = 0
    generation: int = -1
    workers_running: int = 0
    last_step: int = -1
    succeeded_generation: int = -1
    superseded: set[str] = field(default_factory=set)
    refused: str = ""  # why it failed qualification ("" when it did not): it stays cordoned for the job
    echo_port: int = 0  # where it answers qualifying nodes' timed exchanges (0: it does not)
    # Until when (coordinator clock) the service holds this node's last heartbeat for a store write (START and the
    # job's outcome are told once durable): a node waiting for its answer is not silent. Ended early, on the
    # committer's thread, when the write does.
    held_until: float = float("-inf")

    def spec(self, replaces: str = "") -> NodeSpec:
        """The node as rank assignment sees it."""
        return self.info.spec(replaces)


def superseded_instances(prev: Member | None, info: NodeRecord, instance: str, prev_live: bool, now: float,
                         lease_s: Callable[[], float]) -> set[str] | None:
    """The agent instances a registration supersedes; None when it is the live agent registering again.

    Args:
        prev: the member registered under the node id so far (None: a new node).
        info: the registering node.
        instance: the registering agent's instance id ("" when unknown).
        prev_live: whether ``prev``'s lease is live.
        now: the coordinator's monotonic clock, seconds.
        lease_s: the lease length now (for the message).

    Raises:
        DuplicateNodeError: the agent was superseded already, or another live agent on another host holds the id.
    """
    if prev is None:
        return set()
    nid = info.node_id
    superseded = set(prev.superseded)
    if instance and instance in prev.superseded:
        raise DuplicateNodeError(
            f"node id {nid!r} was taken over by a newer agent at {prev.info.address or '?'}: this "
            "agent is a duplicate; give each node a unique --node-id")
    if prev_live:
        if instance and instance == prev.instance:
            return None
        same_host = prev.info.address == info.address and prev.info.host == info.host
        if not same_host:
            raise DuplicateNodeError(
                f"node id {nid!r} is held by a live agent at {prev.info.address or '?'} (last heartbeat "
                f"{now - prev.last_seen:.1f} s ago): give each node a unique --node-id, or wait "
                f"{lease_s():.0f} s for that lease to expire")
    if prev.instance:
        superseded.add(prev.instance)
    return superseded


def check_slot_claim(info: NodeRecord, holder: Member | None, members: Iterable[Member], layout: RankLayout | None,
                     cordoned: Collection[str], live: Callable[[Member], bool]) -> None:
    """Checks that ``info.replaces`` (when set) names a slot this node may take over.

    Args:
        info: the registering node.
        holder: the member ``info.replaces`` names (None: not registered).
        members: every member.
        layout: the current layout.
        cordoned: the job's cordon list.
        live: whether a member's lease is live.

    Raises:
        SlotTakenError: the slot's holder is alive, holds it and is not cordoned; or another live node claims it.
    """
    if not info.replaces:
        return
    nid = info.node_id
    if holder is not None and live(holder) and layout is not None \
            and layout.slot_of(info.replaces) is not None and info.replaces not in cordoned:
        raise SlotTakenError(
            f"node {nid!r} claims the slot of {info.replaces!r}, which is alive and holds it: only a "
            "failed or cordoned node's slot can be taken over")
    for other in members:
        if other.info.node_id != nid and other.info.replaces == info.replaces and live(other):
            raise SlotTakenError(f"node {other.info.node_id!r} already claims the slot of "
                                 f"{info.replaces!r}: one replacement per slot")
