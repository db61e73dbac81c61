"""The coordinator's /metrics and health through a real restart over gRPC: the recovery is timed, counted and
exported; a coordinator fenced off by a newer one turns NOT_SERVING."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from trainguard.proto import common_pb2
from trainguard.proto import coordinator_pb2 as pb
from trainguard.proto import coordinator_pb2_grpc
from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.observe import COORDINATOR_SERVICE, CoordinatorMetrics
from trainguard.recovery.service import CoordinatorServer, JobSpec

JOB = "obs-job"


def _health(ch: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _until(pred, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_restart_is_timed_counted_and_exported_and_fencing_turns_health_off(tmp_path) -> None:
    spec = JobSpec(job=JOB, nnodes=1, max_restarts=2, heartbeat_interval_s=0.1, backoff_initial_s=0.0,
                   store=f"sqlite://{tmp_path}/c.db")
    srv = CoordinatorServer(spec).start()
    metrics = CoordinatorMetrics(srv.watch)
    ch = grpc.insecure_channel(srv.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert _health(ch) == _health(ch, COORDINATOR_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        info = common_pb2.NodeInfo(node_id="n0", topology=common_pb2.Topology(host="n0", device_count=1))
        lease = stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=info, free_port=41000)).lease_id
        state = {"gen": -1, "port": 41001}

        def beat(workers: int = 1) -> None:
            state["port"] += 1
            r = stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=lease, generation=state["gen"],
                                                       free_port=state["port"], workers_running=workers))
            if r.command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_RESTART):
                state["gen"] = r.rank_table.generation

        _until(lambda: beat() or state["gen"] == 1, what="generation 1")
        ev = common_pb2.HealthEvent(node_id="n0", source="process", kind="process.exit", message="rank 0 died",
                                    severity=common_pb2.SEVERITY_CRITICAL)
        stub.ReportEvent(pb.ReportEventRequest(job=JOB, node_id="n0", lease_id=lease, generation=1, event=ev,
                                               proposed_level=pb.RECOVERY_LEVEL_PROCESS, failed_rank=0, exit_code=-9))
        # Like an agent: its workers stopped (so the coordinator may restart), then generation 2 runs.
        _until(lambda: beat(0 if state["gen"] == 1 else 1) or (state["gen"] == 2 and srv.watch.recoveries),
               what="a timed recovery")
        text = generate_latest(metrics.registry).decode()
        assert "trainguard_job_recovery_seconds_count 1.0" in text
        assert "trainguard_job_restarts_total 1.0" in text and "trainguard_job_generation 2.0" in text
        assert 'trainguard_job_phase{phase="running"} 1.0' in text and "trainguard_job_max_restarts 2.0" in text
        assert 'trainguard_job_nodes{state="alive"} 1.0' in text and "trainguard_coordinator_fenced 0.0" in text
        assert 0 < srv.watch.recoveries[0] < 20

        newer = JobCoordinator(spec)  # another coordinator takes the job over: this one is fenced at its next write
        try:
            try:
                stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=common_pb2.NodeInfo(
                    node_id="n1", topology=common_pb2.Topology(host="n1")), free_port=42000), timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
            _until(lambda: _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
            assert "trainguard_coordinator_fenced 1.0" in generate_latest(metrics.registry).decode()
        finally:
            newer.close()
    finally:
        ch.close()
        srv.stop(0)


def test_a_metrics_or_health_address_without_a_valid_port_is_a_one_line_usage_error() -> None:
    """Found by a user's review: `--metrics-listen 127.0.0.1:99999` (or no port at all) ended `trainguard
    coordinator` with a ValueError traceback, and `--health-listen 127.0.0.1:99999` served health on some other
    port, silently."""
    import argparse

    from trainguard.errors import UsageError
    from trainguard.recovery.deploy_cli import start_coordinator_extras

    server = CoordinatorServer(JobSpec(job=JOB, nnodes=1, store="memory://"), listen="127.0.0.1:0")
    try:
        for flag, value, said in (("metrics_listen", "127.0.0.1:99999", "port must be a number in 0-65535"),
                                  ("metrics_listen", "nohost", "'nohost' is not HOST:PORT"),
                                  ("health_listen", "127.0.0.1:99999", "a port in 0-65535"),
                                  ("health_listen", "nohost", "a port in 0-65535")):
            with pytest.raises(UsageError) as err:
                start_coordinator_extras(argparse.Namespace(**{flag: value}), server)
            text = str(err.value)
            assert text.startswith(f"--{flag.replace('_', '-')} ") and said in text and "\n" not in text, text
    finally:
        server.stop()


def test_bad_bytes_on_the_coordinators_health_service_get_invalid_argument_and_no_traceback(caplog) -> None:
    """Random bytes to grpc.health.v1 on the coordinator's port and on its plaintext --health-listen port got
    gRPC's own INTERNAL and an ERROR traceback in the coordinator's log per request (found by the node daemon's
    review, whose health service had the same gap); well-formed checks and watches still answer."""
    from trainguard.recovery.observe import ServingStatus, serve_health_only

    server = CoordinatorServer(JobSpec(job=JOB, nnodes=1, store="memory://"), listen="127.0.0.1:0").start()
    status = ServingStatus(("",))
    status.set(True)
    probe, port = serve_health_only(status, "127.0.0.1:0", "probe")
    try:
        for target in (server.target, f"127.0.0.1:{port}"):
            with grpc.insecure_channel(target) as ch:
                check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                       response_deserializer=None)
                for payload in (b"\x0a\xff\xff", b"\xff" * 7, b"\x0a\x02\xc3\x28", b"\x0a\x80\x40" + b"a" * 8192):
                    with pytest.raises(grpc.RpcError) as err:
                        check(payload, timeout=5)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (target, payload[:8])
                watch = ch.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=None,
                                        response_deserializer=None)
                with pytest.raises(grpc.RpcError) as err:
                    list(watch(b"\xff" * 7, timeout=5))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
                stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5)
                assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
                stream.cancel()
        assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    finally:
        probe.stop(0)
        server.stop()


def test_health_list_answers_every_service_on_both_ports_without_a_traceback(caplog) -> None:
    """``grpc.health.v1.Health/List`` (no token needed) was UNIMPLEMENTED with an ERROR traceback in the
    coordinator's log per call, on its port and on --health-listen (fuzzing review); the daemon's answered."""
    from trainguard.recovery.observe import ServingStatus, serve_health_only

    server = CoordinatorServer(JobSpec(job=JOB, nnodes=1, store="memory://"), listen="127.0.0.1:0").start()
    status = ServingStatus(("", COORDINATOR_SERVICE))
    probe, port = serve_health_only(status, "127.0.0.1:0", "probe")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            listed = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5).statuses
            assert {k: v.status for k, v in listed.items()} == {
                "": health_pb2.HealthCheckResponse.NOT_SERVING,
                COORDINATOR_SERVICE: health_pb2.HealthCheckResponse.NOT_SERVING}
            status.set(True)
            listed = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5).statuses
            assert {v.status for v in listed.values()} == {health_pb2.HealthCheckResponse.SERVING}
        with grpc.insecure_channel(server.target) as ch:
            listed = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5).statuses
            assert listed[COORDINATOR_SERVICE].status == health_pb2.HealthCheckResponse.SERVING
        assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    finally:
        probe.stop(0)
        server.stop()
