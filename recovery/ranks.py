"""Rank assignment: a pure, deterministic function from a job's membership to its rank layout.

The rules (DESIGN.md "Rank order"):

1. **First layout** (no previous generation): nodes are ordered by ``(pod id, node index, host, node id)``,
   pod ids and hosts compared *numeric-aware* (``node-2 < node-10``, ``pod-9 < pod-10``). Node ``k`` in that
   order gets ``group_rank = k``; its local ranks are ``first_rank .. first_rank + device_count - 1`` in device
   index order. Rank 0, hence MASTER_ADDR, is the first node of the first pod.
2. **Later layouts** (a previous generation exists): every slot (group rank) keeps its node if that node is
   still a member; otherwise a member that declares ``replaces=<old node id>`` takes it; otherwise the slot
   goes to an unplaced newcomer, one of the slot's own pod first, in the order of rule 1. Rank 0 and
   MASTER_ADDR therefore change only when the rank-0 node itself is replaced. A slot nobody fills is an error
   unless ``allow_shrink`` is set, in which case the vacant slots are dropped and the later nodes move up. Members
   left over after every slot is filled are appended in the order of rule 1 (the job grows) unless ``grow`` is
   off.
3. **Parallel groups** (``group_size`` ranks, e.g. TP x EP, that need the fast fabric) are the consecutive
   rank ranges ``[k*g, (k+1)*g)``. Each must lie inside one pod. On a first layout this means every pod's rank
   count is a multiple of ``g``; a membership that cannot satisfy it is refused with a
   :class:`~trainguard.recovery.errors.GroupSizeError` naming the pod and how many nodes it is short of.

Everything here is a pure function of its arguments: the order in which nodes arrived never matters (the
property tests in ``tests/recovery/test_recovery_ranks.py`` shuffle the input).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.recovery.errors import GroupSizeError, MembershipError, VacancyError

_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[object, ...]:
    """Sort key that orders embedded numbers by value: ``node-2`` before ``node-10``.

    ``re.split`` with a capturing group puts text at even positions and digit runs at odd positions, so two
    keys always compare str with str and int with int. The digit string itself breaks ties (``01`` vs ``1``).

    Args:
        text: a host name, pod id or any label.

    Returns:
        A tuple usable as a sort key.
    """
    parts = _DIGITS.split(text)
    return tuple((int(p), p) if i % 2 else p for i, p in enumerate(parts))


@dataclass(frozen=True)
class NodeSpec:
    """What rank assignment needs to know about one member node.

    Attributes:
        node_id: stable identity of the node.
        pod_id: pod / supernode sharing the fast fabric.
        node_index: position of the node inside its pod (>= 0).
        host: host name, ordered numeric-aware.
        device_count: local worker slots (>= 1); becomes LOCAL_WORLD_SIZE.
        address: address other nodes reach this node at; the rank-0 node's is MASTER_ADDR.
        replaces: node id whose slot this node takes over ("" when none).
    """

    node_id: str
    pod_id: str = ""
    node_index: int = 0
    host: str = ""
    device_count: int = 1
    address: str = ""
    replaces: str = ""

    def order_key(self) -> tuple[object, ...]:
        """The topology sort key of rule 1: (pod, node index, host, node id).

        Returns:
            A tuple usable as a sort key.
        """
        return (natural_key(self.pod_id), self.node_index, natural_key(self.host), natural_key(self.node_id))


@dataclass(frozen=True)
class NodeSlot:
    """One node's place in a rank layout.

    Attributes:
        node_id: the node holding the slot.
        group_rank: the node's rank among nodes (torchrun GROUP_RANK).
        first_rank: global rank of the node's local rank 0.
        local_world_size: ranks on the node.
        address: the node's address.
        pod_id: the node's pod.
    """

    node_id: str
    group_rank: int
    first_rank: int
    local_world_size: int
    address: str
    pod_id: str


@dataclass(frozen=True)
class RankLayout:
    """The rank layout of one generation: which node holds which ranks.

    Attributes:
        slots: one per node, ordered by ``group_rank`` (0, 1, 2, ...).
        group_size: parallel group size the layout was validated for (1: no constraint).
    """

    slots: tuple[NodeSlot, ...]
    group_size: int = 1
    _by_id: dict[str, NodeSlot] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {s.node_id: s for s in self.slots})

    @property
    def world_size(self) -> int:
        """Total ranks of the layout."""
        return sum(s.local_world_size for s in self.slots)

    @property
    def master_addr(self) -> str:
        """Address of the node holding rank 0 ("" for an empty layout)."""
        return self.slots[0].address if self.slots else ""

    @property
    def node_ids(self) -> tuple[str, ...]:
        """Node ids in group-rank order."""
        return tuple(s.node_id for s in self.slots)

    def slot_of(self, node_id: str) -> NodeSlot | None:
        """The slot a node holds.

        Args:
            node_id: a node id.

        Returns:
            The node's slot, or None when it has none.
        """
        return self._by_id.get(node_id)

    def node_of_rank(self, rank: int) -> NodeSlot | None:
        """The slot holding a global rank.

        Args:
            rank: a global rank (0-based).

        Returns:
            The slot whose rank range contains ``rank``, or None when out of range.
        """
        for s in self.slots:
            if s.first_rank <= rank < s.first_rank + s.local_world_size:
                return s
        return None


def _validate_members(members: Sequence[NodeSpec]) -> None:
    seen: set[str] = set()
    claimed: dict[str, str] = {}
    for m in members:
        if not m.node_id:
            raise MembershipError("a member has an empty node id: give every node a stable, non-empty id")
        if m.node_id in seen:
            raise MembershipError(f"node id {m.node_id!r} appears twice in the membership: node ids must be unique")
        seen.add(m.node_id)
        if m.device_count < 1:
            raise MembershipError(f"node {m.node_id!r} has device_count={m.device_count}: it must be >= 1")
        if m.node_index < 0:
            raise MembershipError(f"node {m.node_id!r} has node_index={m.node_index}: it must be >= 0")
        if m.replaces:
            if m.replaces in claimed:
                raise MembershipError(
                    f"nodes {claimed[m.replaces]!r} and {m.node_id!r} both replace {m.replaces!r}: "
                    "only one node may take a slot"
                )
            claimed[m.replaces] = m.node_id
    for old, new in claimed.items():
        if old in seen:
            raise MembershipError(
                f"node {new!r} replaces {old!r}, but {old!r} is still a member: remove it from the job first"
            )


def _nodes_short(ranks: int, device_count: int, group_size: int) -> int:
    """Smallest number of extra nodes of ``device_count`` ranks that makes ``ranks`` a multiple of the group."""
    for extra in range(1, group_size + 1):
        if (ranks + extra * device_count) % group_size == 0:
            return extra
    return group_size  # unreachable: ranks is a multiple of gcd(device_count, group_size) whenever pods are uniform


def _check_groups(slots: Sequence[NodeSlot], group_size: int) -> None:
    if group_size <= 1:
        return
    # Pods in slot order; per pod its rank count (for the "short of N nodes" message).
    pod_ranks: dict[str, int] = {}
    pod_devices: dict[str, int] = {}
    for s in slots:
        pod_ranks[s.pod_id] = pod_ranks.get(s.pod_id, 0) + s.local_world_size
        pod_devices.setdefault(s.pod_id, s.local_world_size)
    rank_pod: list[str] = []
    for s in slots:
        rank_pod.extend([s.pod_id] * s.local_world_size)
    for start in range(0, len(rank_pod), group_size):
        group = rank_pod[start:start + group_size]
        pods = sorted(set(group), key=natural_key)
        if len(group) == group_size and len(pods) == 1:
            continue
        # Blame the first pod whose rank count is not a multiple of the group size.
        for pod in sorted(pod_ranks, key=natural_key):
            if pod_ranks[pod] % group_size:
                short = _nodes_short(pod_ranks[pod], pod_devices[pod], group_size)
                raise GroupSizeError(
                    f"pod {pod!r} has {pod_ranks[pod]} ranks, not a multiple of group size {group_size}: "
                    f"pod {pod!r} is short of {short} node(s) of {pod_devices[pod]} devices "
                    f"(add them, remove nodes, or lower --group-size)"
                )
        raise GroupSizeError(
            f"ranks {start}..{start + len(group) - 1} form one parallel group of size {group_size} but span pods "
            f"{', '.join(repr(p) for p in pods)}: replace the failed node with a spare of the same pod, "
            "or restart the job to re-lay the ranks"
        )


def _build(order: Sequence[NodeSpec], group_size: int) -> RankLayout:
    slots: list[NodeSlot] = []
    first = 0
    for gr, m in enumerate(order):
        slots.append(NodeSlot(m.node_id, gr, first, m.device_count, m.address, m.pod_id))
        first += m.device_count
    _check_groups(slots, group_size)
    return RankLayout(tuple(slots), group_size)


def assign_ranks(
    members: Iterable[NodeSpec],
    *,
    previous: RankLayout | None = None,
    group_size: int = 1,
    allow_shrink: bool = False,
    grow: bool = True,
) -> RankLayout:
    """Lays out ranks for a membership (see the module docstring for the rules).

    Args:
        members: the nodes that get ranks this generation (spares excluded), in any order.
        previous: the layout of the previous generation, for slot stability; None for the first layout.
        group_size: ranks per parallel group that must stay inside one pod (1: no constraint).
        allow_shrink: drop slots nobody can fill instead of refusing the membership.
        grow: append members left over after every slot is filled; when False they get no slot (they stay
            spares).

    Returns:
        The new layout.

    Raises:
        MembershipError: empty or inconsistent membership (duplicate ids, two nodes replacing the same one,
            a replacement with a different device count).
        VacancyError: a vacant slot with ``allow_shrink`` unset; the message names each slot's pod and need.
        GroupSizeError: a parallel group would straddle pods; the message names the pod and how many nodes
            it is short of.
    """
    ordered = sorted(members, key=NodeSpec.order_key)
    if group_size < 1:
        raise MembershipError(f"group size {group_size} is invalid: it must be >= 1")
    if not ordered:
        raise MembershipError("the membership is empty: at least one non-spare node must register")
    _validate_members(ordered)
    if previous is None or not previous.slots:
        return _build(ordered, group_size)

    if previous.group_size != group_size:
        previous = RankLayout(previous.slots, group_size)
    filled, newcomers = fill_slots(previous, ordered)
    vacant = [old for old, m in zip(previous.slots, filled) if m is None]
    if vacant and not allow_shrink:
        raise VacancyError(describe_vacancies(previous, filled, newcomers))
    order = [m for m in filled if m is not None] + (newcomers if grow else [])
    return _build(order, group_size)



def _group_mates(previous: RankLayout, i: int) -> list[int]:
    """Indices of the other slots sharing a parallel group with slot ``i`` (none without a group constraint)."""
    g = previous.group_size
    if g <= 1:
        return []
    s = previous.slots[i]
    lo, hi = s.first_rank // g, (s.first_rank + s.local_world_size - 1) // g
    return [j for j, o in enumerate(previous.slots)
            if j != i and o.first_rank // g <= hi and (o.first_rank + o.local_world_size - 1) // g >= lo]


def _pod_fits(previous: RankLayout, filled: Sequence[NodeSpec | None], i: int, pod: str) -> bool:
    """Whether a node of ``pod`` in slot ``i`` keeps every parallel group of that slot inside one pod."""
    return all(filled[j] is None or filled[j].pod_id == pod  # type: ignore[union-attr]
               for j in _group_mates(previous, i))


def required_pod(previous: RankLayout, filled: Sequence[NodeSpec | None], i: int) -> str | None:
    """The pod a node filling slot ``i`` must belong to, or None when any pod keeps the groups valid.

    Args:
        previous: the previous layout (its slots keep their rank positions).
        filled: the node placed in each slot so far (None: vacant).
        i: the vacant slot's index.

    Returns:
        The pod of an already placed group mate, or None.
    """
    for j in _group_mates(previous, i):
        if filled[j] is not None:
            return filled[j].pod_id  # type: ignore[union-attr]
    return None


def fill_slots(previous: RankLayout, members: Sequence[NodeSpec]) -> tuple[list[NodeSpec | None], list[NodeSpec]]:
    """Places members into the previous layout's slots (rule 2 of the module docstring).

    A slot keeps its node, else goes to the member declaring ``replaces`` it, else to an unplaced newcomer of
    the same device count: one of the slot's own pod first, one of another pod only when every parallel group
    the slot belongs to stays inside one pod (its group mates already placed are all of that pod).

    Args:
        previous: the previous generation's layout.
        members: this generation's members, sorted by :meth:`NodeSpec.order_key`.

    Returns:
        (the node of each previous slot, None where vacant; the members left unplaced, in order).

    Raises:
        MembershipError: a node offers a different device count than the slot it keeps or replaces.
    """
    by_id = {m.node_id: m for m in members}
    by_replaced = {m.replaces: m for m in members if m.replaces}
    placed: set[str] = set()
    filled: list[NodeSpec | None] = []
    for old in previous.slots:
        m = by_id.get(old.node_id)
        if m is None:
            m = by_replaced.get(old.node_id)
        if m is not None:
            if m.device_count != old.local_world_size:
                raise MembershipError(
                    f"node {m.node_id!r} offers {m.device_count} devices but slot {old.group_rank} "
                    f"(was {old.node_id!r}) needs {old.local_world_size}: give it the same --nproc-per-node"
                )
            placed.add(m.node_id)
        filled.append(m)
    newcomers = [m for m in members if m.node_id not in placed]
    for i, old in enumerate(previous.slots):
        if filled[i] is not None:
            continue
        fit = [m for m in newcomers if m.device_count == old.local_world_size
               and _pod_fits(previous, filled, i, m.pod_id)]
        same_pod = [m for m in fit if m.pod_id == old.pod_id]
        pick = (same_pod or fit or [None])[0]
        if pick is not None:
            newcomers.remove(pick)
            filled[i] = pick
    return filled, newcomers


def describe_vacancies(previous: RankLayout, filled: Sequence[NodeSpec | None], unplaced: Sequence[NodeSpec],
                       shrink_allowed: bool = False) -> str:
    """One line naming every vacant slot, the pod and devices a node needs to fill it, and why free nodes do not;
    it suggests allowing shrinking unless ``shrink_allowed`` (the job may shrink already: "or allow shrinking"
    misled a user whose job had shrunk).

    Args:
        previous: the previous layout.
        filled: as returned by :func:`fill_slots`.
        unplaced: the free nodes left unplaced.

    Returns:
        The message (ends with what to do).
    """
    vacant = [i for i, m in enumerate(filled) if m is None]
    parts, pods = [], []
    for i in vacant[:5]:
        old = previous.slots[i]
        need = required_pod(previous, filled, i)
        if need is not None:
            g = previous.group_size
            lo = old.first_rank // g * g
            parts.append(f"slot {old.group_rank} (was {old.node_id!r}) needs a node of {old.local_world_size} "
                         f"device(s) in pod {need!r} (group size {g} keeps ranks {lo}..{lo + g - 1} in one pod)")
            pods.append(need)
        else:
            pod = f", pod {old.pod_id!r}" if old.pod_id else ""
            parts.append(f"slot {old.group_rank} (was {old.node_id!r}{pod}) needs a node of "
                         f"{old.local_world_size} device(s)")
            pods.append(old.pod_id)
    names = "; ".join(parts)
    if len(vacant) > 5:
        names += f"; and {len(vacant) - 5} more"
    wanted = sorted(set(pods), key=natural_key)
    spare = f"register a spare node in pod {' or '.join(repr(p) for p in wanted)}" if any(wanted) \
        else "add a spare node"
    unusable = ""
    if unplaced:
        shown = ", ".join(f"{m.node_id!r} (pod {m.pod_id!r}, {m.device_count} device(s))" for m in unplaced[:3])
        more = f" and {len(unplaced) - 3} more" if len(unplaced) > 3 else ""
        unusable = f"; free nodes that cannot take them: {shown}{more}"
    return (f"no spare node for {len(vacant)} rank slot(s): {names}{unusable}; {spare}"
            + ("" if shrink_allowed else ", or allow shrinking"))


def layout_from_mapping(rows: Sequence[Mapping[str, object]], group_size: int = 1) -> RankLayout:
    """Rebuilds a layout from its serialized rows (as written by :func:`layout_to_rows`).

    Args:
        rows: one mapping per slot with keys node_id, group_rank, first_rank, local_world_size, address, pod_id.
        group_size: the group size the layout was made for.

    Returns:
        The layout.

    Raises:
        MembershipError: the rows are not a contiguous, consistent layout.
    """
    slots = []
    first = 0
    for i, r in enumerate(rows):
        try:
            s = NodeSlot(str(r["node_id"]), int(r["group_rank"]), int(r["first_rank"]),  # type: ignore[arg-type]
                         int(r["local_world_size"]), str(r["address"]), str(r["pod_id"]))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise MembershipError(f"stored rank layout row {i} is malformed ({exc}): the store is corrupt") from exc
        if s.group_rank != i or s.first_rank != first or s.local_world_size < 1:
            raise MembershipError(f"stored rank layout row {i} is inconsistent: the store is corrupt")
        first += s.local_world_size
        slots.append(s)
    return RankLayout(tuple(slots), group_size)


def layout_to_rows(layout: RankLayout) -> list[dict[str, object]]:
    """Serializes a layout to JSON-friendly rows (the inverse of :func:`layout_from_mapping`).

    Args:
        layout: the layout.

    Returns:
        One dict per slot, in group-rank order.
    """
    return [
        {"node_id": s.node_id, "group_rank": s.group_rank, "first_rank": s.first_rank,
         "local_world_size": s.local_world_size, "address": s.address, "pod_id": s.pod_id}
        for s in layout.slots
    ]
