"""Event streams at the daemon's limit: the default takes a node full of single-device jobs' launchers plus
operators, and the one refused beyond the limit is told which option to raise, once; network peers cannot take
the launchers' streams; a predictor degraded to its rules tier is said in the status and in the event stream."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.operator_cli import follow_events
from trainguard.agent.sdnotify import SystemdNotifier
from trainguard.proto import agent_pb2, agent_pb2_grpc, common_pb2


def _daemon(tmp_path: Path, grpc_table: str = "", listen: str = "") -> AgentDaemon:
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path / "fake"}"\n[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n[grpc]\n{grpc_table}')
    daemon = AgentDaemon(config_loader(str(config), listen, str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    return daemon


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.02)


def _assert_refused(stub: agent_pb2_grpc.NodeAgentStub, needle: str) -> None:
    """One more stream is refused with RESOURCE_EXHAUSTED, its details naming ``needle``."""
    extra = stub.WatchEvents(agent_pb2.WatchEventsRequest(replay=1), timeout=60)
    try:
        next(extra)
        raise AssertionError(f"a stream beyond the limit ({needle}) was accepted")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and needle in exc.details(), exc.details()


def test_default_limit_takes_sixteen_single_device_jobs_and_operators(tmp_path: Path) -> None:
    """The default was 8 streams: 8 single-GPU jobs' launchers took them all, and the operator's
    `trainguard events --follow` (or a ninth job's launcher) got RESOURCE_EXHAUSTED."""
    daemon = _daemon(tmp_path)
    limit = daemon.config.grpc.max_watchers
    calls = []
    try:
        with grpc.insecure_channel(f"unix:{tmp_path / 'agent.sock'}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            # 16 launchers (a 16-device node, one job per device) and an operator's `events --follow`, then the
            # rest up to the limit.
            for i in range(max(16 + 1, limit)):
                call = stub.WatchEvents(agent_pb2.WatchEventsRequest(replay=1), timeout=60)
                calls.append(call)
                try:
                    assert next(call).kind == "agent.started"  # accepted: the replayed event arrives
                except grpc.RpcError as exc:
                    raise AssertionError(f"stream {i + 1} refused: {exc.details()}") from exc
            _assert_refused(stub, "grpc.max_watchers")
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # threads left for health checks
            for call in calls:
                call.cancel()
    finally:
        daemon.stop()


def test_events_follow_at_the_limit_names_the_option_once(tmp_path: Path) -> None:
    """`trainguard events --follow` printed "event stream RESOURCE_EXHAUSTED; reconnecting in 0.2s", 0.4s, ...
    forever, never why nor what to change."""
    daemon = _daemon(tmp_path, "max_workers = 2\nmax_watchers = 1\n")
    refused = {"code": "RESOURCE_EXHAUSTED", "method": "WatchEvents"}
    err, stop, calls = io.StringIO(), threading.Event(), []
    try:
        with grpc.insecure_channel(f"unix:{tmp_path / 'agent.sock'}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            holder = stub.WatchEvents(agent_pb2.WatchEventsRequest(replay=1), timeout=60)
            assert next(holder).kind == "agent.started"

            def free_the_slot() -> None:  # once the operator's stream was refused twice
                _wait(lambda: (daemon.metrics.registry.get_sample_value("trainguard_grpc_requests_total", refused)
                               or 0) >= 2, "two refused streams")
                holder.cancel()

            freer = threading.Thread(target=free_the_slot)
            freer.start()
            events = follow_events(stub, 1, common_pb2.SEVERITY_INFO, renew_s=60, err=err, stop=stop, calls=calls)
            assert next(events).kind == "agent.started"  # had once the slot freed
            freer.join(30)
            stop.set()
            for call in calls:
                call.cancel()
    finally:
        daemon.stop()
    lines = err.getvalue().splitlines()
    told = [line for line in lines if "grpc.max_watchers" in line]
    assert len(told) == 1 and "refuses another event stream" in told[0], lines
    assert not [line for line in lines if "reconnecting" in line], lines


def test_network_peers_cannot_take_the_streams_launchers_need(tmp_path: Path) -> None:
    """The TCP port needs no credentials: any local user holding every stream there cut each newly started job's
    launcher (unix socket) off the node's hardware and predictor events. TCP peers get half the streams."""
    daemon = _daemon(tmp_path, "max_workers = 8\nmax_watchers = 4\n", listen="127.0.0.1:0")
    calls = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.tcp_port}") as tcp, \
                grpc.insecure_channel(f"unix:{tmp_path / 'agent.sock'}") as local:
            remote = agent_pb2_grpc.NodeAgentStub(tcp)
            for _ in range(2):
                calls.append(remote.WatchEvents(agent_pb2.WatchEventsRequest(replay=1), timeout=60))
                assert next(calls[-1]).kind == "agent.started"
            _assert_refused(remote, "network peers")  # a third TCP stream of 4
            launcher = agent_pb2_grpc.NodeAgentStub(local)
            for _ in range(2):  # the launchers' half is still there
                calls.append(launcher.WatchEvents(agent_pb2.WatchEventsRequest(replay=1), timeout=60))
                assert next(calls[-1]).kind == "agent.started"
            calls.pop(0).cancel()  # a TCP stream that ends gives its place back

            def accepted() -> bool:
                call = remote.WatchEvents(agent_pb2.WatchEventsRequest(replay=1), timeout=60)
                try:
                    assert next(call).kind == "agent.started"
                except grpc.RpcError:
                    return False
                calls.append(call)
                return True

            _wait(accepted, "TCP stream accepted after one ended")
            for call in calls:
                call.cancel()
    finally:
        daemon.stop()


def test_a_model_of_metrics_this_node_lacks_is_said_in_status_and_once_as_an_event(tmp_path: Path) -> None:
    """The predictor monitor drops such a model to the rules tier (tests/predictor/test_predictor_online_feed.py);
    the daemon said so only in its journal: `trainguard status` read "predictor ok" and no event was published."""
    daemon = _daemon(tmp_path)
    try:
        monitor = daemon.node_health.predictor
        assert monitor is not None, "the daemon runs no predictor"
        with grpc.insecure_channel(f"unix:{tmp_path / 'agent.sock'}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            service = health_pb2.HealthCheckRequest(service="trainguard.agent.predictor")
            assert check(service, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            monitor.absent_model_metrics = ["gpu_temp_c"]  # what the monitor records when it drops the model
            daemon._refresh()
            daemon._refresh()  # said once, however many turns find it
            assert check(service, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
            health = agent_pb2_grpc.NodeAgentStub(channel).GetHealth(
                agent_pb2.GetHealthRequest(max_events=50), timeout=10)
        said = [e for e in health.recent_events if e.kind == "predictor.degraded"]
        assert len(said) == 1 and "gpu_temp_c" in said[0].message, [e.kind for e in health.recent_events]
        assert said[0].severity == common_pb2.SEVERITY_WARNING
        assert "gpu_temp_c" in health.subsystem_details["predictor"], health.subsystem_details  # status's line
    finally:
        daemon.stop()
