"""The agent's fail-slow relay: per-rank medians between heartbeats, own work = step less wait, a new generation
drops the old window; the coordinator's findings become one event each."""

from __future__ import annotations

from trainguard.agent.rpc_limits import VALIDATORS
from trainguard.agent.step_timing import FailSlowView, TimingRelay
from trainguard.proto import agent_pb2, common_pb2


def test_medians_per_rank_and_own_work():
    r = TimingRelay()
    for i, (step_s, comm) in enumerate([(0.2, 0.1), (0.3, 0.1), (5.0, 0.1), (0.25, 0.05)]):
        r.record(1, 0, i, step_s, {"forward": 0.05, "comm": comm})
    r.record(1, 1, 0, 0.2, {})  # no sections: own work unknown
    r.record(1, 1, 1, 0.0, {})  # the first step after a start has no time: skipped
    out = {t.rank: t for t in r.drain()}
    assert out[0].steps == 4 and out[0].step == 3
    assert abs(out[0].step_s - 0.275) < 1e-9          # the 5 s outlier weighs like any one step
    assert abs(out[0].wait_s - 0.1) < 1e-9
    assert abs(out[0].compute_s - 0.2) < 1e-9           # median of 0.1, 0.2, 4.9, 0.2
    assert out[1].compute_s == -1 and out[1].wait_s == -1 and out[1].steps == 1
    assert r.drain() == []
    r.record(1, 0, 10, 0.2, {"comm": 0.1})
    r.record(2, 0, 0, 0.4, {"comm": 0.1})              # a restart: generation 1's window is dropped
    (t,) = r.drain()
    assert t.step_s == 0.4 and t.steps == 1


def test_each_finding_is_one_event():
    v = FailSlowView("n0")
    st = common_pb2.FailSlowStatus(job_step_s=0.2, action="report")
    st.slow.add(rank=3, node_id="n1", ratio=2.5, excess_s=0.1, since=1000.0, basis="wait", individual=2.0)
    (ev,) = v.update(st)
    assert ev.kind == "failslow.straggler" and ev.subject == "rank:3" and "2.50x" in ev.message
    assert v.update(st) == []                           # the same finding again: no new event
    st.hang.CopyFrom(common_pb2.HangFinding(generation=2, outlier_ranks=[1], outlier_nodes=["n1"], ranks_seen=4,
                                            groups=2, outlier_frame="load_batch (data.py)", time=1001.0))
    (ev,) = v.update(st)
    assert ev.kind == "failslow.hang_localised" and "rank(s) 1" in ev.message
    assert v.status.hang.generation == 2


def test_worker_heartbeat_sections_are_range_checked():
    check = next(f for k, f in VALIDATORS.items() if k.endswith("/WorkerHeartbeat"))
    ok = agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1, step=0, section_s={"comm": 0.1})
    assert check(ok) is None
    bad = agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1, step=0, section_s={"comm": -1.0})
    assert "section_s['comm']" in check(bad)
    many = agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1, step=0, section_s={f"s{i}": 0.1 for i in range(17)})
    assert "at most 16" in check(many)
