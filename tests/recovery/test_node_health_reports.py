"""Node daemons' health reports at a real `trainguard coordinator` process over gRPC: a FATAL verdict cordons the
node (before it registers, or while it holds a slot), through the cordon hooks, with the daemon's reason; a
silent daemon cordons nothing; bad reports are refused precisely."""

from __future__ import annotations

import sys
import time

import grpc
import pytest

from coordinator_client import CoordinatorProcess, beat_until, node_info
from trainguard.proto import coordinator_pb2 as pb
from trainguard.recovery import convert
from trainguard.recovery.node_health import NodeHealthReport, NodeHealthTable, Verdict

pytestmark = pytest.mark.timeout(90)


def _report(stub, node: str, verdict: int, reason: str = "", job: str = "",
            instance: str = "d1") -> pb.NodeHealthReportResponse:
    return stub.ReportNodeHealth(pb.NodeHealthReportRequest(job=job, node_id=node, host=f"host-{node}",
                                                            verdict=verdict, reason=reason, risk=0.1,
                                                            agent_instance=instance), timeout=10)


@pytest.fixture
def coordinator(tmp_path, tg_env):
    hook_out = tmp_path / "cordoned.txt"
    # The cordon hook appends "<host> <reason>" per cordoned node (a Slurm `scontrol` stand-in).
    hook = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))\" " \
           f"{hook_out} {{host}} {{reason}}"
    c = CoordinatorProcess(tmp_path, tg_env, "nh-job", "--nnodes", "2", "--heartbeat-interval", "0.1",
                           "--lease-timeout", "30", "--backoff", "0", "--cordon-command", hook)
    try:
        yield c, hook_out
    finally:
        c.stop()


def _wait_file(path, needle: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} never appeared in {path}: {path.read_text() if path.exists() else '-'}")


def test_fatal_report_before_registration_keeps_the_node_out_of_every_generation(coordinator) -> None:
    c, hook_out = coordinator
    # Reported healthy first, then fatal: cordoned (the hook runs with the daemon's own reason).
    assert not _report(c.stub, "sick", pb.NODE_HEALTH_VERDICT_HEALTHY).cordoned
    resp = _report(c.stub, "sick", pb.NODE_HEALTH_VERDICT_FATAL, "pcie: AER fatal error on 0000:3b:00.0")
    assert resp.cordoned and "AER fatal" in resp.message and resp.interval_s > 0
    text = _wait_file(hook_out, "host-sick")
    assert "AER fatal error on 0000:3b:00.0" in text
    # A later HEALTHY report does not un-cordon it; a silent daemon ("quiet") is never cordoned.
    assert _report(c.stub, "sick", pb.NODE_HEALTH_VERDICT_HEALTHY).cordoned
    assert not _report(c.stub, "quiet", pb.NODE_HEALTH_VERDICT_HEALTHY).cordoned
    sick = c.agent(node_info("sick", idx=0))
    a = c.agent(node_info("a", idx=1))
    b = c.agent(node_info("b", idx=2))
    beat_until([sick, a, b], lambda: a.gen > 0 and b.gen > 0)
    assert sick.gen < 0 and "cordoned" in sick.last.message
    assert sorted(n.node_id for n in a.table.nodes) == ["a", "b"]
    # "quiet" went silent long ago: still not cordoned, and the hook never ran for it.
    assert not _report(c.stub, "quiet", pb.NODE_HEALTH_VERDICT_DEGRADED, "predictor alarm").cordoned
    assert "quiet" not in hook_out.read_text()


def test_fatal_report_about_a_slot_holder_moves_its_slot_to_a_spare(coordinator) -> None:
    c, _ = coordinator
    a = c.agent(node_info("a", idx=0))
    b = c.agent(node_info("b", idx=1))
    spare = c.agent(node_info("s", idx=2, spare=True))
    beat_until([a, b, spare], lambda: a.gen == 1 and b.gen == 1)
    resp = _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_FATAL, "nvidia: GPU 0000:17:00.0 fell off the bus")
    assert resp.cordoned
    beat_until([a, b, spare], lambda: a.gen == 2 and spare.gen == 2)
    assert sorted(n.node_id for n in a.table.nodes) == ["a", "s"] and b.gen < 0
    # Repeated FATAL reports (every interval) are not new failures: no third generation.
    for _ in range(3):
        assert _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_FATAL, "still broken").cordoned
    a.beat()
    assert a.gen == 2 and a.last.rank_table.restart_count <= 1


def test_a_replaced_node_whose_restarted_daemon_reports_it_healthy_serves_again(coordinator) -> None:
    # b's daemon reports a fatal fault: b is cordoned, the spare takes its slot. The machine is repaired and its
    # daemon restarted: the new daemon's healthy report returns b to service, so when the spare fails in turn
    # b fills the vacancy (it stayed cordoned for good, and the job waited for a spare nobody had).
    c, hook_out = coordinator
    a = c.agent(node_info("a", idx=0))
    b = c.agent(node_info("b", idx=1))
    s = c.agent(node_info("s", idx=2, spare=True))
    beat_until([a, b, s], lambda: a.gen == 1 and b.gen == 1)
    assert _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_FATAL, "nvidia: GPU 0000:17:00.0 fell off the bus").cordoned
    beat_until([a, b, s], lambda: a.gen == 2 and s.gen == 2)
    # The daemon that saw the fault, still running, says healthy: a latched or intermittent fault, not a repair.
    assert _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_HEALTHY).cordoned
    b.beat()
    assert b.gen < 0 and "cordoned" in b.last.message
    # The restarted daemon's first report may predate its detectors' first sample: the second one vouches.
    assert _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_HEALTHY, instance="d2").cordoned
    resp = _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_HEALTHY, instance="d2")
    assert not resp.cordoned and "back in service" in resp.message, resp.message
    time.sleep(0.6)  # lets the coordinator's watch (a sample every 0.25 s) see b back, as it would in service
    # The spare's own daemon now reports a fatal fault: b takes the slot back.
    assert _report(c.stub, "s", pb.NODE_HEALTH_VERDICT_FATAL, "pcie: AER fatal error", instance="ds").cordoned
    beat_until([a, b, s], lambda: a.gen == 3 and b.gen == 3)
    assert sorted(n.node_id for n in a.table.nodes) == ["a", "b"] and s.gen < 0
    # Back in service means exposed again: a new fatal verdict from the new daemon cordons b once more, its slot
    # goes to a new spare, and the scheduler hook runs again for it.
    s2 = c.agent(node_info("s2", idx=3, spare=True))
    assert _report(c.stub, "b", pb.NODE_HEALTH_VERDICT_FATAL, "nvidia: GPU gone again", instance="d2").cordoned
    beat_until([a, b, s2], lambda: a.gen == 4 and s2.gen == 4)
    assert "GPU gone again" in _wait_file(hook_out, "GPU gone again")


@pytest.mark.parametrize("req, needle", [
    (pb.NodeHealthReportRequest(node_id="", verdict=pb.NODE_HEALTH_VERDICT_FATAL), "node_id"),
    (pb.NodeHealthReportRequest(node_id="n1", verdict=pb.NODE_HEALTH_VERDICT_UNSPECIFIED), "verdict"),
    (pb.NodeHealthReportRequest(node_id="n1", verdict=pb.NODE_HEALTH_VERDICT_HEALTHY, risk=3.0), "risk"),
    (pb.NodeHealthReportRequest(node_id="n1", verdict=pb.NODE_HEALTH_VERDICT_HEALTHY, job="other"), "unknown job"),
])
def test_bad_reports_are_refused_naming_the_field(coordinator, req, needle) -> None:
    c, _ = coordinator
    with pytest.raises(grpc.RpcError) as err:
        c.stub.ReportNodeHealth(req, timeout=10)
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert needle in err.value.details()


def test_table_keeps_the_first_fatal_reason_and_shows_silence() -> None:
    t = NodeHealthTable()
    assert not t.record(NodeHealthReport("", "n", "h", Verdict.HEALTHY), 0.0)
    assert t.record(NodeHealthReport("", "n", "h", Verdict.FATAL, "aer"), 1.0)
    assert not t.record(NodeHealthReport("", "n", "h", Verdict.FATAL, "later"), 2.0)
    t.record(NodeHealthReport("", "m", "h", Verdict.HEALTHY), 2.0)
    assert t.fatal() == {"n": "aer"}
    assert t.silent(now_s=10.0, after_s=5.0) == ["m", "n"] and t.silent(now_s=3.0, after_s=5.0) == []


def test_metrics_count_daemons_by_verdict_and_silence(tmp_path) -> None:
    from prometheus_client import generate_latest

    from trainguard.proto import coordinator_pb2_grpc
    from trainguard.recovery.observe import CoordinatorMetrics
    from trainguard.recovery.service import CoordinatorServer, JobSpec

    srv = CoordinatorServer(JobSpec(job="nh-metrics", nnodes=2, heartbeat_interval_s=0.1,
                                    store=f"sqlite://{tmp_path}/c.db")).start()
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            _report(stub, "ok", pb.NODE_HEALTH_VERDICT_HEALTHY)
            _report(stub, "bad", pb.NODE_HEALTH_VERDICT_FATAL, "edac: uncorrectable ECC error")
            text = generate_latest(CoordinatorMetrics(srv.watch).registry).decode()
            assert 'trainguard_node_daemons{verdict="healthy"} 1.0' in text
            assert 'trainguard_node_daemons{verdict="fatal"} 1.0' in text
            assert 'trainguard_node_daemons{verdict="silent"} 0.0' in text
            time.sleep(0.5)  # > 3 report intervals of 0.1 s without a report
            _report(stub, "ok", pb.NODE_HEALTH_VERDICT_HEALTHY)
            text = generate_latest(CoordinatorMetrics(srv.watch).registry).decode()
            assert 'trainguard_node_daemons{verdict="silent"} 1.0' in text  # "bad" went silent
            assert srv.core.silent_daemons() == ["bad"] and "ok" not in srv.core.state.cordoned
    finally:
        srv.stop(0)


def test_the_daemon_that_saw_a_cordon_still_cannot_lift_it_after_a_coordinator_restart(tmp_path) -> None:
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.spec import JobSpec

    spec = JobSpec(job="nh-restart", nnodes=2, store=f"sqlite://{tmp_path}/c.db")

    def report(core: JobCoordinator, verdict: Verdict, instance: str) -> bool:
        cordoned, _, fut = core.report_node_health(NodeHealthReport("", "sick", "h", verdict, "AER fatal",
                                                                    instance=instance))
        core.wait_durable(fut)
        return cordoned

    core = JobCoordinator(spec)
    # Registered: a node that never did is kept out in memory only (see daemon_reports), not in the store.
    core.wait_durable(core.register("nh-restart", convert.node_record(node_info("sick")), 40000)[2])
    assert report(core, Verdict.FATAL, "d1")
    core.close()
    core = JobCoordinator(spec)  # its health table starts empty; the cordon and who saw it are in the store
    try:
        assert report(core, Verdict.HEALTHY, "d1") and report(core, Verdict.HEALTHY, "d1")
        assert "sick" in core.state.cordoned
        assert report(core, Verdict.HEALTHY, "d2")  # its first report: the detectors may not have sampled yet
        assert not report(core, Verdict.HEALTHY, "d2") and "sick" not in core.state.cordoned
    finally:
        core.close()


def test_a_cordon_held_before_registration_survives_a_coordinator_restart(tmp_path) -> None:
    """A fatal report about a node that had not registered was held in memory only: a coordinator restarted over
    the same store forgot it, and the node registered and took a slot of the first generation."""
    from coordinator_client import Agent
    from trainguard.proto import coordinator_pb2_grpc
    from trainguard.recovery import CoordinatorServer, JobSpec

    spec = JobSpec(job="nh-held", nnodes=2, heartbeat_interval_s=0.05, lease_timeout_s=30,
                   store=f"sqlite://{tmp_path}/h.db")
    held_key = "trainguard/jobs/nh-held/held/sick"
    srv = CoordinatorServer(spec).start()
    try:
        with grpc.insecure_channel(srv.target) as chan:
            stub = coordinator_pb2_grpc.CoordinatorStub(chan)
            assert _report(stub, "sick", pb.NODE_HEALTH_VERDICT_FATAL, "pcie: AER fatal", job="nh-held").cordoned
    finally:
        srv.stop(0)
    srv = CoordinatorServer(spec).start()  # a restart over the same store: every table in memory starts empty
    try:
        assert srv.core.held_cordons() == ["sick"]
        with grpc.insecure_channel(srv.target) as chan:
            stub = coordinator_pb2_grpc.CoordinatorStub(chan)
            sick = Agent(stub, "nh-held", node_info("sick", idx=0))
            a, b = Agent(stub, "nh-held", node_info("a", idx=1)), Agent(stub, "nh-held", node_info("b", idx=2))
            beat_until([sick, a, b], lambda: a.gen == 1 and b.gen == 1, period=0.02)
            assert sick.gen < 0 and sorted(n.node_id for n in a.table.nodes) == ["a", "b"]
            assert "sick" in srv.core.state.cordoned and "AER fatal" in srv.core.state.cordon_why["sick"]
            assert srv.core._raw_store.get(held_key) is None  # applied to the job state: its record went
            # The daemon that latched the fault keeps it latched across the restart: its healthy reports change
            # nothing; a restarted daemon's second healthy report returns the node (as without a restart).
            assert _report(stub, "sick", pb.NODE_HEALTH_VERDICT_HEALTHY, job="nh-held").cordoned
            assert _report(stub, "sick", pb.NODE_HEALTH_VERDICT_HEALTHY, job="nh-held").cordoned
    finally:
        srv.stop(0)


def test_a_held_cordon_of_a_node_registered_just_before_a_restart_is_applied_at_the_start(tmp_path) -> None:
    """A coordinator stopped between storing a node's record and the cordon its registration applied: the agent's
    retried registration keeps its lease (no registration again), so the cordon is applied when the store is read."""
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.job_records import held_value
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import Put, open_store

    spec = JobSpec(job="nh-held2", nnodes=2, store=f"sqlite://{tmp_path}/h.db")
    core = JobCoordinator(spec)
    core.wait_durable(core.register("nh-held2", convert.node_record(node_info("sick")), 40000)[2])
    core.close()
    store = open_store(spec.store)  # what that coordinator left: the node's record, its held cordon's record
    store.commit([], [Put("trainguard/jobs/nh-held2/held/sick", held_value("pcie: AER fatal", "d1", "h"))])
    store.close()
    core = JobCoordinator(spec)
    try:
        assert "sick" in core.state.cordoned and core.held_cordons() == []
        core.close()
        core = JobCoordinator(spec)  # stored: a second start keeps it, with no held record left
        assert "sick" in core.state.cordoned and core._raw_store.get("trainguard/jobs/nh-held2/held/sick") is None
    finally:
        core.close()


def test_a_held_record_left_beside_a_stored_cordon_does_not_outlive_an_uncordon(tmp_path) -> None:
    """A coordinator stopped after storing a node's cordon but before deleting its held record: the record stayed,
    and after an operator's uncordon the next coordinator start cordoned the node again."""
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.job_records import held_value
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import Put, open_store

    spec = JobSpec(job="nh-held3", nnodes=2, store=f"sqlite://{tmp_path}/h.db")
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731 - the daemon must look silent to uncordon: time is moved, not waited for
    core = JobCoordinator(spec, clock=clock)
    core.wait_durable(core.register("nh-held3", convert.node_record(node_info("sick")), 40000)[2])
    core.wait_durable(core.report_node_health(NodeHealthReport("", "sick", "h", Verdict.FATAL, "AER fatal",
                                                               instance="d1"))[2])
    assert "sick" in core.state.cordoned
    core.close()
    store = open_store(spec.store)
    store.commit([], [Put("trainguard/jobs/nh-held3/held/sick", held_value("AER fatal", "d1", "h"))])
    store.close()
    core = JobCoordinator(spec, clock=clock)
    try:
        assert "sick" in core.state.cordoned
        now[0] += 60.0  # its daemon went quiet: an operator may uncordon it
        ok, message, fut = core.uncordon("nh-held3", "sick", "repaired")
        assert ok, message
        core.wait_durable(fut)
        core.close()
        core = JobCoordinator(spec, clock=clock)
        assert "sick" not in core.state.cordoned and core.held_cordons() == []
    finally:
        core.close()
