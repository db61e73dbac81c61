"""The agent's fail-slow relay: per-rank medians between heartbeats, own work = step less wait, a new generation
drops the old window; the coordinator's findings become one event each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tg_testutil import until
from trainguard.agent.rpc_limits import VALIDATORS
from trainguard.agent.step_timing import FailSlowView, TimingRelay, stack_evidence
from trainguard.detectors import stackdump
from trainguard.proto import agent_pb2, common_pb2
from trainguard.recovery.hang_locator import parse_main_stack


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


@pytest.mark.parametrize("method", ["faulthandler", "py-spy"])
def test_a_hang_report_carries_the_main_thread_behind_many_helper_threads(method, tmp_path, monkeypatch):
    """faulthandler lists a worker's threads newest first: the main thread comes last. The report kept the first
    3000 characters of the dump, so behind ten helper threads (heartbeat, pinning, tqdm, wandb...) the stuck rank's
    main thread was cut off and it read as waiting in threading.wait, like the ranks waiting for it."""
    if method == "py-spy" and stackdump.find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    if method == "faulthandler":
        monkeypatch.setattr(stackdump, "find_py_spy", lambda: None)  # as on a node without py-spy
    monkeypatch.setenv(stackdump.STACK_DIR_ENV, str(tmp_path))
    marker = tmp_path / "stuck"
    script = Path(__file__).parent / "scripts" / "threaded_stuck.py"
    proc = subprocess.Popen([sys.executable, str(script), "10", str(tmp_path), str(marker)])
    try:
        assert until(marker.exists, timeout=30), "the worker never got stuck"
        ev = stack_evidence({5: proc.pid}, timeout_s=10.0)
    finally:
        proc.kill()
        proc.wait()
    assert ev["method.5"] == method
    assert parse_main_stack(ev["stack.5"])[0] == "load_batch (threaded_stuck.py)", ev["stack.5"]
    assert len(ev["stack.5"]) <= 3000


def test_a_hang_localised_elsewhere_is_put_on_the_silent_ranks_record_and_in_the_summary():
    # Found by a review: rank 1 SIGSTOPped, rank 0 (waiting in all_reduce) found silent first; the locator named
    # rank 1, yet the run's summary said only "rank 0 ended with ... no step heartbeat".
    from trainguard.agent.fault_records import FaultRecord
    from trainguard.agent.run import RunResult, format_summary, summary_record
    from trainguard.agent.step_timing import hang_location
    from trainguard.agent.supervisor import LocalSupervisor

    v = FailSlowView("n0")
    st = common_pb2.FailSlowStatus(job_step_s=0.2)
    st.hang.CopyFrom(common_pb2.HangFinding(generation=1, outlier_ranks=[1], outlier_nodes=["n0"], ranks_seen=2,
                                            groups=2, outlier_frame="<no stack>", time=1001.0))
    (ev,) = v.update(st)
    where = hang_location(ev)
    assert where == (1, [1], "rank(s) 1 on n0 in <no stack>")
    silent = FaultRecord(1, 0, "worker rank 0 (pid 7) sent no step heartbeat for 60.2 s after step 9", None, 5.0)
    other_gen = FaultRecord(2, 0, "worker rank 0 (pid 8) sent no step heartbeat for 60.1 s after step 3", None, 9.0)
    sup = LocalSupervisor.__new__(LocalSupervisor)  # note_hang reads only the records
    sup.fault_records = [silent, other_gen]
    sup.note_hang(*where)
    assert silent.hang == "rank(s) 1 on n0 in <no stack>" and other_gen.hang is None
    result = RunResult(exit_code=0, wall_s=70.0, generations=2, faults=[silent], message="")
    # the stuck rank leads (rank 0 was only found silent first, waiting for it)
    assert ("fault 1: generation 1, a hang localised to rank(s) 1 on n0 in <no stack>, found when worker rank 0 "
            "(pid 7) sent no step heartbeat for 60.2 s after step 9") in format_summary(result)
    assert summary_record(result)["faults"][0]["hang_localised"] == "rank(s) 1 on n0 in <no stack>"
    # the stuck rank's own record is left as it is
    stuck = FaultRecord(1, 1, "worker rank 1 (pid 9) sent no step heartbeat for 60.2 s", None, 5.0)
    sup.fault_records = [stuck]
    sup.note_hang(*where)
    assert stuck.hang is None
