"""Subsystems the user switched off (metrics with ``metrics.listen = ""``, the predictor with ``predictor.enabled
= false``) are no fault: the daemon's grpc.health.v1 service reports them SERVING, and `trainguard status` says
"off" for them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.sdnotify import SystemdNotifier
from trainguard.cli import main


def _daemon(tmp_path: Path, extra: str) -> tuple[AgentDaemon, Path]:
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n' + extra)
    sock_path = tmp_path / "agent.sock"
    return AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                       SystemdNotifier(None)), sock_path


def test_metrics_and_predictor_switched_off_are_serving_and_shown_off(tmp_path: Path, capsys) -> None:
    """With metrics.listen = "" the "metrics" subsystem was NOT_SERVING (a readiness probe on it failed, an
    alert fired) and `trainguard status` showed "metrics not_serving" on a node the user had set up so."""
    daemon, sock = _daemon(tmp_path, '[metrics]\nlisten = ""\n[predictor]\nenabled = false\n')
    daemon.start()
    try:
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("metrics", "predictor"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=f"trainguard.agent.{name}"), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        assert main(["status", "--socket", str(sock)]) == 0
        table = capsys.readouterr().out
        (health,) = [line for line in table.splitlines() if line.startswith("health: ")]
        assert "metrics off" in health and "predictor off" in health and "server ok" in health, table
        assert main(["status", "--socket", str(sock), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["health_services"]["trainguard.agent.metrics"] == "SERVING"
        assert doc["health_off"] == ["trainguard.agent.metrics", "trainguard.agent.predictor"]
    finally:
        daemon.stop()


def test_metrics_on_is_shown_ok(tmp_path: Path, capsys) -> None:
    daemon, sock = _daemon(tmp_path, '[metrics]\nlisten = "127.0.0.1:0"\n[predictor]\nenabled = false\n')
    daemon.start()
    try:
        assert main(["status", "--socket", str(sock), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["health_services"]["trainguard.agent.metrics"] == "SERVING"
        assert doc["health_off"] == ["trainguard.agent.predictor"]
        assert main(["status", "--socket", str(sock)]) == 0
        assert "metrics ok" in capsys.readouterr().out
    finally:
        daemon.stop()
