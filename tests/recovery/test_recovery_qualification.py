"""The coordinator's side of node qualification: a node that failed its pre-flight check never gets a rank.

The real :class:`~trainguard.recovery.coordinator.JobCoordinator` on a real in-memory store, with a simulated
clock; the gRPC refusal is checked through the real service on a loopback port.
"""

from __future__ import annotations

import grpc
import pytest

from trainguard.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from trainguard.recovery import convert
from trainguard.recovery.coordinator import JobCoordinator, JobSpec
from trainguard.recovery.domain import Beat, Command, FaultReport, NodeRecord
from trainguard.recovery.policy import Cause, Level, Phase
from trainguard.recovery.qualification import Qualification
from trainguard.recovery.service import CoordinatorServer
from trainguard.recovery.store import MemoryStore

JOB = "q"
NARROW = Qualification(False, "pcie: 0000:3b:00.0 link trained at x4, below its x16", 0.05)
GOOD = Qualification(True, "", 0.04)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def node(nid: str, idx: int, spare: bool = False) -> NodeRecord:
    return NodeRecord(nid, "p", idx, nid, 1, f"10.0.0.{idx}", spare=spare)


def beat(core: JobCoordinator, nid: str, lease: str, gen: int = -1, **kw):
    return core.heartbeat(Beat(JOB, nid, lease, gen, 1 if gen > 0 else 0, free_port=30000 + len(nid) + gen + 7,
                               **kw)).response


def test_refused_node_is_cordoned_and_the_generation_forms_without_it() -> None:
    clock = Clock()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=2), store=MemoryStore(), clock=clock, wall=clock)
    leases = {}
    leases["bad"], _, fut = core.register(JOB, node("bad", 0), 31000, "i-bad", NARROW)
    core.wait_durable(fut)
    assert core.refusal("bad") == f"failed qualification: {NARROW.reason}"
    assert core.state.cordoned == ["bad"] and core.state.phase is Phase.FORMING
    leases["a"], _, _ = core.register(JOB, node("a", 1), 31001, "i-a", GOOD)
    leases["b"], _, _ = core.register(JOB, node("b", 2), 31002)  # an agent without qualification: placed
    assert core.refusal("a") == "" and core.refusal("b") == ""
    for nid in ("a", "b"):
        beat(core, nid, leases[nid])
    table = core.rank_table(JOB)
    assert table is not None and sorted(s.node_id for s in table.slots) == ["a", "b"]
    reply = beat(core, "bad", leases["bad"])
    assert reply.command is Command.STOP and NARROW.reason in reply.message
    core.close()


def test_refusal_survives_a_coordinator_restart_and_a_passing_recheck() -> None:
    store, clock = MemoryStore(), Clock()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=1), store=store, clock=clock, wall=clock)
    _, _, fut = core.register(JOB, node("bad", 0), 31000, "i1", NARROW)
    core.wait_durable(fut)
    core.close()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=1), store=store, clock=clock, wall=clock)
    assert core.refusal("bad") == f"failed qualification: {NARROW.reason}"
    # The node comes back passing (the link retrained): it stays cordoned for this job, with the first reason.
    lease, _, _ = core.register(JOB, node("bad", 0), 31003, "i2", GOOD)
    assert core.refusal("bad") == f"failed qualification: {NARROW.reason}"
    assert beat(core, "bad", lease).command is Command.STOP and core.rank_table(JOB) is None
    core.close()


def test_spare_failing_its_recheck_is_never_promoted() -> None:
    clock, store = Clock(), MemoryStore()
    spec = JobSpec(job=JOB, nnodes=1, heartbeat_interval_s=0.5, lease_timeout_s=3.0)
    core = JobCoordinator(spec, store=store, clock=clock, wall=clock)
    la, _, _ = core.register(JOB, node("a", 0), 31000, "ia", GOOD)
    ls1, _, _ = core.register(JOB, node("s1", 1, spare=True), 31001, "is1", GOOD)
    ls2, _, _ = core.register(JOB, node("s2", 2, spare=True), 31002, "is2", GOOD)
    assert beat(core, "a", la).command is Command.START
    for nid, lease in (("s1", ls1), ("s2", ls2)):
        assert beat(core, nid, lease).command is Command.WAIT
    # s1 (first in rank order) re-qualifies while waiting and fails: cordoned, so s2 takes the slot.
    reply = core.heartbeat(Beat(JOB, "s1", ls1, -1, free_port=31011, qualification=NARROW))
    assert reply.response.command is Command.STOP and "s1" in core.state.cordoned
    core.wait_durable(reply.durable)
    assert core.refusal("s1") == f"failed qualification: {NARROW.reason}"
    assert core.state.phase is Phase.RUNNING and core.state.generation == 1  # no restart for a spare
    core.report(FaultReport(JOB, "a", la, 1, Cause.NODE_CRITICAL, Level.NODE, rank=0, exit_code=-9, detail="gpu lost"))
    clock.t += 2.0  # past the backoff
    for _ in range(3):
        beat(core, "s2", ls2)
        beat(core, "s1", ls1)
    table = core.rank_table(JOB)
    assert table is not None and table.generation == 2 and [s.node_id for s in table.slots] == ["s2"]
    core.close()
    core = JobCoordinator(spec, store=store, clock=clock, wall=clock)  # restarted: the reason is durable
    assert core.refusal("s1") == f"failed qualification: {NARROW.reason}"
    core.close()


def test_slot_holder_restarted_and_failing_is_a_node_level_failure() -> None:
    clock = Clock()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=1), store=MemoryStore(), clock=clock, wall=clock)
    la, _, _ = core.register(JOB, node("a", 0), 31000, "ia1", GOOD)
    core.register(JOB, node("s", 1, spare=True), 31001, "is", GOOD)
    assert beat(core, "a", la).command is Command.START
    beat(core, "a", la, gen=1)
    _, _, fut = core.register(JOB, node("a", 0), 31002, "ia2", NARROW)  # its agent restarted; the check fails
    core.wait_durable(fut)
    assert "a" in core.state.cordoned and core.refusal("a")
    table = core.rank_table(JOB)  # a node-level restart: the spare took the slot at once
    assert table is not None and table.generation == 2 and [sl.node_id for sl in table.slots] == ["s"]
    core.close()


def test_the_service_refuses_with_failed_precondition_naming_the_reason() -> None:
    server = CoordinatorServer(JobSpec(job=JOB, nnodes=1, store="memory://"), listen="127.0.0.1:0").start()
    try:
        with grpc.insecure_channel(server.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            check = coordinator_pb2.QualificationCheck(name="pcie", status="fail",
                                                       detail="0000:3b:00.0 link trained at x4, below its x16")
            q = coordinator_pb2.NodeQualification(passed=False, duration_s=0.05, checks=[check])
            info = common_pb2.NodeInfo(node_id="bad", topology=common_pb2.Topology(host="bad", device_count=1))
            req = coordinator_pb2.RegisterNodeRequest(job=JOB, free_port=31000, qualification=q, node=info)
            with pytest.raises(grpc.RpcError) as exc:
                stub.RegisterNode(req, timeout=5)
            assert exc.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "node 'bad' is cordoned (failed qualification: pcie: 0000:3b:00.0 link trained at x4" \
                in exc.value.details()
            # its agent never learns the lease, so the job's end is not held for it (see the test below)
            assert "bad" in server.core._refused_at_registration
            too_many = coordinator_pb2.RegisterNodeRequest()
            too_many.CopyFrom(req)
            too_many.qualification.checks.extend([coordinator_pb2.QualificationCheck(name="x")] * 40)
            with pytest.raises(grpc.RpcError) as exc:
                stub.RegisterNode(too_many, timeout=5)
            assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "qualification.checks" in exc.value.details()
    finally:
        server.stop()


def test_convert_reads_the_verdict_and_its_absence() -> None:
    req = coordinator_pb2.NodeHeartbeatRequest(job=JOB, node_id="n", lease_id="l")
    assert convert.beat(req).qualification is None
    req.qualification.passed = True
    assert convert.beat(req).qualification == Qualification(True, "", 0.0)
    req.qualification.CopyFrom(coordinator_pb2.NodeQualification(passed=False, checks=[
        coordinator_pb2.QualificationCheck(name="disk", status="fail", detail="/data: 3 MiB/s")]))
    assert convert.beat(req).qualification.refusal == "failed qualification: disk: /data: 3 MiB/s"


def test_qualify_peers_are_live_qualified_echoing_nodes_with_the_median_reference() -> None:
    clock = Clock()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=9), store=MemoryStore(), clock=clock, wall=clock)
    core.register(JOB, node("a", 0), 31000, "ia", Qualification(True, echo_port=40000))
    core.register(JOB, node("b", 1), 31001, "ib", Qualification(True, echo_port=40001, peer_s=0.02))
    core.register(JOB, node("c", 2), 31002, "ic", Qualification(True, echo_port=40002, peer_s=0.04))
    core.register(JOB, node("d", 3), 31003, "id", Qualification(True, peer_s=0.03))  # serves no exchange
    core.register(JOB, node("e", 4), 31004, "ie", Qualification(False, "peers: slow", echo_port=40004, peer_s=9.0))
    peers, reference, history = core.qualify_peers(JOB, "c", 5)
    assert sorted(peers) == [("a", "10.0.0.0", 40000), ("b", "10.0.0.1", 40001)]
    assert (reference, history) == (0.03, 3)  # the refused node's time is not part of the reference
    assert len(core.qualify_peers(JOB, "new", 1)[0]) == 1
    clock.t += 60  # every lease expired: no live peer
    assert core.qualify_peers(JOB, "new", 3)[0] == []
    core.close()


def test_decide_node_disqualified_is_pure_and_idempotent() -> None:
    from trainguard.recovery.decide import Announce, NodeDisqualified, Persist, decide
    from trainguard.recovery.policy import PolicyConfig, PolicyState

    state = PolicyState()
    step = decide(PolicyConfig(), state, NodeDisqualified("n7", NARROW.refusal))
    assert state.cordoned == [] and step.state.cordoned == ["n7"]  # the input is untouched
    assert isinstance(step.actions[0], Persist) and isinstance(step.actions[1], Announce)
    assert step.state.message == f"node n7 cordoned: {NARROW.refusal}"
    again = decide(PolicyConfig(), step.state, NodeDisqualified("n7", "another reason"))
    assert not again.changed and again.state.message == step.state.message


def test_past_the_cordon_bound_a_refused_node_is_refused_membership_instead() -> None:
    """With the job state's cordon list full (the coordinator's --max-cordoned set to 1), a node failing its
    pre-flight check is kept out by refusing it membership, at registration or at the heartbeat that carries the
    failed check."""
    from trainguard.recovery.errors import CapacityError, UnknownNodeError

    clock = Clock()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=2, max_cordoned=1), store=MemoryStore(), clock=clock, wall=clock)
    try:
        core.wait_durable(core.register(JOB, node("bad", 0), 31000, "i-bad", NARROW)[2])
        assert core.state.cordoned == ["bad"]
        with pytest.raises(CapacityError, match="cordon list holds 1 nodes.*trainguard uncordon"):
            core.register(JOB, node("bad2", 1), 31001, "i-bad2", NARROW)
        assert "bad2" not in core.members()
        lease, _, _ = core.register(JOB, node("late", 2), 31002, "i-late")
        with pytest.raises(CapacityError, match="cordon list holds 1 nodes"):
            beat(core, "late", lease, qualification=NARROW)
        assert "late" not in core.members() and core.state.cordoned == ["bad"]
        with pytest.raises(UnknownNodeError):  # its lease is void: the agent must register (and is refused)
            beat(core, "late", lease)
    finally:
        core.close()


def test_the_end_of_a_job_is_not_held_for_a_node_refused_at_registration() -> None:
    """The refused node's agent never learns its lease (the registration answer is the refusal), so it never
    heartbeats: `--exit-when-done` and the embedding launcher waited out its lease (~10 s) at every job's end."""
    clock = Clock()
    core = JobCoordinator(JobSpec(job=JOB, nnodes=2), store=MemoryStore(), clock=clock, wall=clock)
    leases = {}
    _, _, fut = core.register(JOB, node("bad", 0), 31000, "i-bad", NARROW)
    core.wait_durable(fut)
    core.registration_refused("bad")  # what the service does as it answers with the refusal
    for i, nid in enumerate(("a", "b"), start=1):
        leases[nid], _, _ = core.register(JOB, node(nid, i), 31000 + i, f"i-{nid}", GOOD)
    gen = {nid: beat(core, nid, leases[nid]).table.generation for nid in ("a", "b")}
    beat(core, "a", leases["a"], gen["a"], workers_succeeded=True)
    assert core.not_told_of_end() == ["a", "b"]  # still running: nobody was told
    for nid in ("a", "b", "a"):  # b's answer ends the job, a's next one tells it
        core.answered(Beat(JOB, nid, leases[nid], gen[nid], 1, workers_succeeded=True))
    assert core.state.phase is Phase.SUCCEEDED
    assert core.not_told_of_end() == []  # "bad" is alive (its lease runs) but nothing can tell it
    core.close()

