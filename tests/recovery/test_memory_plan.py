"""Job-wide memory tier at the coordinator (recovery/memory_plan.py and its use in recovery/coordinator.py): which
steps every rank holds in memory somewhere, the per-rank restore plan sent with a new generation, its wire form,
and the wait for fresh holdings that keeps every node's plan the same."""

from __future__ import annotations

from trainguard.proto import coordinator_pb2 as pb
from trainguard.recovery import convert
from trainguard.recovery.coordinator import JobCoordinator, JobSpec
from trainguard.recovery.domain import Beat, Command, FaultReport, NodeRecord
from trainguard.recovery.memory_plan import (MemoryHolding, RankRestore, RestoreSource, complete_steps,
                                             plan_restore)
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
    reports = {"a": [MemoryHolding(20, 4, (0, 1)), MemoryHolding(30, 2, (0, 1))],
               "z": [MemoryHolding(20, 4, (2, 3))]}  # a peer holding b's ranks (a replica)
    plan = plan_restore(slots, 4, reports)
    assert plan.step == 20 and plan.memory_steps == ()  # ranks 2, 3 are not on their own node
    assert plan.ranks[2] == RankRestore(2, RestoreSource.PEER_MEMORY, "z")
    assert plan.ranks[0].source is RestoreSource.LOCAL_MEMORY
    alone = plan_restore(slots, 4, {"a": [MemoryHolding(20, 4, (0, 1))]})
    assert alone.step == -1 and {r.source for r in alone.ranks} == {RestoreSource.STORAGE}


def test_plan_crosses_the_wire_and_is_part_of_the_cached_start() -> None:
    plan = plan_restore(SLOTS, 4, {"a": [MemoryHolding(5, 4, (0, 1))], "b": [MemoryHolding(5, 4, (2, 3))]})
    msg = convert.restore_plan(plan)
    assert (msg.step, list(msg.memory_steps)) == (5, [5])
    assert [r.source for r in msg.ranks] == [pb.RESTORE_SOURCE_LOCAL_MEMORY] * 4
    hb = pb.NodeHeartbeatRequest(job="j", node_id="a", lease_id="l", memory=[
        pb.MemoryHolding(step=5, world_size=4, ranks=[0, 1])])
    assert convert.beat(hb).memory == (MemoryHolding(5, 4, (0, 1)),)


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


def test_a_silent_node_delays_the_restart_at_most_two_heartbeat_intervals() -> None:
    now = [100.0]
    core, leases = _two_node_job(now)
    for n in "ab":
        _beat(core, leases, n, -1, -1, ())
        _beat(core, leases, n, -1, -1, ())
    _beat(core, leases, "a", 1, 10, (10,))
    core.report(FaultReport("j", "a", leases["a"], 1, Cause.WORKER_EXIT, Level.PROCESS, rank=0))
    assert _beat(core, leases, "a", 1, 10, (10,), running=0).command is Command.NONE
    now[0] += 2 * core._interval_s() + 0.01
    late = _beat(core, leases, "a", 1, 10, (10,), running=0)
    assert late.command is Command.RESTART and late.restore_plan.step == -1  # b's copy never reported
    core.close()
