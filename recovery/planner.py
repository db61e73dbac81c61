"""Where a pending recovery's ranks go: a pure function of the previous layout and the membership *now*.

A vacancy (a slot whose node failed) is a standing goal, not a choice frozen when the fault was reported: the
coordinator calls :func:`place` again on every membership change (a spare registers, a spare or node dies, a
lease expires, a backoff ends) and forms the next generation with the first placement that is valid. The rules
are those of :func:`~trainguard.recovery.ranks.fill_slots`: a slot keeps its node, else goes to the node that
declared it ``replaces`` it, else to a free node of the slot's pod, else to a free node of another pod when
every parallel group (``--group-size``) stays inside one pod. When no valid placement exists the result says
what is missing (which slot, which pod, how many devices) in one line, and the job waits.

Nothing here touches the coordinator, the store or protobuf: plain :class:`~trainguard.recovery.ranks.NodeSpec`
in, a :class:`Placement` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainguard.recovery.errors import MembershipError
from trainguard.recovery.ranks import NodeSpec, RankLayout, assign_ranks, describe_vacancies, fill_slots


@dataclass(frozen=True)
class Placement:
    """One placement attempt.

    Attributes:
        layout: the next generation's layout, None when no valid one exists now.
        replacements: failed node id -> node taking its slot (also when the layout is not valid yet: the
            slots that could be filled).
        shrunk: the layout drops slots nobody can fill (only when shrinking is allowed).
        waiting: why there is no layout, naming the slot, pod and devices missing ("" when there is one).
    """

    layout: RankLayout | None
    replacements: dict[str, str] = field(default_factory=dict)
    shrunk: bool = False
    waiting: str = ""


def place(previous: RankLayout, holders: Sequence[NodeSpec], free: Sequence[NodeSpec], *,
          allow_shrink: bool = False, min_nodes: int = 1) -> Placement:
    """Lays out the next generation of a node- or job-level recovery from the membership now.

    Args:
        previous: the current generation's layout.
        holders: slot holders that keep their slot (alive, not cordoned).
        free: alive, uncordoned nodes holding no slot (spares, standbys, returning nodes), in any order.
        allow_shrink: drop slots nobody can fill when no spare can, down to ``min_nodes``.
        min_nodes: fewest nodes a shrunk layout may have (>= 1).

    Returns:
        The placement; ``layout`` is None (and ``waiting`` says why) when none is valid.
    """
    members = sorted([*holders, *free], key=NodeSpec.order_key)
    try:
        filled, unplaced = fill_slots(previous, members)
    except MembershipError as exc:
        return Placement(None, waiting=str(exc))
    replacements = {old.node_id: m.node_id for old, m in zip(previous.slots, filled)
                    if m is not None and m.node_id != old.node_id}
    try:
        return Placement(assign_ranks(members, previous=previous, group_size=previous.group_size, grow=False),
                         replacements)
    except MembershipError as exc:
        waiting = describe_vacancies(previous, filled, unplaced, allow_shrink) if None in filled else str(exc)
        if not allow_shrink or None not in filled:
            return Placement(None, replacements, waiting=waiting)
    try:
        shrunk = assign_ranks(members, previous=previous, group_size=previous.group_size, grow=False,
                              allow_shrink=True)
    except MembershipError as exc:
        return Placement(None, replacements, waiting=f"{waiting}; shrinking is not valid ({exc})")
    if len(shrunk.slots) < min_nodes:
        return Placement(None, replacements, waiting=f"{waiting}; shrinking would leave {len(shrunk.slots)} "
                                                     f"nodes, below the minimum {min_nodes}")
    return Placement(shrunk, replacements, shrunk=True)
