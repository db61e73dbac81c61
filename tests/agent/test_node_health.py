"""Node health: the configured predictor threshold drives alarms, status and metrics; the lifecycle table."""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from trainguard.agent.errors import IllegalTransitionError
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.node_health import LocalNodeHealth
from trainguard.agent.parts import HEALTH_TRANSITIONS, HealthState, HealthTrigger
from trainguard.proto import agent_pb2, agent_pb2_grpc

NORMAL_C, HOT_C = 60.0, 95.0


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    """A real robust-z model of GPU temperature (trained in ~0.3 s) with online per-node calibration: a fresh
    node's own threshold is infinite for its first day, so only a configured threshold can make it alarm."""
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.table import MetricTable
    from trainguard.predictor.training import TrainConfig, train

    rng = np.random.default_rng(0)
    ts, nodes, vals = [], [], []
    for k in range(3):
        for i in range(400):
            ts.append(1e9 + i * 5.0)
            nodes.append(f"n{k}")
            vals.append([NORMAL_C + rng.normal(0, 1)])
    table = MetricTable(columns=["gpu_temp_c"], ts=np.array(ts), node=np.array(nodes, dtype=object),
                        values=np.array(vals))
    model = train(table, None, TrainConfig(method="robust-z", features=FeatureConfig(interval_s=5.0, peer=False)))
    assert model.calibration is not None  # per-node thresholds, the default since they exist
    path = tmp_path_factory.mktemp("model") / "temp.tgm"
    model.save(path, key=b"")
    return str(path)


def _feed(monitor, temps: list[float], t0: float) -> list:
    """Ticks the node's real predictor monitor with detector metrics (one GPU's temperature), 5 s apart."""
    return [monitor.tick(t0 + i * 5.0, {"nvidia.temp_c[0]": c}) for i, c in enumerate(temps)]


def _alarms(health: LocalNodeHealth) -> list:
    return [e for e in health.bus.recent(50) if e.kind == "predictor.alarm"]


def test_configured_threshold_drives_the_alarm(model_file: str) -> None:
    health = LocalNodeHealth("n1", threshold=0.5)
    health.start_predictor(model_file, None, interval_s=0.0)
    scores = _feed(health.predictor, [NORMAL_C] * 40 + [HOT_C] * 4, time.time())
    hot = scores[-1]
    assert hot is not None and hot.score >= 0.5, hot
    assert health.threshold == 0.5 and hot.threshold == 0.5
    alarms = _alarms(health)
    assert len(alarms) == 1 and alarms[0].evidence["threshold"] == "0.5000", alarms
    assert health.state == HealthState.ALARMED and health.drain_pending


def test_unset_threshold_keeps_the_models_calibrated_one(model_file: str) -> None:
    health = LocalNodeHealth("n1")
    health.start_predictor(model_file, None, interval_s=0.0)
    scores = _feed(health.predictor, [NORMAL_C] * 40 + [HOT_C] * 4, time.time())
    # The same hot score: the node's own threshold is still calibrating (infinite), so no alarm.
    assert scores[-1].score >= 0.5 and math.isinf(scores[-1].threshold)
    assert math.isinf(health.threshold) and not _alarms(health) and health.state == HealthState.INIT


def test_threshold_set_later_applies_from_the_next_score(model_file: str) -> None:
    health = LocalNodeHealth("n1")
    health.start_predictor(model_file, None, interval_s=0.0)
    t0 = time.time()
    _feed(health.predictor, [NORMAL_C] * 40, t0)
    health.threshold = 0.3  # a reload
    _feed(health.predictor, [HOT_C] * 2, t0 + 40 * 5.0)
    assert health.threshold == 0.3 and len(_alarms(health)) == 1
    health.threshold = float("nan")  # unset again: back to the model's own
    assert health.threshold == 0.3  # the last score was judged at 0.3; the next one shows the model's
    _feed(health.predictor, [HOT_C], t0 + 42 * 5.0)
    assert math.isinf(health.threshold)


def test_daemon_status_metrics_and_alarms_use_the_configured_threshold(tmp_path: Path, model_file: str) -> None:
    """The finding: ``predictor.threshold`` in the daemon's configuration had no effect (status, metrics and
    alarms used the model's own threshold)."""
    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.sdnotify import SystemdNotifier

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    body = (f'[metrics]\nlisten = "127.0.0.1:0"\n[detectors]\nroot = "{tmp_path / "fake"}"\n'
            f'[predictor]\nmodel = "{model_file}"\nthreshold = {{}}\n')
    config.write_text(body.format("0.5"))
    sock_path = tmp_path / "agent.sock"
    daemon = AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    try:
        node = daemon.node
        _feed(node.predictor, [NORMAL_C] * 40 + [HOT_C] * 4, time.time())
        daemon._refresh()  # what the daemon's loop does each turn: live state into metrics and health
        alarms = [e for e in node.bus.recent(50) if e.kind == "predictor.alarm"]
        assert len(alarms) == 1, [e.kind for e in node.bus.recent(50)]
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            h = agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
        assert h.predictor_threshold == 0.5 and h.predictor_score >= 0.5
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon._metrics_server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "trainguard_predictor_threshold 0.5" in text, [ln for ln in text.splitlines() if "threshold" in ln]
        # SIGHUP with a new threshold: status and metrics follow at once.
        config.write_text(body.format("0.95"))
        daemon.reload()
        daemon._refresh()
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            h = agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
        assert h.predictor_threshold == pytest.approx(0.95)
    finally:
        daemon.stop()


def test_health_lifecycle_refuses_illegal_moves() -> None:
    life = Lifecycle("node health", HEALTH_TRANSITIONS, HealthState.INIT)
    with pytest.raises(IllegalTransitionError, match="no transition from INIT on drain_due"):
        life.fire(HealthTrigger.DRAIN_DUE)
    assert life.fire(HealthTrigger.START) == HealthState.WATCHING
    with pytest.raises(IllegalTransitionError):
        life.fire(HealthTrigger.DRAINED)  # nothing to drain
    assert life.fire(HealthTrigger.ALARM) == HealthState.ALARMED
    assert life.fire(HealthTrigger.DRAIN_DUE) == HealthState.DRAINING
    assert life.fire(HealthTrigger.DRAINED) == HealthState.WATCHING
    assert life.fire(HealthTrigger.STOP) == HealthState.STOPPED
    with pytest.raises(IllegalTransitionError):
        life.fire(HealthTrigger.START)  # a stopped watch does not come back
