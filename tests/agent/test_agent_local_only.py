"""The daemon's TCP listener is for operators and probes: worker methods (heartbeats, checkpoint reports) are
refused there, served on the unix socket, and the listener binds to loopback unless configured otherwise."""

from __future__ import annotations

import threading

import grpc
import pytest

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.config import AgentConfig
from trainguard.proto import agent_pb2, agent_pb2_grpc


def test_default_tcp_listener_is_loopback() -> None:
    assert AgentConfig().grpc.listen.startswith("127.0.0.1:")


def test_worker_methods_only_on_the_unix_socket(tmp_path) -> None:
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[metrics]\nlisten = ""\n[detectors]\nroot = "{tmp_path / "fake"}"\n'
                      '[agent]\nloop_interval_s = 0.1\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "agent.sock"
    daemon = AgentDaemon(config_loader(str(config), "127.0.0.1:0", str(sock_path), str(tmp_path / "state")))
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        hb = agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1, step=3, step_time_s=0.1)
        report = agent_pb2.CheckpointReport(rank=0, step=3, tier="disk", bytes=1)
        with grpc.insecure_channel(f"127.0.0.1:{daemon.tcp_port}") as tcp:
            stub = agent_pb2_grpc.NodeAgentStub(tcp)
            assert stub.GetHealth(agent_pb2.GetHealthRequest(), timeout=5).version  # operators: fine over TCP
            for call, req in ((stub.WorkerHeartbeat, hb), (stub.ReportCheckpoint, report)):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "unix socket" in err.value.details()
        with grpc.insecure_channel(f"unix:{sock_path}") as local:
            stub = agent_pb2_grpc.NodeAgentStub(local)
            stub.WorkerHeartbeat(hb, timeout=5)
            stub.ReportCheckpoint(report, timeout=5)
    finally:
        daemon.request_stop()
        loop.join(timeout=30)
    assert not loop.is_alive()
