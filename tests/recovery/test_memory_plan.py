"""Job-wide memory tier at the coordinator (recovery/memory_plan.py and its use in recovery/coordinator.py): which
steps every rank holds in memory somewhere, the per-rank restore plan sent with a new generation, its wire form,
and the wait for fresh holdings that keeps every node's plan the same."""

from __future__ import annotations

from trainguard.proto import coordinator_pb2 as pb
from trainguard.recovery import convert
from trainguard.recovery.coordinator import JobCoordinator, JobSpec
from trainguard.recovery.domain import Beat, Command, FaultReport, NodeRecord
from trainguard.recovery.memory_plan import (MemoryHolding, RankRestore, RestoreSource, buddies,
                                             complete_steps, plan_restore)
from trainguard.recovery.policy import Cause, Level
from trainguard.recovery.ranks import NodeSlot
from trainguard.recovery.store import MemoryStore

SLOTS = (NodeSlot("a", 0, 0, 2, "10.0.0.1", "p0"), NodeSlot("b", 1, 2, 2, "10.0.0.2", "p1"))


def test_every_rank_in_its_own_nodes_memory_reads_local_memory() -> None:
    reports = {"a": [MemoryHolding(20, 4, (0, 1)), MemoryHolding(10, 4, (0, 1))],
               "b": [MemoryHolding(20, 4, (2, 3)), MemoryHolding(10, 4, (2,))]}
    assert complete_steps(reports, 4) == [20]
    plan = plan_restore(SLOTS, 4, reports)
    assert plan.step == 20 and plan.memory_steps == (20,)
    assert {r.source for r in plan.ranks} == {RestoreSource.LOCAL_MEMORY}
    assert plan.source_counts() == {"local_memory": 4}


def test_replacement_node_reads_a_peer_or_storage_and_other_world_sizes_do_not_count() -> None:
    slots = (SLOTS[0], NodeSlot("c", 1, 2, 2, "10.0.0.3", "p1"))  # c replaced b
    reports = {"a": [MemoryHolding(20, 4, (0, 1), replica_ranks=(2, 3)), MemoryHolding(30, 2, (0, 1))],
               "c": [MemoryHolding(10, 4, (2, 3))]}  # c's own arena holds an old copy only
    plan = plan_restore(slots, 4, reports, {"a": "10.0.0.1:7000"})
    assert plan.step == 20 and plan.memory_steps == (20,)  # 20: once c fetched ranks 2, 3 from a
    assert plan.ranks[2] == RankRestore(2, RestoreSource.PEER_MEMORY, "a", "10.0.0.1:7000")
    assert plan.ranks[0].source is RestoreSource.LOCAL_MEMORY
    # b was replaced for a hardware fault but still serves its memory: a's replica (a is in the table) goes first.
    both = plan_restore(slots, 4, {**reports, "b": [MemoryHolding(20, 4, (2, 3))]}, {"a": "a:1", "b": "b:1"})
    assert both.ranks[2].peer_node == "a"
    assert both.ranks[2].alternates == (("b", "b:1"),)  # the second holder, tried when a's copy fails
    assert convert.restore_plan(both).ranks[2].alternates[0].address == "b:1"  # and on the wire
    no_server = plan_restore(slots, 4, reports, {})  # a serves no replicas: its copies of 2, 3 are unreachable
    assert no_server.step == -1 and {r.source for r in no_server.ranks} == {RestoreSource.STORAGE}
    alone = plan_restore(slots, 4, {"a": [MemoryHolding(20, 4, (0, 1))]})
    assert alone.step == -1 and {r.source for r in alone.ranks} == {RestoreSource.STORAGE}


def test_buddies_are_deterministic_and_prefer_another_pod() -> None:
    slots = (NodeSlot("a", 0, 0, 1, "", "p0"), NodeSlot("b", 1, 1, 1, "", "p0"),
             NodeSlot("c", 2, 2, 1, "", "p1"), NodeSlot("d", 3, 3, 1, "", "p1"))
    addr = {n: f"{n}:1" for n in "abcd"}
    assert buddies(slots, 1, addr) == {"a": ("c",), "b": ("d",), "c": ("a",), "d": ("b",)}  # one replica each
    assert buddies(tuple(reversed(slots)), 1, addr) == buddies(slots, 1, addr)  # order of the table rows
    assert buddies(slots, 2, addr)["a"] == ("c", "d")
    assert buddies(slots, 3, addr)["a"] == ("c", "d", "b")  # its own pod only when the others run out
    del addr["c"]  # c is lost (or serves no replicas): a's buddy moves on
    assert buddies(slots, 1, addr)["a"] == ("d",)
    one_pod = (NodeSlot("x", 0, 0, 1, "", "p"), NodeSlot("y", 1, 1, 1, "", "p"))
    assert buddies(one_pod, 1, {"x": "x:1", "y": "y:1"}) == {"x": ("y",), "y": ("x",)}
    assert buddies(slots, 0, addr) == {n: () for n in "abcd"}


def test_plan_crosses_the_wire_and_is_part_of_the_cached_start() -> None:
    plan = plan_restore(SLOTS, 4, {"a": [MemoryHolding(5, 4, (0, 1))], "b": [MemoryHolding(5, 4, (2, 3))]})
    msg = convert.restore_plan(plan)
    assert (msg.step, list(msg.memory_steps)) == (5, [5])
    assert [r.source for r in msg.ranks] == [pb.RESTORE_SOURCE_LOCAL_MEMORY] * 4
    hb = pb.NodeHeartbeatRequest(job="j", node_id="a", lease_id="l", memory=[
        pb.MemoryHolding(step=5, world_size=4, ranks=[0, 1])])
    assert convert.beat(hb).memory == (MemoryHolding(5, 4, (0, 1)),)


def _running_two_node_job(now: list[float]):
    """A two-node job whose first generation every node has started."""
    core, leases = _two_node_job(now)
    for n in "ab":
        _beat(core, leases, n, -1, -1, ())
        _beat(core, leases, n, -1, -1, ())
    return core, leases


def _two_node_job(now: list[float]):
    core = JobCoordinator(JobSpec(job="j", nnodes=2, backoff_initial_s=0.0), store=MemoryStore(), clock=lambda: now[0],
                          wall=lambda: now[0])
    leases = {n: core.register("j", NodeRecord(n, "p", i, f"h{i}", 1), 40000 + i)[0] for i, n in enumerate("ab")}
    return core, leases


def _beat(core, leases, node: str, gen: int, step: int, held: tuple[int, ...], running: int = 1):
    memory = tuple(MemoryHolding(s, 2, (0 if node == "a" else 1,)) for s in held)
    _PORTS[0] += 1  # a port the node found free (a new generation's rank 0 needs one never used)
    return core.heartbeat(Beat("j", node, leases[node], generation=gen, workers_running=running, last_step=step,
                               free_port=_PORTS[0], memory=memory)).response


_PORTS = [41000]


def test_restart_waits_for_fresh_holdings_so_every_node_gets_the_same_plan() -> None:
    now = [100.0]
    core, leases = _two_node_job(now)
    for n in "ab":
        _beat(core, leases, n, -1, -1, ())
    for n in "ab":
        assert _beat(core, leases, n, -1, -1, ()).command is Command.START
    _beat(core, leases, "a", 1, 9, (5,))
    _beat(core, leases, "b", 1, 9, (5,))
    # Step 10 lands on both nodes; a reports it, then its worker dies before b's next heartbeat.
    _beat(core, leases, "a", 1, 10, (10,))
    core.report(FaultReport("j", "a", leases["a"], 1, Cause.WORKER_EXIT, Level.PROCESS, rank=0))
    first = _beat(core, leases, "a", 1, 10, (10,), running=0)
    assert first.command is Command.NONE and "waiting for every node" in first.message, first
    second = _beat(core, leases, "b", 1, 10, (10,))  # b's fresh report completes step 10
    assert second.command is Command.RESTART and second.restore_plan.step == 10
    again = _beat(core, leases, "a", 1, 10, (10,), running=0)
    assert again.command is Command.RESTART and again.restore_plan == second.restore_plan
    assert again.restore_plan.memory_steps == (10,)
    core.close()


def test_restart_in_place_waits_one_round_of_heartbeats_not_two() -> None:
    """On a clock that moves: the restart in place forms only once b is heard from after a's report (b could
    be the node whose death broke a's worker), and the holdings of that round are fresh enough for the plan: b
    gets RESTART in the same heartbeat, a at its next one (not one more round for fresh holdings)."""
    now = [100.0]
    core, leases = _running_two_node_job(now)
    _beat(core, leases, "a", 1, 9, (5,))
    _beat(core, leases, "b", 1, 9, (5,))
    now[0] += 0.1
    _beat(core, leases, "a", 1, 10, (10,))
    now[0] += 0.1
    core.report(FaultReport("j", "a", leases["a"], 1, Cause.WORKER_EXIT, Level.PROCESS, rank=0))
    now[0] += 0.1
    first = _beat(core, leases, "a", 1, 10, (10,), running=0)
    assert first.command is Command.STOP, first  # b not heard from since the report: nothing formed yet
    now[0] += 0.1
    second = _beat(core, leases, "b", 1, 10, (10,))
    assert second.command is Command.RESTART and second.restore_plan.step == 10, second
    now[0] += 0.1
    again = _beat(core, leases, "a", 1, 10, (10,), running=0)
    assert again.command is Command.RESTART and again.restore_plan == second.restore_plan
    core.close()


def test_a_silent_node_delays_the_restart_at_most_two_heartbeat_intervals() -> None:
    now = [100.0]
    core, leases = _running_two_node_job(now)
    _beat(core, leases, "a", 1, 10, (10,))
    core.report(FaultReport("j", "a", leases["a"], 1, Cause.WORKER_EXIT, Level.PROCESS, rank=0))
    assert _beat(core, leases, "a", 1, 10, (10,), running=0).command is Command.NONE
    now[0] += 2 * core._interval_s() + 0.01
    late = _beat(core, leases, "a", 1, 10, (10,), running=0)
    assert late.command is Command.RESTART and late.restore_plan.step == -1  # b's copy never reported
    core.close()


def test_heartbeats_name_each_nodes_buddy_and_plans_carry_the_peers_address() -> None:
    now = [100.0]
    core, leases = _two_node_job(now)

    def beat(node: str, gen: int, held=(), replica=(), running: int = 1):
        memory = tuple(MemoryHolding(s, 2, (0 if node == "a" else 1,), tuple(replica)) for s in held)
        _PORTS[0] += 1
        return core.heartbeat(Beat("j", node, leases[node], generation=gen, workers_running=running,
                                   free_port=_PORTS[0], memory=memory, replica_address=f"{node}:7000")).response

    for n in "ab":
        beat(n, -1)
    for n in "ab":
        beat(n, -1)
    assert beat("a", 1).replica_targets == (("b", "b:7000"),)
    assert beat("b", 1).replica_targets == (("a", "a:7000"),)
    wire = convert.ResponseCache().response(beat("a", 1))
    assert [(t.node_id, t.address) for t in wire.replica_targets] == [("b", "b:7000")]
    # b holds its own rank 1 and a's rank 0 as a replica; a lost its copy (say its tmpfs was wiped): a's rank is
    # planned from b's memory, at b's replica address.
    beat("a", 1, held=(), running=1)
    beat("b", 1, held=(8,), replica=(0,))
    core.report(FaultReport("j", "a", leases["a"], 1, Cause.WORKER_EXIT, Level.PROCESS, rank=0))
    beat("a", 1, running=0)
    got = beat("b", 1, held=(8,), replica=(0,))
    assert got.command is Command.RESTART
    assert got.restore_plan.ranks[0] == RankRestore(0, RestoreSource.PEER_MEMORY, "b", "b:7000")
    assert got.restore_plan.ranks[1].source is RestoreSource.LOCAL_MEMORY and got.restore_plan.step == 8
    core.close()


def test_a_lost_node_whose_buddy_is_lost_too_reads_storage() -> None:
    slots = (NodeSlot("s", 0, 0, 1, "", "p"), NodeSlot("c", 1, 1, 1, "", "p"))  # s, c replaced a and b
    # Only live nodes' reports count (the coordinator drops dead ones): nobody holds ranks 0 or 1 any more.
    plan = plan_restore(slots, 2, {"s": [], "c": [MemoryHolding(3, 2, ())]}, {"s": "s:1", "c": "c:1"})
    assert plan.step == -1 and {r.source for r in plan.ranks} == {RestoreSource.STORAGE}


def test_a_node_holding_no_replicas_is_nobodys_buddy_but_its_own_copies_stay_in_the_plan() -> None:
    """`trainguard run --replica-memory-mib 0` on b: a gets no buddy (b would refuse every copy), b still
    replicates to a, and b's server stays known for plans of its own copies (wire field ``replica_holds_none``,
    read through :func:`convert.beat`)."""
    now = [100.0]
    core, leases = _two_node_job(now)

    def beat(node: str, gen: int, held=(), running: int = 1):
        _PORTS[0] += 1
        req = pb.NodeHeartbeatRequest(job="j", node_id=node, lease_id=leases[node], generation=gen,
                                      workers_running=running, free_port=_PORTS[0], replica_address=f"{node}:7000",
                                      replica_holds_none=node == "b")
        req.memory.extend(pb.MemoryHolding(step=s, world_size=2, ranks=[0 if node == "a" else 1]) for s in held)
        return core.heartbeat(convert.beat(req)).response

    for _ in range(2):
        for n in "ab":
            beat(n, -1)
    assert beat("a", 1).replica_targets == ()
    assert beat("b", 1).replica_targets == (("a", "a:7000"),)
    assert core._memory.live_replica_addresses()["b"] == "b:7000"  # what restore plans name b's own copies by
    core.close()


def test_memory_older_than_the_committed_step_makes_no_plan_and_each_plan_is_logged_once(caplog) -> None:
    # From a review: a node back after a replacement still held its first life's step 19 in memory while step 89
    # was committed to storage: the coordinator logged "restore plan: step 19" (twice, re-planned on a membership
    # change) and ranks tried a futile peer fetch, though every rank restored 89 from disk.
    from trainguard.recovery.domain import GenerationTable
    from trainguard.recovery.memory_book import MemoryBook

    book = MemoryBook("j", alive=lambda n: True)
    book.record("a", (MemoryHolding(19, 4, (0, 1), replica_ranks=(2, 3)),), "10.0.0.1:7000")
    book.record("b", (MemoryHolding(19, 4, (2, 3)),), "10.0.0.2:7000")
    table = GenerationTable("j", 3, 4, "10.0.0.1", 29500, 1, 3, SLOTS)
    with caplog.at_level("INFO", logger="trainguard.recovery"):
        assert book.restore_plan(table, mver=1).step == 19  # nothing committed: memory is the newest
        assert book.restore_plan(table, mver=2).step == 19  # re-planned: the same plan, not logged again
        stale = book.restore_plan(table, mver=2, committed=89)
    assert stale is not None and stale.step == -1
    assert {r.source for r in stale.ranks} == {RestoreSource.STORAGE}
    said = [r.getMessage() for r in caplog.records if "restore plan" in r.getMessage()]
    assert len(said) == 2 and "step 19" in said[0] and "each restores from storage" in said[1], said
