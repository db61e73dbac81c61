"""Fail-slow through a real coordinator over gRPC: timings in heartbeats -> a straggler shown in every reply and
replaced by a spare by policy; hang reports -> stacks asked of every node, grouped, the repeated outlier
replaced; malformed timings refused by field."""

from __future__ import annotations

import time

import grpc
import pytest

from trainguard.proto import common_pb2, coordinator_pb2_grpc
from trainguard.proto import coordinator_pb2 as pb
from trainguard.recovery.service import CoordinatorServer, JobSpec
from trainguard.recovery.straggler import StragglerConfig

JOB = "failslow-test"
_ports = iter(range(41000, 60000))

WAITING = '''Thread 100 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2501)
    train_step (train.py:40)
    <module> (train.py:60)
'''
STUCK = '''Thread 101 (idle): "MainThread"
    load_batch (data.py:12)
    train_step (train.py:35)
    <module> (train.py:60)
'''


class Node:
    def __init__(self, stub, nid: str, idx: int, spare: bool = False) -> None:
        self.stub, self.nid, self.gen, self.table, self.step = stub, nid, -1, None, 0
        info = common_pb2.NodeInfo(node_id=nid, address="127.0.0.1", spare=spare,
                                   topology=common_pb2.Topology(pod_id="p", node_index=idx, host=nid, device_count=1))
        self.lease = stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=info, free_port=next(_ports))).lease_id

    @property
    def rank(self) -> int:
        return next(n.first_rank for n in self.table.nodes if n.node_id == self.nid)

    def beat(self, own_s: float | None = None, step_s: float = 0.2) -> pb.NodeHeartbeatResponse:
        timings = []
        if own_s is not None and self.gen > 0:
            self.step += 4
            timings = [pb.RankTiming(rank=self.rank, step=self.step, step_s=step_s, wait_s=step_s - own_s,
                                     compute_s=own_s, steps=4)]
        resp = self.stub.Heartbeat(pb.NodeHeartbeatRequest(
            job=JOB, node_id=self.nid, lease_id=self.lease, generation=self.gen, free_port=next(_ports),
            workers_running=1 if self.gen > 0 else 0, last_step=self.step if self.gen > 0 else -1, timings=timings))
        if resp.command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_RESTART):
            self.gen, self.table, self.step = resp.rank_table.generation, resp.rank_table, 0
        elif resp.command == pb.NODE_COMMAND_STOP:
            self.gen = -1
        return resp

    def report(self, kind: str, evidence: dict, rank: int = -1, level=pb.RECOVERY_LEVEL_PROCESS, gen=None):
        ev = common_pb2.HealthEvent(node_id=self.nid, source="process", kind=kind, message=kind,
                                    severity=common_pb2.SEVERITY_ERROR, evidence=evidence)
        return self.stub.ReportEvent(pb.ReportEventRequest(job=JOB, node_id=self.nid, lease_id=self.lease,
                                                           generation=self.gen if gen is None else gen, event=ev,
                                                           proposed_level=level, failed_rank=rank))


@pytest.fixture
def coord(request):
    fs = StragglerConfig(window_s=0.3, persist_windows=3, clear_windows=3, min_steps=1, action="replace",
                         horizon_s=600, restart_cost_s=5, cooldown_s=0)
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.1, lease_timeout_s=30,
                                    backoff_initial_s=0.0, failslow=fs)).start()
    chan = grpc.insecure_channel(srv.target)
    try:
        yield srv, coordinator_pb2_grpc.CoordinatorStub(chan)
    finally:
        chan.close()
        srv.stop(0)


def _form(stub) -> tuple[Node, Node, Node]:
    a, b, s = Node(stub, "a", 0), Node(stub, "b", 1), Node(stub, "s", 9, spare=True)
    for _ in range(3):
        for n in (a, b, s):
            n.beat()
    assert a.gen == b.gen == 1 and s.gen == -1
    return a, b, s


def test_straggler_is_shown_to_every_node_then_replaced_by_the_spare_and_the_cost_measured(coord):
    srv, stub = coord
    a, b, s = _form(stub)
    shown = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and s.gen < 2:
        ra = a.beat(own_s=0.05)
        rb = b.beat(own_s=0.2)  # b's own work is 4x a's: a waits 150 ms of every 200 ms step for it
        s.beat()
        shown = next((r.failslow for r in (ra, rb) if r.failslow.slow), shown)
        time.sleep(0.05)
    assert shown is not None, "no reply ever listed the straggler"
    assert [(x.rank, x.node_id) for x in shown.slow] == [(1, "b")]
    assert shown.slow[0].ratio == pytest.approx(4.0, rel=0.01) and shown.slow[0].excess_s == pytest.approx(0.15)
    assert s.gen >= 2, "the straggler node was not replaced"
    assert [n.node_id for n in s.table.nodes] == ["a", "s"] and s.rank == 1  # the spare took b's slot
    r = b.beat()
    assert r.command == pb.NODE_COMMAND_STOP and "cordoned" in r.message
    # Back at the step reached before: the node restart's cost is measured and replaces the assumed 5 s.
    for _ in range(60):
        a.beat(own_s=0.05)
        s.beat(own_s=0.05)
        if srv.core._failslow.policy.measured:
            break
        time.sleep(0.02)
    assert srv.core._failslow.policy.measured and 0 < srv.core._failslow.policy.cost_s < 20


def test_a_rank_slow_by_its_role_is_reported_not_replaced_again_when_its_replacement_is_as_slow(coord):
    # Rank 1 is slower whatever node runs it (its role: the last pipeline stage, say). Replacing b once is fair
    # (the policy cannot tell yet), but when the spare that took b's slot is just as slow in rank 1, the slowness
    # follows the rank, not the node: a second replacement would only burn the next spare, and the next.
    srv, stub = coord
    a, b, s1 = _form(stub)
    s2 = Node(stub, "s2", 10, spare=True)
    nodes = [a, b, s1, s2]

    def beat_all() -> list[pb.NodeHeartbeatResponse]:
        out = []
        for n in nodes:
            rank = n.rank if n.gen > 0 else -1
            out.append(n.beat(own_s=0.2 if rank == 1 else 0.05))  # rank 1's own work is 4x, on any node
        time.sleep(0.05)
        return out

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and s1.gen < 2:
        beat_all()
    assert s1.gen == 2 and s1.rank == 1, "the first straggler node was not replaced"
    verdict = ""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and s2.gen < 3 and not verdict:
        verdict = next((r.failslow.message for r in beat_all() if "follows the rank" in r.failslow.message), "")
    assert s2.gen < 3 and [n.node_id for n in a.table.nodes] == ["a", "s"], "replaced again: a role straggler " \
        "burns one spare after another"
    assert "rank 1" in verdict and "node b" in verdict, verdict
    # Still slow and still shown, and still not replaced.
    for _ in range(10):
        rs = beat_all()
    assert s2.gen < 3 and [(x.rank, x.node_id) for x in rs[0].failslow.slow] == [(1, "s")]


def test_hang_stacks_are_gathered_from_every_node_and_a_repeated_outlier_is_replaced(coord):
    srv, stub = coord
    a, b, s = _form(stub)
    for round_ in (1, 2):
        gen = a.gen
        a.report("process.hung", {"stack": WAITING}, rank=a.rank)
        rb = b.beat()
        assert rb.stacks.request_id and rb.stacks.generation == gen
        ans = b.report("hang.stacks", {"request_id": rb.stacks.request_id, f"stack.{b.rank}": STUCK},
                       level=pb.RECOVERY_LEVEL_NONE, gen=gen)
        assert ans.decided_level == pb.RECOVERY_LEVEL_NONE and "1 stack(s)" in ans.message
        r = a.beat()
        h = r.failslow.hang
        assert list(h.outlier_ranks) == [1] and list(h.outlier_nodes) == ["b"] and h.repeats == round_
        assert h.outlier_frame == "load_batch (data.py)" and h.majority_frame.startswith("all_reduce")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and a.gen <= gen:
            for n in (a, b, s):
                n.beat()
        assert a.gen > gen
    # The second hang with the same outlier: b's slot went to the spare.
    assert [n.node_id for n in a.table.nodes] == ["a", "s"]


def test_malformed_timings_are_refused_naming_the_field(coord):
    srv, stub = coord
    a = Node(stub, "a", 0)
    for bad, field in [(pb.RankTiming(rank=0, step_s=float("nan"), steps=1), "step_s"),
                       (pb.RankTiming(rank=0, step_s=0.1, wait_s=-5, steps=1), "wait_s"),
                       (pb.RankTiming(rank=-1, step_s=0.1, steps=1), "rank")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="a", lease_id=a.lease, generation=-1,
                                                   timings=[bad]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


@pytest.mark.parametrize("args", [["coordinator", "--job", "x", "--listen", "127.0.0.1:0", "--failslow-ratio", "0.9"],
                                  ["run", "--failslow-ratio", "1.0", "examples/train.py"]])
def test_bad_failslow_flags_are_one_line_errors_naming_the_flag(args):
    import os

    from tg_testutil import run_cli

    r = run_cli(args, env=dict(os.environ), timeout=60)
    assert r.returncode != 0 and "--failslow-ratio" in r.stderr and "Traceback" not in r.stderr


# -- the core on plain types (no gRPC), on a simulated clock ---------------------------------------------------
class _Core:
    """A JobCoordinator fed domain types directly, nodes a and b (+ spares), time advanced by hand."""

    def __init__(self, spares: int = 0) -> None:
        from trainguard.recovery.coordinator import JobCoordinator
        from trainguard.recovery.domain import NodeRecord
        from trainguard.recovery.store import MemoryStore

        self.t = 0.0
        fs = StragglerConfig(window_s=0.3, persist_windows=3, clear_windows=3, min_steps=1, action="replace",
                             horizon_s=600, restart_cost_s=5, cooldown_s=0)
        self.core = JobCoordinator(JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.1, lease_timeout_s=30,
                                           backoff_initial_s=0.0, failslow=fs), store=MemoryStore(),
                                   clock=lambda: self.t)
        names = ["a", "b"] + [f"s{i}" for i in range(spares)]
        self.lease = {n: self.core.register(JOB, NodeRecord(n, "p", i, n, 1, "127.0.0.1", spare=n.startswith("s")),
                                            next(_ports))[0] for i, n in enumerate(names)}
        self.gen = {n: -1 for n in names}
        self.step = {n: 0 for n in names}
        for _ in range(3):
            for n in names:
                self.beat(n)
        assert self.gen["a"] == self.gen["b"] == 1

    def beat(self, n: str, own_s: float | None = None, step_s: float = 0.2):
        from trainguard.recovery.domain import Beat, Command, RankTiming

        timings: tuple = ()
        if own_s is not None and self.gen[n] > 0:
            self.step[n] += 4
            rank = self.core.layout.slot_of(n).first_rank
            timings = (RankTiming(rank, self.step[n], step_s, step_s - own_s, own_s, 4),)
        ins = self.core.heartbeat(Beat(JOB, n, self.lease[n], self.gen[n], 1 if self.gen[n] > 0 else 0, False,
                                       self.step[n] if self.gen[n] > 0 else -1, next(_ports), timings)).response
        if ins.command in (Command.START, Command.RESTART):
            self.gen[n], self.step[n] = ins.table.generation, 0
        elif ins.command is Command.STOP:
            self.gen[n] = -1
        return ins

    def report(self, n: str, kind: str, stacks: dict, rank: int = -1, request: str = ""):
        from trainguard.recovery.domain import FaultReport
        from trainguard.recovery.policy import Cause, Level

        # The cause is what convert.classify makes of these kinds ("hang" in the kind: a worker hang).
        return self.core.report(FaultReport(JOB, n, self.lease[n], self.gen[n], Cause.WORKER_HANG,
                                            Level.NONE if kind == "hang.stacks" else Level.PROCESS, rank,
                                            detail=kind, kind=kind, stacks=stacks, stack_request=request))


def test_core_a_straggler_with_no_spare_is_reported_in_every_reply_but_never_replaced() -> None:
    c = _Core(spares=0)
    seen = None
    for _ in range(60):
        c.t += 0.1
        ins = c.beat("a", own_s=0.05)
        c.beat("b", own_s=0.2)
        if ins.failslow is not None and ins.failslow.slow:
            seen = ins.failslow
    assert seen is not None and [(r.rank, r.node_id) for r in seen.slow] == [(1, "b")]
    assert seen.action == "report" and "slow node(s): b" in seen.message
    st = c.core.state
    assert st.generation == 1 and st.restart_count == 0 and st.plan is None and not st.cordoned
    assert c.gen == {"a": 1, "b": 1}
    c.core.close()


def test_core_stack_answers_stay_with_failslow_and_never_reach_the_policy() -> None:
    from trainguard.recovery.policy import Level

    c = _Core(spares=1)
    before = c.core.state
    level, gen, msg, _ = c.report("b", "hang.stacks", {"stack.1": STUCK}, request="nobody-asked")
    assert (level, gen) == (Level.NONE, 1) and "no hang localisation is open" in msg
    assert c.core.state is before  # the policy never saw it: no decision, no new state
    level, _, _, _ = c.report("a", "process.hung", {"stack": WAITING}, rank=0)
    assert level is Level.PROCESS  # a hang report goes to the policy as before (and opens a collection)
    after_hang = c.core.state
    ask = c.beat("b").stacks
    assert ask is not None and ask.generation == 1
    level, gen, msg, _ = c.report("b", "hang.stacks", {"stack.1": STUCK}, request=ask.request_id)
    assert level is Level.NONE and "1 stack(s)" in msg
    assert c.core.state is after_hang and after_hang.restart_count <= 1
    hang = c.beat("a").failslow.hang
    assert hang.outlier_ranks == (1,) and hang.outlier_nodes == ("b",) and hang.repeats == 1
    c.core.close()


def test_a_hang_localised_in_its_own_report_is_named_in_the_restart_reason() -> None:
    # Found by a review: rank 1 of a one-node job SIGSTOPped; rank 0, waiting in all_reduce, was found silent
    # first. The locator named rank 1, but the restart line (and `trainguard events`) blamed rank 0 only.
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, Command, FaultReport, NodeRecord
    from trainguard.recovery.policy import Cause, Level
    from trainguard.recovery.store import MemoryStore

    t = [0.0]
    core = JobCoordinator(JobSpec(job=JOB, nnodes=1, heartbeat_interval_s=0.1, lease_timeout_s=30,
                                  backoff_initial_s=0.0), store=MemoryStore(), clock=lambda: t[0])
    lease = core.register(JOB, NodeRecord("a", "p", 0, "a", 2, "127.0.0.1"), next(_ports))[0]
    ins = core.heartbeat(Beat(JOB, "a", lease, -1, 0, False, -1, next(_ports))).response
    assert ins.command is Command.START and ins.table.world_size == 2

    def hung(rank: int, stacks: dict) -> str:
        return core.report(FaultReport(JOB, "a", lease, 1, Cause.WORKER_HANG, Level.PROCESS, rank,
                                       detail=f"worker rank {rank} sent no step heartbeat for 60.2 s",
                                       kind="process.hung", stacks=stacks))[2]

    msg = hung(0, {"stack.0": WAITING, "stack.1": STUCK})
    assert "hang localised to rank(s) 1 on a in load_batch (data.py)" in msg, msg
    assert "the other ranks wait in all_reduce" in msg and "worker rank 0 sent no step heartbeat" in msg, msg
    core.close()


def test_a_hang_with_many_outliers_keeps_the_reporters_text_in_the_restart_reason() -> None:
    # The description is cut at MAX_DETAIL characters: a blame listing every outlier rank pushed the worker's own
    # "sent no step heartbeat" out of it.
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, FaultReport, NodeRecord
    from trainguard.recovery.policy import Cause, Level
    from trainguard.recovery.store import MemoryStore

    core = JobCoordinator(JobSpec(job=JOB, nnodes=1, heartbeat_interval_s=0.1, lease_timeout_s=30,
                                  backoff_initial_s=0.0), store=MemoryStore(), clock=lambda: 0.0)
    lease = core.register(JOB, NodeRecord("a", "p", 0, "a", 16, "127.0.0.1"), next(_ports))[0]
    core.heartbeat(Beat(JOB, "a", lease, -1, 0, False, -1, next(_ports)))
    stacks = {f"stack.{r}": WAITING if r < 9 else STUCK for r in range(16)}
    msg = core.report(FaultReport(JOB, "a", lease, 1, Cause.WORKER_HANG, Level.PROCESS, 0,
                                  detail="worker rank 0 (pid 4242) sent no step heartbeat for 60.2 s after step 99",
                                  kind="process.hung", stacks=stacks))[2]
    assert "hang localised to rank(s) 9, 10, 11 and 4 more on a" in msg, msg
    assert "sent no step heartbeat for 60.2 s" in msg, msg
    core.close()


def test_a_shrink_that_renumbers_the_ranks_forgets_which_ranks_replacements_were_for() -> None:
    # b was replaced for slow rank 1. Then a is lost with no spare and the job shrinks: every rank is numbered
    # anew, so rank 1 is other work now (in another place of the pipeline). The node holding it, slow on a bad
    # GPU, was reported as "the slowness follows the rank" and never replaced, with a spare waiting.
    fs = StragglerConfig(window_s=0.3, persist_windows=3, clear_windows=3, min_steps=1, action="replace",
                         horizon_s=600, restart_cost_s=5, cooldown_s=0)
    # A 3 s lease: one thread beats four nodes in turn, and a 1 s lease lost a live one on a loaded box (the
    # shrink then came out in another shape).
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=3, heartbeat_interval_s=0.1, lease_timeout_s=3.0,
                                    backoff_initial_s=0.0, allow_shrink=True, min_nodes=2, failslow=fs)).start()
    chan = grpc.insecure_channel(srv.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(chan)
        a, b, c, s = Node(stub, "a", 0), Node(stub, "b", 1), Node(stub, "c", 2), Node(stub, "s", 9, spare=True)
        nodes = [a, b, c, s]
        slow = {"b"}

        def beat_all(live: list[Node]) -> list[pb.NodeHeartbeatResponse]:
            out = [n.beat(own_s=0.2 if n.nid in slow else 0.05) for n in live]
            time.sleep(0.05)
            return out

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and s.gen < 2:
            beat_all(nodes)
        assert s.gen == 2 and s.rank == 1, "b was not replaced"
        slow = set()
        live = [b, c, s]  # a is lost; b is cordoned, so nobody can take a's slot: the job shrinks
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (c.gen >= 3 and s.gen == c.gen and len(c.table.nodes) == 2):
            beat_all(live)
        assert len(c.table.nodes) == 2, [n.node_id for n in c.table.nodes]
        holder = next(n for n in (c, s) if n.rank == 1)
        assert holder is c, "this test needs the shrink to renumber c into rank 1"
        t = Node(stub, "t", 10, spare=True)
        live = [c, s, t]
        slow = {"c"}  # a bad GPU: c is slow on whatever rank it runs
        gen = c.gen
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and t.gen <= gen:
            beat_all(live)
        assert t.gen > gen and sorted(n.node_id for n in t.table.nodes) == ["s", "t"], \
            (srv.core._failslow.policy.verdict, [n.node_id for n in c.table.nodes])
    finally:
        chan.close()
        srv.stop(0)


def test_a_later_straggler_reads_report_not_the_replacement_of_a_generation_ago() -> None:
    """b was replaced by the spare. In the next generation a turns slow, with no spare left: reported only. Every
    reply and every node's event said "action: replace b" for it, for good: an operator read that the straggler
    a was being dealt with by replacing a node that was gone long ago."""
    from trainguard.agent.step_timing import FailSlowView
    from trainguard.recovery.convert import failslow_status

    c = _Core(spares=1)
    for _ in range(80):
        c.t += 0.1
        c.beat("a", own_s=0.05)
        c.beat("b", own_s=0.2 if c.core.layout.slot_of("b") is not None else None)
        c.beat("s0")
        if c.gen["s0"] == 2:
            break
    assert c.gen["s0"] == 2 and c.core.layout.slot_of("b") is None, "b was not replaced"
    view = FailSlowView("s0")
    events, last = [], None
    for _ in range(80):
        c.t += 0.1
        c.beat("a", own_s=0.2)
        ins = c.beat("s0", own_s=0.05)
        if ins.failslow is not None:
            last = ins.failslow
            events += view.update(failslow_status(ins.failslow))
    assert last is not None and [(r.rank, r.node_id) for r in last.slow] == [(0, "a")]
    assert c.gen["a"] == 2, "a was replaced with no spare left"
    assert last.action == "report", last.action
    about_a = [e.message for e in events if e.evidence["node"] == "a"]
    assert len(about_a) == 1 and about_a[0].startswith("rank 0 on node a"), about_a
    assert about_a[0].endswith("action: report"), about_a
    c.core.close()


def test_a_reply_built_while_the_flagging_window_is_scored_raises_no_second_event() -> None:
    """The coordinator scores a closed window outside its lock (~1 s at 16k ranks) and applies it after. A reply
    built in between (here after a hang collection closed, which renews the status) listed the new straggler
    with no time yet (0), the next reply with the time apply noted: every node's view tells findings apart by
    that time and raised the same straggler twice."""
    from trainguard.agent.step_timing import FailSlowView
    from trainguard.recovery.convert import failslow_status
    from trainguard.recovery.domain import Beat, FaultReport, RankTiming
    from trainguard.recovery.failslow import FailSlowSupervisor
    from trainguard.recovery.policy import Cause, Level

    wall = [5000.0]
    sup = FailSlowSupervisor(StragglerConfig(window_s=1.0, persist_windows=2, min_steps=1), hang_collect_s=0.5,
                             wall=lambda: wall[0])
    view = FailSlowView("a")
    events = []

    def reply() -> None:
        st = sup.reply_findings()
        if st is not None:
            events.extend(view.update(failslow_status(st)))

    t, flagged = 0.0, False
    for i in range(40):
        t += 0.5
        wall[0] += 0.5
        for n, rank, own in (("a", 0, 0.05), ("b", 1, 0.2)):
            sup.on_beat(Beat(JOB, n, "l", 1, 1, False, i, 0, (RankTiming(rank, i, 0.2, 0.2 - own, own, 2),)), 1, t)
            reply()
        snap = sup.pop_window()
        if snap is None:
            continue
        res = sup.score(snap)  # outside the coordinator's lock: other heartbeats are answered meanwhile
        if res.newly_flagged:
            flagged = True
            sup.on_report(FaultReport(JOB, "a", "l", 1, Cause.WORKER_HANG, Level.PROCESS, 0, detail="process.hung",
                                      kind="process.hung", stacks={"stack": WAITING}), 1, {0: "a", 1: "b"}, t)
            sup.tick(t + 1.0)  # the collection closes: the status is built anew for the next reply
            reply()
            wall[0] += 0.3
        sup.apply_window(res, t, lambda: 0)
        reply()
        if flagged:
            break
    assert flagged
    assert [e.message.split(" is ")[0] for e in events if e.kind == "failslow.straggler"] == ["rank 1 on node b"]


def test_a_node_fault_whose_kind_holds_change_or_install_opens_no_hang_localisation() -> None:
    """A hang report is one whose kind says hung, hang or stall. The kind was searched for those letters, so a
    node-level fault from an operator rule, hw.pcie_speed_change ("c-hang-e"), opened a hang localisation: every
    node dumped its workers' stacks, and the "outlier" of running ranks could be replaced as a repeated hang."""
    from trainguard.recovery.domain import FaultReport
    from trainguard.recovery.failslow import FailSlowSupervisor
    from trainguard.recovery.policy import Cause, Level

    sup = FailSlowSupervisor(StragglerConfig())
    for kind in ("hw.pcie_speed_change", "driver.reinstall"):
        out = sup.on_report(FaultReport(JOB, "a", "l", 1, Cause.NODE_CRITICAL, Level.NODE, -1, detail=kind,
                                        kind=kind), 1, {0: "a", 1: "b"}, 0.0)
        assert not out.handled and sup.stack_request() is None, kind
    sup.on_report(FaultReport(JOB, "a", "l", 1, Cause.WORKER_HANG, Level.PROCESS, 0, detail="process.hung",
                              kind="process.hung", stacks={"stack": WAITING}), 1, {0: "a", 1: "b"}, 0.0)
    assert sup.stack_request() is not None


def test_a_shrink_restarts_the_ranks_own_baselines_so_the_job_does_not_read_slow_for_good() -> None:
    """4 ranks at 1.0 s a step form their baselines; the job shrinks to 3 and each rank's step takes 1.33 s (the
    same global batch on fewer ranks). The job slowdown stayed 1.33x for good (complete baselines no longer
    learn), which link probes and the replacement estimate read as a real slowdown; after the shrink it is
    measured against the new world."""
    from trainguard.recovery.failslow import FailSlowSupervisor
    from trainguard.recovery.straggler import Timing

    sup = FailSlowSupervisor(StragglerConfig(window_s=1.0, min_steps=1))
    t = 0.0

    def windows(gen: int, ranks: int, step_s: float, n: int) -> float:
        nonlocal t
        last = 1.0
        for _ in range(n):
            t += 1.0
            res = sup.detector.observe(gen, [Timing(r, f"n{r}", 1, step_s, 0.1, step_s - 0.1, 1) for r in range(ranks)],
                                       t)
            if res is not None:
                last = res.job_slowdown
        return last

    sup.new_world(4)
    assert windows(1, 4, 1.0, 12) == pytest.approx(1.0)
    sup.new_world(3)
    assert windows(2, 3, 4 / 3, 12) == pytest.approx(1.0)
    sup.new_world(3)  # a restart at the same size keeps them: a real slowdown still reads as one
    assert windows(3, 3, 2.0, 3) == pytest.approx(1.5)
