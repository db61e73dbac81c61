"""NodeAgent as the composition of the three parts, against a real coordinator with real workers: the parts'
states follow the job (a kill -9 restarts a generation, the budget ends it), and the drill hook stays outside."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from trainguard.agent.errors import JobFailedError
from trainguard.agent.node import NodeAgent, NodeConfig
from trainguard.agent.parts import LinkState, SupervisorState
from trainguard.recovery import CoordinatorServer, JobSpec


def _wait(cond, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def coordinator():
    srv = CoordinatorServer(JobSpec(job="comp", nnodes=1, max_restarts=1, heartbeat_interval_s=0.1,
                                    hold_unhealthy=False), listen="127.0.0.1:0").start()
    yield srv
    srv.stop()


def _agent(tmp_path: Path, target: str, argv: list[str]) -> NodeAgent:
    return NodeAgent(NodeConfig(job="comp", coordinator=target, argv=argv, node_id="n1", standby=False,
                                host_store=False, detectors=(), error_dir=str(tmp_path / "errors"),
                                coordinator_patience_s=10.0, stop_grace_s=2.0))


@pytest.mark.timeout(90)
def test_kills_restart_then_exhaust_the_budget(tmp_path: Path, coordinator) -> None:
    agent = _agent(tmp_path, coordinator.target, [sys.executable, "-c", "import time; time.sleep(60)"])
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["code"] = agent.run()
        except JobFailedError as exc:
            outcome["failed"] = str(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        _wait(lambda: agent.supervisor.state == SupervisorState.RUNNING, what="generation 1")
        assert agent.link.state == LinkState.RUNNING and agent.link.generation == agent.generation == 1
        os.kill(agent.group.by_rank(0).pid, signal.SIGKILL)
        _wait(lambda: agent.generation == 2 and agent.supervisor.state == SupervisorState.RUNNING,
              what="generation 2")
        assert agent.link.generation == 2
        assert [(r.generation, r.cause) for r in agent.fault_records] == [(1, "signal SIGKILL (9)")]
        os.kill(agent.group.by_rank(0).pid, signal.SIGKILL)  # the budget (1 restart) is spent: the job fails
        t.join(30)
        assert not t.is_alive()
    finally:
        agent.request_stop()
        t.join(30)
    assert "restart budget exhausted" in outcome.get("failed", ""), outcome
    assert agent.supervisor.state == SupervisorState.FAILED and agent.link.state == LinkState.DONE
    assert agent.group is None and len(agent.fault_records) == 2


@pytest.mark.timeout(60)
def test_job_success_leaves_the_supervisor_succeeded(tmp_path: Path, coordinator) -> None:
    agent = _agent(tmp_path, coordinator.target, [sys.executable, "-c", "pass"])
    assert agent.run() == 0
    assert agent.supervisor.state == SupervisorState.SUCCEEDED and agent.link.state == LinkState.DONE
    assert agent.fault_records == [] and agent.supervisor.hooks == []


@pytest.mark.timeout(90)
def test_a_stopped_workers_stack_dump_keeps_the_lease(tmp_path: Path) -> None:
    """A hang localisation asks every node for its workers' stacks. A worker that cannot answer (SIGSTOPped, or in
    the D state of a stuck driver call) held the agent's loop for the 5 s dump limit, longer than the lease: the
    cluster drill's hang became a lost node and a replacement instead of a process restart. The lease is kept
    alive while the stacks are dumped."""
    from trainguard.detectors.events import Action, HealthEvent, Severity
    from trainguard.proto import coordinator_pb2

    srv = CoordinatorServer(JobSpec(job="comp", nnodes=1, max_restarts=3, heartbeat_interval_s=0.1,
                                    lease_timeout_s=2.0, hold_unhealthy=False), listen="127.0.0.1:0").start()
    worker = ("from trainguard.detectors.stackdump import install_stack_dump_handler\n"
              "install_stack_dump_handler()\nimport time\ntime.sleep(60)\n")
    agent = _agent(tmp_path, srv.target, [sys.executable, "-c", worker])
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        _wait(lambda: agent.supervisor.state == SupervisorState.RUNNING, what="generation 1")
        pid = agent.group.by_rank(0).pid
        time.sleep(1.0)  # the handler is installed (an interpreter start); a dump before it returns at once
        os.kill(pid, signal.SIGSTOP)
        hang = HealthEvent(source="process", kind="process.hung", severity=Severity.ERROR,
                           action=Action.RESTART_PROCESS, subject="rank:0", node_id="n1",
                           message="worker rank 0 sent no step heartbeat for 20 s")
        agent.link.report(hang, coordinator_pb2.RECOVERY_LEVEL_PROCESS, 1, rank=0)
        _wait(lambda: agent.generation == 2 and agent.supervisor.state == SupervisorState.RUNNING, 60.0,
              "generation 2")
        st = srv.core.state
        assert st.restart_count == 1 and "node lost" not in st.message, st.message
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
        agent.request_stop()
        t.join(30)
        srv.stop()


@pytest.mark.timeout(90)
def test_success_is_reported_when_the_workers_end_not_an_interval_later(tmp_path: Path) -> None:
    # A coordinator stretches the heartbeat interval with the node count (nodes / max_heartbeat_rate): a node
    # whose workers had all succeeded said so only at its next heartbeat, so every launcher exited up to an
    # interval (then, told of the end, another) after the job was done.
    srv = CoordinatorServer(JobSpec(job="comp", nnodes=1, max_restarts=1, heartbeat_interval_s=60.0,
                                    lease_timeout_s=600.0, hold_unhealthy=False), listen="127.0.0.1:0").start()
    agent = _agent(tmp_path, srv.target, [sys.executable, "-c", "pass"])
    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.update(code=agent.run()))
    t.start()
    try:
        _wait(lambda: agent.supervisor.state == SupervisorState.SUCCEEDED, what="the workers' success")
        t.join(15)  # far below the 60 s interval
        assert not t.is_alive(), "the node waited for its next heartbeat to report the job's success"
        assert outcome == {"code": 0} and agent.link.state == LinkState.DONE
    finally:
        agent.request_stop()
        t.join(30)
        srv.stop()
