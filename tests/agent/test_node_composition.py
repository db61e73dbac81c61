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
