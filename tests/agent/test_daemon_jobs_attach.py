"""AttachJob for a job that live launchers of the node attached already: it may not name another coordinator,
token or TLS files. Accepted, a caller of the daemon's socket replaced the job's reporter, and the job's real
coordinator stopped hearing of this node's health while ``trainguard status`` said "coordinator ok" (found by a
fuzzing review, reproduced against a real daemon)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import grpc
import pytest

from agentd_unit import inproc_daemon
from trainguard.agent.arena_keeper import ArenaKeeper
from trainguard.agent.coordinator_report import NodeVerdict
from trainguard.agent.daemon_jobs import DaemonJobs, JobHeldElsewhere
from trainguard.proto import agent_pb2, agent_pb2_grpc

TOKEN = "t" * 32


def _jobs(tmp_path: Path, alive: set[int]) -> DaemonJobs:
    keeper = ArenaKeeper(str(tmp_path / f"shm-{uuid.uuid4().hex[:8]}"), ttl_s=0.0, alive=lambda key: True)
    return DaemonJobs("n", "h", "i", lambda: NodeVerdict(), keeper, 1.0, 1.0, alive=lambda key: key in alive)


def _req(pid: int, coordinator: str, token: str = TOKEN) -> agent_pb2.AttachJobRequest:
    return agent_pb2.AttachJobRequest(job="j", coordinator=coordinator, launcher_pid=pid, token=token)


def _address(jobs: DaemonJobs) -> str:
    return jobs._reporters["job:j"].target.address


def test_another_coordinator_for_a_job_held_by_a_live_launcher_is_refused(tmp_path: Path) -> None:
    alive = {101, 102}
    jobs = _jobs(tmp_path, alive)
    try:
        jobs.attach(_req(101, "127.0.0.1:7001"))
        with pytest.raises(JobHeldElsewhere, match=r"job j is attached on this node by 1 live launcher\(s\) "
                                                   r"reporting to coordinator 127.0.0.1:7001; this attachment "
                                                   r"names coordinator 127.0.0.1:1\."):
            jobs.attach(_req(102, "127.0.0.1:1"))
        with pytest.raises(JobHeldElsewhere, match=r"this attachment names coordinator 127.0.0.1:7001 \(TLS server name x\)"):
            jobs.attach(agent_pb2.AttachJobRequest(job="j", coordinator="127.0.0.1:7001", launcher_pid=102,
                                                   tls_server_name="x"))
        assert _address(jobs) == "127.0.0.1:7001" and jobs._jobs["j"] == {101}
        # A second launcher of the same job with its own credentials (each pod's certificate, a rotated token)
        # reports to the same coordinator: no conflict.
        jobs.attach(_req(102, "127.0.0.1:7001", token="u" * 32))
        assert jobs._jobs["j"] == {101, 102}
        jobs.attach(_req(101, "127.0.0.1:7001"))  # attaching again (a restarted daemon) changes nothing
        # Once the other launchers are dead, a new launcher of the name may bring its own coordinator.
        alive.clear()
        alive.add(103)
        jobs.attach(_req(103, "127.0.0.1:7003"))
        assert _address(jobs) == "127.0.0.1:7003"
    finally:
        jobs.stop()


def test_an_attach_during_a_leave_keeps_its_reporter_and_does_not_wait(tmp_path: Path) -> None:
    """Review: a leave that found no launcher left released the lock before removing the job's reporter and
    target; an attach in between was left with neither, and then any coordinator was taken for the job. The job's
    state changes at once now, and the slow part (the old reporter's stop, up to a report's deadline) runs
    outside the lock: an attach meanwhile neither waits for it nor loses its own reporter."""
    import threading
    import time

    jobs = _jobs(tmp_path, {101, 102, 666})
    jobs.attach(_req(101, "127.0.0.1:7001"))
    old = jobs._reporters["job:j"]
    took: list[float] = []
    real_stop = old.stop

    def slow_stop(*args, **kwargs):  # the leave's stop of the old reporter: an attach arrives meanwhile
        t0 = time.monotonic()
        attacher = threading.Thread(target=jobs.attach, args=(_req(102, "127.0.0.1:7001"),))
        attacher.start()
        attacher.join(10)
        took.append(time.monotonic() - t0)
        return real_stop(*args, **kwargs)

    old.stop = slow_stop
    try:
        jobs.leave("j", 101, False)
        assert took and took[0] < 5.0  # not behind the leave
        assert jobs._jobs == {"j": {102}} and jobs._targets["j"] == ("127.0.0.1:7001", "")
        assert jobs._reporters["job:j"] is not old and _address(jobs) == "127.0.0.1:7001"
        with pytest.raises(JobHeldElsewhere):
            jobs.attach(_req(666, "evil:1"))
    finally:
        jobs.stop()


def test_a_launcher_waits_a_while_for_another_runs_launchers_of_its_job(tmp_path: Path, caplog) -> None:
    """Review: a job started again under its name while the old run's launchers end (a pod's grace period) was
    refused once and ran without the daemon (its kept memory tier, its detectors) for good."""
    import logging

    from trainguard.agent.health_source import DaemonJobHeld, JobAttachment, _attach_when_free

    class Link:
        calls = 0

        def attach(self, job):
            Link.calls += 1
            if Link.calls < 3:
                raise DaemonJobHeld("node daemon at s did not attach job j: FAILED_PRECONDITION: held")
            return agent_pb2.AttachJobResponse(node_id="n")

    job = JobAttachment("j", "127.0.0.1:1", "n")
    with caplog.at_level(logging.WARNING):
        assert _attach_when_free(Link(), job, wait_s=5.0, period_s=0.05).node_id == "n"
    assert Link.calls == 3 and caplog.text.count("trying again for up to 5 s") == 1
    Link.calls = -100
    with pytest.raises(DaemonJobHeld):
        _attach_when_free(Link(), job, wait_s=0.2, period_s=0.05)


def test_a_detached_job_may_be_attached_to_another_coordinator(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, {101, 102})
    try:
        jobs.attach(_req(101, "127.0.0.1:7001"))
        jobs.detach("j", 101, ended=True)
        jobs.attach(_req(102, "127.0.0.1:7002"))
        assert _address(jobs) == "127.0.0.1:7002"
    finally:
        jobs.stop()


def test_the_daemon_answers_failed_precondition_and_keeps_the_jobs_reporter(tmp_path: Path) -> None:
    with inproc_daemon(tmp_path) as (daemon, stub):
        stub.AttachJob(_req(os.getpid(), "127.0.0.1:7001"), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.AttachJob(_req(1, "127.0.0.1:1"), timeout=10)  # pid 1 lives: another launcher, as the repro
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "reporting to coordinator 127.0.0.1:7001" in refused.value.details()
        assert daemon.jobs._reporters["job:j"].target.address == "127.0.0.1:7001"


def test_a_launchers_socket_says_it_keeps_no_jobs_without_a_traceback(caplog) -> None:
    """AttachJob/DetachJob on a ``trainguard run`` launcher's socket raised the generated servicer's
    NotImplementedError: UNIMPLEMENTED with a traceback in the launcher's log per call (fuzzing review)."""
    from concurrent import futures

    from trainguard.agent.local_server import NodeAgentService

    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService(object()), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            for call, req in ((stub.AttachJob, _req(1, "127.0.0.1:1")),
                              (stub.DetachJob, agent_pb2.DetachJobRequest(job="j", launcher_pid=1))):
                with pytest.raises(grpc.RpcError) as refused:
                    call(req, timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "a trainguard run launcher's, not the node daemon's" in refused.value.details()
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    finally:
        srv.stop(None)
