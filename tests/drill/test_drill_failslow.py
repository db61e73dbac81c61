"""Fail-slow drills on one machine, real injection: a worker capped by a cgroup v1 CPU quota is found and shown
in `trainguard status`, the events and /metrics; a node whose data link is capped by tbf (3 nodes in network
namespaces) is named by pairwise link probes; a rank hung in its data loader is named by grouping every rank's
stack."""

from __future__ import annotations

import pytest

from trainguard.detectors.stackdump import find_py_spy
from trainguard.drill.failslow import HangDrillConfig, StragglerDrillConfig, run_hang_drill, run_straggler_drill
from trainguard.drill.netns import netns_unavailable_reason
from trainguard.drill.slowdown import CpuThrottle, cpu_throttle_unavailable_reason

CGROUP_WHY = cpu_throttle_unavailable_reason()
NETNS_WHY = netns_unavailable_reason()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(CGROUP_WHY is not None, reason=str(CGROUP_WHY))
def test_cpu_throttled_worker_is_detected_and_reported(tmp_path):
    res = run_straggler_drill(StragglerDrillConfig(nproc=2, throttle_rank=1, throttle_fraction=0.1, healthy_s=8,
                                                   after_s=1, workdir=str(tmp_path)), progress=lambda _: None)
    assert res.status_polls_healthy >= 4
    assert res.false_alarms == 0, "a healthy run flagged a straggler"
    assert res.detected, res.status_text
    assert [int(s["rank"]) for s in res.slow_listed] == [1]
    assert res.slow_listed[0]["ratio"] >= 1.3 and res.slow_listed[0]["excess_s"] > 0
    # The baseline without mitigation: the whole job runs at the straggler's pace.
    assert res.step_slow_s > res.step_healthy_s
    assert "SLOW RANK" in res.status_text and "action: report" in res.status_text
    assert any(e["kind"] == "failslow.straggler" and e["subject"] == "rank:1" for e in res.events)
    # The run's /metrics carries the same finding (scraped when it was detected).
    assert res.metrics["trainguard_failslow_slow_ranks{scope=job}"] == 1, res.metrics
    assert res.metrics["trainguard_failslow_slow_ranks{scope=node}"] == 1
    assert res.metrics["trainguard_failslow_worst_ratio{scope=job}"] >= 1.3


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_hung_rank_is_localised_by_its_stack(tmp_path):
    res = run_hang_drill(HangDrillConfig(nproc=3, hang_rank=2, rounds=1, workdir=str(tmp_path)),
                         progress=lambda _: None)
    assert len(res.findings) == 1, res.status_text
    f = res.findings[0]
    assert [int(r) for r in f["outlier_ranks"]] == [2]
    assert f["outlier_frame"].startswith("stuck_in_data_loader")
    assert "all_reduce" in f["majority_frame"]
    assert res.accuracy == 1.0
    assert "last hang (generation 1): outlier rank(s) 2" in res.status_text
    assert any(e["kind"] == "failslow.hang_localised" for e in res.events)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(NETNS_WHY is not None, reason=str(NETNS_WHY))
def test_a_node_slowed_on_its_link_is_named_by_pairwise_link_probes(tmp_path):
    # Three nodes in their own network namespaces; n1's data link is capped by a real tbf qdisc. Every rank's own
    # work stays flat (the ring waits on the slow hop alike), so only the link probe can name n1.
    res = run_straggler_drill(StragglerDrillConfig(nodes=3, nproc=1, netns=True, link_rate="40mbit", throttle_rank=1,
                                                   healthy_s=6, after_s=1, detect_timeout_s=120,
                                                   workdir=str(tmp_path)), progress=lambda _: None)
    assert res.false_alarms == 0 and res.status_polls_healthy >= 6, "a healthy run named a node"
    assert res.detected and res.named_node == "n1", (res.link_probe, res.status_text)
    assert "node n1: slow in all 2 of its probed link pair(s)" in res.link_probe
    link = [s for s in res.slow_listed if s.get("basis") == "link"]
    assert link and int(link[0]["rank"]) == -1 and link[0]["ratio"] >= 4
    assert res.step_slow_s > 2 * res.step_healthy_s  # the no-detection baseline: the job at the slow link's pace
    assert "(node)" in res.status_text and "link" in res.status_text
    assert any(e["kind"] == "failslow.slow_link" and e["subject"] == "node:n1" for e in res.events)


@pytest.mark.skipif(CGROUP_WHY is not None, reason=str(CGROUP_WHY))
def test_cpu_throttle_caps_a_busy_process_and_cleans_up(tmp_path):
    import os
    import subprocess
    import sys
    import time

    import psutil

    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with CpuThrottle(0.05) as t:
            t.add([p.pid])
            assert t.path.split("/")[-1] in open(f"/proc/{p.pid}/cgroup").read()
            proc = psutil.Process(p.pid)
            c0 = sum(proc.cpu_times()[:2])
            time.sleep(1.5)
            used = (sum(proc.cpu_times()[:2]) - c0) / 1.5
            path = t.path
        assert used < 0.15, f"throttled to 0.05 CPU but used {used:.2f}"
        assert not os.path.exists(path)
        assert "tg-slow" not in open(f"/proc/{p.pid}/cgroup").read()
    finally:
        p.kill()
        p.wait()


def test_a_status_poll_nobody_answered_is_not_a_healthy_poll(tmp_path):
    # The healthy phase counted every poll, answered or not: with the agents' status unreachable a drill reported
    # "0 false alarms in N status polls" (and passed `status_polls_healthy >= 4`) although nothing was watched.
    import socket

    from trainguard.drill.failslow import StragglerDrillResult, _Job, poll_healthy

    job = _Job.__new__(_Job)  # the real status() path, without starting a job
    job.events = tmp_path / "events"
    job.events.mkdir()
    (job.events / "agent-n1.sock").write_text(str(tmp_path / "gone.sock"))  # an agent that has exited
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "gone.sock"))
    dead.close()
    res = StragglerDrillResult(config={})
    poll_healthy(job, ["n0", "n1"], res)  # n0 never wrote its socket file; n1's socket refuses
    assert (res.status_polls_healthy, res.status_polls_unanswered, res.false_alarms) == (0, 2, 0)
