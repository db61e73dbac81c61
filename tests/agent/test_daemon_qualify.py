"""The daemon qualifies its node ([qualify] in_daemon): a narrowed link, found at start or by a re-check, is a
FATAL verdict with the qualification's reason, and a real coordinator the daemon reports to cordons the node."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.sdnotify import SystemdNotifier
from trainguard.recovery import CoordinatorServer, JobSpec
from trainguard.recovery.node_health import Verdict
from trainguard.testing.sysfs import FakeNodeHardware


@pytest.fixture
def coordinator():
    srv = CoordinatorServer(JobSpec(job="dq", nnodes=1, heartbeat_interval_s=0.1), listen="127.0.0.1:0").start()
    yield srv
    srv.stop()


def _daemon(tmp_path: Path, coordinator_target: str, recheck_s: float) -> AgentDaemon:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[metrics]\nlisten = ""\n[grpc]\nlisten = ""\n[detectors]\nenabled = ["host"]\nroot = "{tmp_path}"\n'
        f'[predictor]\nenabled = false\n[agent]\nnode_id = "dq1"\nloop_interval_s = 0.05\n'
        f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n'
        f'[coordinator]\naddress = "{coordinator_target}"\nheartbeat_interval_s = 0.2\n'
        f'[qualify]\nin_daemon = true\nchecks = ["pcie"]\nrecheck_s = {recheck_s}\n')
    return AgentDaemon(config_loader(str(config), None, str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                       SystemdNotifier(None))


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_node_narrowed_at_start_is_fatal_and_cordoned_with_the_reason(tmp_path: Path, coordinator) -> None:
    FakeNodeHardware(tmp_path).narrow_link(4)
    daemon = _daemon(tmp_path, coordinator.target, recheck_s=0)
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        verdict = daemon.node_verdict()
        assert verdict.verdict is Verdict.FATAL and "x4, below its x16" in verdict.reason, verdict
        assert verdict.reason.startswith("qualify.failed: failed qualification: pcie:")
        _wait(lambda: "x4, below its x16" in coordinator.core.cordon_reason("dq1"), 20, "the cordon")
    finally:
        daemon.request_stop()
        loop.join(20)


def test_a_recheck_finds_a_link_that_narrowed_and_the_node_is_cordoned(tmp_path: Path, coordinator) -> None:
    hw = FakeNodeHardware(tmp_path)
    daemon = _daemon(tmp_path, coordinator.target, recheck_s=0.2)
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        assert daemon.node_verdict().verdict is Verdict.HEALTHY  # qualified at start
        assert any(e.kind == "qualify.passed" for e in daemon.node.bus.recent(20))
        time.sleep(0.5)  # reported healthy meanwhile
        assert coordinator.core.cordon_reason("dq1") == ""
        hw.narrow_link(2)
        _wait(lambda: "x2, below its x16" in coordinator.core.cordon_reason("dq1"), 20, "the re-check's cordon")
        assert daemon.node_verdict().verdict is Verdict.FATAL
    finally:
        daemon.request_stop()
        loop.join(20)
