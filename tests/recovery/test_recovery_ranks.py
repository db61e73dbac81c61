"""Rank assignment: topology order, numeric-aware hosts, slot stability, group-size refusal, and the property
that arrival order never changes the layout."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from trainguard.recovery.errors import GroupSizeError, MembershipError, VacancyError
from trainguard.recovery.ranks import NodeSpec, assign_ranks, layout_from_mapping, layout_to_rows, natural_key


def _node(nid: str, pod: str = "p0", idx: int = 0, host: str = "", dev: int = 2, replaces: str = "") -> NodeSpec:
    return NodeSpec(node_id=nid, pod_id=pod, node_index=idx, host=host or nid, device_count=dev,
                    address=f"10.0.0.{abs(hash(nid)) % 250 + 1}", replaces=replaces)


def test_natural_key_orders_numbers_by_value() -> None:
    hosts = ["node-10", "node-2", "node-1", "node-2b", "node-100", "a", "node-9", "pod-3-n-10", "pod-3-n-9"]
    assert sorted(hosts, key=natural_key) == ["a", "node-1", "node-2", "node-2b", "node-9", "node-10", "node-100",
                                              "pod-3-n-9", "pod-3-n-10"]


def test_first_layout_orders_by_pod_index_host_not_arrival() -> None:
    members = [_node("n-c", "pod-10", 0), _node("n-a", "pod-2", 1), _node("n-b", "pod-2", 0),
               _node("n-d", "pod-9", 0, dev=4)]
    layout = assign_ranks(members)
    assert layout.node_ids == ("n-b", "n-a", "n-d", "n-c")
    assert [s.first_rank for s in layout.slots] == [0, 2, 4, 8]
    assert [s.group_rank for s in layout.slots] == [0, 1, 2, 3]
    assert layout.world_size == 10
    assert layout.master_addr == members[2].address
    assert layout.node_of_rank(5).node_id == "n-d"
    assert layout.node_of_rank(10) is None


def test_host_breaks_ties_numeric_aware() -> None:
    members = [_node("x", host="node-10"), _node("y", host="node-2")]
    assert assign_ranks(members).node_ids == ("y", "x")


def test_returning_node_keeps_slot_and_replacement_takes_the_replaced_slot() -> None:
    first = assign_ranks([_node(f"n{i}", idx=i) for i in range(4)])
    # n1 fails; spare s9 (which would sort first by index) replaces it; n0 (rank 0) stays.
    second = assign_ranks([_node("n0", idx=0), _node("s9", idx=0, pod="p0", host="aaa", replaces="n1"),
                           _node("n2", idx=2), _node("n3", idx=3)], previous=first)
    assert second.node_ids == ("n0", "s9", "n2", "n3")
    assert second.master_addr == first.master_addr
    # n1 comes back later and s9 leaves: the vacant slot goes to the newcomer.
    third = assign_ranks([_node(f"n{i}", idx=i) for i in range(4)], previous=second)
    assert third.node_ids == ("n0", "n1", "n2", "n3")


def test_rank0_changes_only_when_rank0_is_replaced() -> None:
    first = assign_ranks([_node(f"n{i}", idx=i) for i in range(3)])
    second = assign_ranks([_node("z", pod="p9", replaces="n0"), _node("n1", idx=1), _node("n2", idx=2)],
                          previous=first)
    assert second.node_ids[0] == "z" and second.master_addr != first.master_addr


def test_vacant_slot_is_refused_unless_shrink_allowed() -> None:
    first = assign_ranks([_node(f"n{i}", idx=i) for i in range(3)])
    with pytest.raises(MembershipError, match=r"slot 1 \(was 'n1', pod 'p0'\) needs a node of 2 device"):
        assign_ranks([_node("n0"), _node("n2", idx=2)], previous=first)
    shrunk = assign_ranks([_node("n0"), _node("n2", idx=2)], previous=first, allow_shrink=True)
    many = assign_ranks([_node(f"m{i}", idx=i) for i in range(20)])
    with pytest.raises(MembershipError,
                       match=r"^no spare node for 19 rank slot\(s\): .* and 14 more; "
                             r"register a spare node in pod 'p0'"):
        assign_ranks([_node("m0")], previous=many)
    assert shrunk.node_ids == ("n0", "n2") and shrunk.slots[1].first_rank == 2


def test_vacant_slot_prefers_newcomer_from_same_pod() -> None:
    first = assign_ranks([_node("a0", "pa", 0), _node("a1", "pa", 1), _node("b0", "pb", 0), _node("b1", "pb", 1)])
    second = assign_ranks([_node("a0", "pa", 0), _node("a1", "pa", 1), _node("b0", "pb", 0),
                           _node("x", "pa", 7), _node("y", "pb", 7)], previous=first)
    # y (same pod) fills b1's slot; x is left over and appended: the job grows.
    assert second.node_ids == ("a0", "a1", "b0", "y", "x")
    assert second.slots[3].pod_id == "pb"
    kept = assign_ranks([_node("a0", "pa", 0), _node("a1", "pa", 1), _node("b0", "pb", 0),
                         _node("x", "pa", 7), _node("y", "pb", 7)], previous=first, grow=False)
    assert kept.node_ids == ("a0", "a1", "b0", "y")


def test_replacement_with_other_device_count_is_refused() -> None:
    first = assign_ranks([_node("n0"), _node("n1", idx=1)])
    with pytest.raises(MembershipError, match="offers 4 devices but slot 1"):
        assign_ranks([_node("n0"), _node("s", dev=4, replaces="n1")], previous=first)


def test_bad_memberships_are_refused() -> None:
    with pytest.raises(MembershipError, match="empty"):
        assign_ranks([])
    with pytest.raises(MembershipError, match="appears twice"):
        assign_ranks([_node("a"), _node("a")])
    with pytest.raises(MembershipError, match="both replace"):
        assign_ranks([_node("a", replaces="z"), _node("b", replaces="z")])
    with pytest.raises(MembershipError, match="device_count=0"):
        assign_ranks([_node("a", dev=0)])


def test_group_size_refusal_names_pod_and_shortfall() -> None:
    # group of 8 ranks = 2 nodes of 4 devices; pod-2 has 3 nodes -> short of 1 node.
    members = [_node(f"a{i}", "pod-1", i, dev=4) for i in range(2)] + [_node(f"b{i}", "pod-2", i, dev=4)
                                                                       for i in range(3)]
    with pytest.raises(GroupSizeError, match=r"pod 'pod-2' is short of 1 node"):
        assign_ranks(members, group_size=8)
    ok = assign_ranks(members + [_node("b3", "pod-2", 3, dev=4)], group_size=8)
    assert ok.world_size == 24 and ok.group_size == 8


def test_group_size_replacement_from_other_pod_is_refused() -> None:
    members = [_node(f"a{i}", "pod-1", i, dev=4) for i in range(2)] + [_node(f"b{i}", "pod-2", i, dev=4)
                                                                       for i in range(2)]
    first = assign_ranks(members, group_size=8)
    with pytest.raises(GroupSizeError):
        assign_ranks([_node("a0", "pod-1", 0, dev=4), _node("x", "pod-2", 9, dev=4, replaces="a1"),
                      _node("b0", "pod-2", 0, dev=4), _node("b1", "pod-2", 1, dev=4)], previous=first, group_size=8)
    # A newcomer of the other pod is not picked for the vacancy (it would split ranks 0..7 across pods); the
    # refusal names the pod the slot needs, not the pod of the unusable node.
    with pytest.raises(VacancyError, match=r"needs a node of 4 device\(s\) in pod 'pod-1' .*ranks 0\.\.7.*"
                                           r"cannot take them: 'x' \(pod 'pod-2'.*"
                                           r"register a spare node in pod 'pod-1'"):
        assign_ranks([_node("a0", "pod-1", 0, dev=4), _node("x", "pod-2", 9, dev=4), _node("b0", "pod-2", 0, dev=4),
                      _node("b1", "pod-2", 1, dev=4)], previous=first, group_size=8)
    # A whole vacant group may move to another pod: the constraint still holds.
    moved = assign_ranks([_node("x", "pod-3", 0, dev=4), _node("y", "pod-3", 1, dev=4), _node("b0", "pod-2", 0, dev=4),
                          _node("b1", "pod-2", 1, dev=4)], previous=first, group_size=8)
    assert moved.node_ids == ("x", "y", "b0", "b1")


def test_rows_roundtrip() -> None:
    layout = assign_ranks([_node(f"n{i}", idx=i, dev=i + 1) for i in range(5)])
    rows = layout_to_rows(layout)
    assert layout_from_mapping(rows).slots == layout.slots
    rows[2]["first_rank"] = 99
    with pytest.raises(MembershipError, match="corrupt"):
        layout_from_mapping(rows)


_specs = st.lists(
    st.tuples(st.sampled_from(["pod-1", "pod-2", "pod-10", "p"]), st.integers(0, 20),
              st.sampled_from(["h1", "h2", "h10", "host-03", ""]), st.integers(1, 4)),
    min_size=1, max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(_specs, st.randoms(use_true_random=False))
def test_arrival_order_never_matters(specs: list[tuple[str, int, str, int]], rnd: random.Random) -> None:
    members = [NodeSpec(f"n{i}", p, idx, h, d, f"a{i}") for i, (p, idx, h, d) in enumerate(specs)]
    shuffled = list(members)
    rnd.shuffle(shuffled)
    a, b = assign_ranks(members), assign_ranks(shuffled)
    assert a == b
    assert [s.group_rank for s in a.slots] == list(range(len(members)))
    keys = [next(m for m in members if m.node_id == nid).order_key() for nid in a.node_ids]
    assert keys == sorted(keys)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 25), st.data())
def test_stability_properties(n: int, data: st.DataObject) -> None:
    members = [NodeSpec(f"n{i}", f"pod-{i % 3}", i, f"h{i}", 2, f"a{i}") for i in range(n)]
    first = assign_ranks(members)
    failed = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    survivors = [m for i, m in enumerate(members) if i not in failed]
    spares = [NodeSpec(f"s{i}", f"pod-{i % 5}", 100 + i, f"s{i}", 2, f"sa{i}", replaces=f"n{i}") for i in failed]
    order = survivors + spares
    data.draw(st.randoms(use_true_random=False)).shuffle(order)
    second = assign_ranks(order, previous=first)
    for old, new in zip(first.slots, second.slots):
        assert new.first_rank == old.first_rank
        expected = old.node_id if int(old.node_id[1:]) not in failed else f"s{old.node_id[1:]}"
        assert new.node_id == expected
    assert (second.master_addr == first.master_addr) == (0 not in failed)
