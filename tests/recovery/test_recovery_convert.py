"""Protobuf <-> domain conversion (recovery/convert.py): events classified, rank tables on the wire built once per
generation, large tables cut to the receiving node, and node records of older stores still restored."""

from __future__ import annotations

import json

from trainguard.proto import common_pb2, coordinator_pb2 as pb
from trainguard.recovery import convert
from trainguard.recovery.coordinator import JobCoordinator, JobSpec
from trainguard.recovery.domain import Command, GenerationTable, Instruction
from trainguard.recovery.policy import Cause, Phase
from trainguard.recovery.ranks import NodeSlot
from trainguard.recovery.store import MemoryStore, Put


def _ev(kind: str = "", action: int = 0, severity: int = common_pb2.SEVERITY_WARNING) -> common_pb2.HealthEvent:
    return common_pb2.HealthEvent(kind=kind, action=action, severity=severity)


def test_classify_maps_levels_actions_and_kinds() -> None:
    assert convert.classify(_ev(), pb.RECOVERY_LEVEL_JOB) is Cause.JOB_REQUEST
    assert convert.classify(_ev(action=common_pb2.ACTION_DRAIN_NODE), 0) is Cause.NODE_CRITICAL
    assert convert.classify(_ev("process.hang"), 0) is Cause.WORKER_HANG
    assert convert.classify(_ev("process.exit"), 0) is Cause.WORKER_EXIT
    assert convert.classify(_ev("gpu.xid", severity=common_pb2.SEVERITY_CRITICAL), 0) is Cause.NODE_CRITICAL
    assert convert.classify(_ev("gpu.temp"), 0) is Cause.ADVISORY
    # by word, as fail-slow reads hang reports: the process detector's own process.hung was a worker exit, and a
    # warning whose kind merely holds "hang" (an operator rule's link speed change) a hang, restarting the job
    assert convert.classify(_ev("process.hung", common_pb2.ACTION_RESTART_PROCESS, common_pb2.SEVERITY_ERROR),
                            pb.RECOVERY_LEVEL_PROCESS) is Cause.WORKER_HANG
    assert convert.classify(_ev("nccl.stalled"), 0) is Cause.WORKER_HANG
    for kind in ("hw.pcie_speed_change", "driver.install_pending", "nic.xchange"):
        assert convert.classify(_ev(kind), 0) is Cause.ADVISORY, kind
    req = pb.ReportEventRequest(job="j", node_id="n", lease_id="l", generation=1, proposed_level=pb.RECOVERY_LEVEL_NONE,
                                event=_ev("predictor", action=common_pb2.ACTION_CHECKPOINT_NOW))
    assert convert.fault_report(req).checkpoint_now


def test_start_responses_share_one_wire_table_and_big_tables_are_cut() -> None:
    slots = tuple(NodeSlot(f"n{i}", i, 2 * i, 2, "10.0.0.1", "p") for i in range(3))
    table = GenerationTable("j", 2, 6, "10.0.0.1", 29500, 1, 3, slots)
    cache = convert.ResponseCache()
    ins = Instruction(Command.START, Phase.RECOVERING, 0.5, "m", table)
    a, b = cache.response(ins), cache.response(ins)
    assert a is b and a.command == pb.NODE_COMMAND_START
    assert [n.node_id for n in a.rank_table.nodes] == ["n0", "n1", "n2"]
    assert a.rank_table.node_count == 3 and a.job_state == pb.JOB_STATE_RECOVERING
    cut = cache.response(Instruction(Command.START, Phase.RECOVERING, 0.5, "m", table, only_node="n1"))
    assert [n.node_id for n in cut.rank_table.nodes] == ["n1"] and cut.rank_table.node_count == 3


def test_node_records_of_an_older_store_are_restored() -> None:
    store = MemoryStore()
    info = common_pb2.NodeInfo(node_id="old", address="10.0.0.9",
                               topology=common_pb2.Topology(pod_id="p9", node_index=3, host="h", device_count=4))
    store.commit([], [Put("trainguard/jobs/j/nodes/old", json.dumps(
        {"info": info.SerializeToString().hex(), "lease": "abc", "instance": "i"}).encode())])
    core = JobCoordinator(JobSpec(job="j"), store=store)
    m = core.members()["old"]
    assert (m.info.pod_id, m.info.node_index, m.info.device_count, m.lease_id) == ("p9", 3, 4, "abc")
    core.close()


def test_heartbeat_observers_see_every_accepted_beat() -> None:
    from trainguard.recovery.domain import Beat, NodeRecord

    core = JobCoordinator(JobSpec(job="j", nnodes=2), store=MemoryStore())
    seen: list[tuple[str, int]] = []
    core.add_heartbeat_observer(lambda beat, now: seen.append((beat.node_id, beat.last_step)))
    lease, _, _ = core.register("j", NodeRecord("n0", "p", 0, "h0", 1), 40000)
    core.heartbeat(Beat("j", "n0", lease, last_step=7))
    assert seen == [("n0", 7)]
    core.close()


def test_failslow_fields_cross_the_wire_both_ways_and_the_shared_start_is_never_mutated() -> None:
    from trainguard.recovery.domain import FailSlowStatus, HangFinding, RankTiming, SlowRank, StackAsk

    hb = pb.NodeHeartbeatRequest(job="j", node_id="n", lease_id="l", generation=2, timings=[
        pb.RankTiming(rank=3, step=40, step_s=0.2, wait_s=0.05, compute_s=0.15, steps=4)])
    assert convert.beat(hb).timings == (RankTiming(3, 40, 0.2, 0.05, 0.15, 4),)
    ev = common_pb2.HealthEvent(kind="hang.stacks", evidence={"request_id": "r1", "stack.3": "S3", "stack": "S",
                                                              "pid": "77"})
    rep = convert.fault_report(pb.ReportEventRequest(job="j", node_id="n", lease_id="l", generation=2, event=ev))
    assert (rep.kind, dict(rep.stacks), rep.stack_request) == ("hang.stacks", {"stack.3": "S3", "stack": "S"}, "r1")

    status = FailSlowStatus(slow=(SlowRank(3, "n", 1.5, 0.05, 1700000000.0, "wait", 1.4),), job_step_s=0.2,
                            job_slowdown=1.4, action="report", message="1 slow rank(s)", ranks_observed=8,
                            hang=HangFinding(2, (3,), ("n",), "load (d.py)", "all_reduce (c.py)", 8, 2, 1, 5.0))
    cache = convert.ResponseCache()
    resp = cache.response(Instruction(Command.NONE, Phase.RUNNING, 0.5, failslow=status, stacks=StackAsk("r1", 2)))
    assert [(s.rank, s.node_id, s.ratio, s.basis) for s in resp.failslow.slow] == [(3, "n", 1.5, "wait")]
    assert resp.failslow.ranks_observed == 8 and list(resp.failslow.hang.outlier_ranks) == [3]
    assert resp.failslow.hang.outlier_frame == "load (d.py)" and resp.failslow.hang.repeats == 1
    assert (resp.stacks.request_id, resp.stacks.generation) == ("r1", 2)
    assert not cache.response(Instruction(Command.NONE, Phase.RUNNING, 0.5)).HasField("failslow")

    slots = (NodeSlot("n0", 0, 0, 1, "10.0.0.1", "p"), NodeSlot("n1", 1, 1, 1, "10.0.0.1", "p"))
    table = GenerationTable("j", 2, 2, "10.0.0.1", 29500, 1, 3, slots)
    plain = cache.response(Instruction(Command.START, Phase.RECOVERING, 0.5, "m", table))
    with_news = cache.response(Instruction(Command.START, Phase.RECOVERING, 0.5, "m", table, failslow=status,
                                           stacks=StackAsk("r1", 2)))
    assert with_news is not plain and with_news.failslow.slow[0].rank == 3 and with_news.stacks.request_id == "r1"
    assert not plain.HasField("failslow") and not plain.HasField("stacks")
    assert [n.node_id for n in with_news.rank_table.nodes] == ["n0", "n1"]
