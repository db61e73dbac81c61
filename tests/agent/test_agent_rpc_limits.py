"""The request guard on a real gRPC server: oversized, malformed and out-of-range requests, stream limits,
per-subsystem health statuses and server reflection."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from trainguard.agent.health import HealthReporter, detector_service, enable_reflection, subsystem_service
from trainguard.agent.rpc_limits import RequestGuard
from trainguard.proto import agent_pb2, agent_pb2_grpc, common_pb2
from trainguard.steps import MAX_STEP


class Servicer(agent_pb2_grpc.NodeAgentServicer):
    """Answers from fixed data; the guard in front of it is what is tested."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def GetHealth(self, request, context):  # noqa: N802
        return agent_pb2.NodeHealth(node_id="n", last_checkpoint_step=request.max_events)

    def WatchEvents(self, request, context):  # noqa: N802
        yield common_pb2.HealthEvent(kind="test.first")
        self.release.wait(10)

    def WorkerHeartbeat(self, request, context):  # noqa: N802
        return agent_pb2.WorkerHeartbeatResponse(generation=request.generation)

    def ReportCheckpoint(self, request, context):  # noqa: N802
        return agent_pb2.CheckpointReportResponse()

    def AttachJob(self, request, context):  # noqa: N802
        return agent_pb2.AttachJobResponse(node_id="n")


@pytest.fixture
def server():
    calls = []
    servicer = Servicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                      interceptors=[RequestGuard(1024, 1, observer=lambda *a: calls.append(a))],
                      options=[("grpc.max_receive_message_length", 4096)])
    agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, srv)
    reporter = HealthReporter()
    reporter.add_to_server(srv)
    enable_reflection(srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, calls, reporter, servicer
    servicer.release.set()
    channel.close()
    srv.stop(None)


def test_valid_call_passes_and_is_observed(server):
    channel, calls, _, _ = server
    reply = agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(max_events=7), timeout=3)
    assert reply.last_checkpoint_step == 7
    assert calls[-1][:2] == ("GetHealth", "OK") and calls[-1][2] > 0


def code_of(fn, *args):
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, timeout=3)
    return err.value.code(), err.value.details()


def test_oversized_malformed_and_out_of_range_get_invalid_argument(server):
    channel, calls, _, _ = server
    raw = channel.unary_unary("/trainguard.v1.NodeAgent/GetHealth", request_serializer=None,
                              response_deserializer=None)
    code, details = code_of(raw, b"\x08" + b"\x80" * 2000)  # 2 KB: over the 1 KB method limit
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the 1024-byte limit" in details
    code, details = code_of(raw, b"\x0a\xff\xff")  # truncated length-delimited field
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    code, details = code_of(stub.GetHealth, agent_pb2.GetHealthRequest(max_events=-1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_events=-1" in details
    code, details = code_of(stub.WorkerHeartbeat, agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1,
                                                                                    step_time_s=float("nan")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "step_time_s" in details
    code, details = code_of(stub.WorkerHeartbeat, agent_pb2.WorkerHeartbeatRequest(
        rank=0, pid=1, acks_advisories=True, acked_advisory_ids=[str(i) for i in range(65)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "acked_advisory_ids has 65" in details
    code, _ = code_of(stub.ReportCheckpoint, agent_pb2.CheckpointReport(rank=0, step=1, tier="tape"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(raw, b"\x08" + b"\x80" * 5000)  # over the transport cap: gRPC's own code
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("GetHealth", "INVALID_ARGUMENT", pytest.approx(0, abs=1)) in [(c[0], c[1], c[2]) for c in calls]


def test_steps_past_the_coordinators_bound_are_refused_here(server):
    """A heartbeat step past 2**53-1 was taken here, then refused by the coordinator in every later heartbeat of
    the node, which lost its lease and its slot in the job; a checkpoint report of such a step became the node's
    last checkpoint step for good (fuzzing review)."""
    channel, _, _, _ = server
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    for step in (MAX_STEP + 1, 2**63 - 1, -2):
        code, details = code_of(stub.WorkerHeartbeat, agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1, step=step))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"step={step} is outside -1..{MAX_STEP}" in details
    for step in (MAX_STEP + 1, -1):
        code, details = code_of(stub.ReportCheckpoint, agent_pb2.CheckpointReport(rank=0, step=step, tier="disk"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"step={step} is outside 0..{MAX_STEP}" in details
    assert stub.WorkerHeartbeat(agent_pb2.WorkerHeartbeatRequest(rank=0, pid=1, step=MAX_STEP, generation=3),
                                timeout=3).generation == 3
    stub.ReportCheckpoint(agent_pb2.CheckpointReport(rank=0, step=MAX_STEP, tier="disk"), timeout=3)


def test_attach_values_that_could_never_work_are_refused_at_once(server):
    """A newline in the token failed every later report ("Invalid metadata"), a short token was refused by the
    coordinator at each report, and a NUL cut the dial target short and went raw into the log: all after an OK."""
    channel, _, _, _ = server
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    cases = [({"token": "a" * 31 + "\n"}, "token contains control characters"),
             ({"token": "a" * 16 + " " + "a" * 16}, "whitespace or control characters"),
             ({"token": "ab"}, "the job token has 2 characters"),
             ({"coordinator": "127.0.0.1:1\x00evil"}, "coordinator contains control characters"),
             ({"node_id": "n1\n"}, "node_id contains control characters")]
    for fields, said in cases:
        req = agent_pb2.AttachJobRequest(**{"job": "j", "coordinator": "127.0.0.1:1", "launcher_pid": 1, **fields})
        code, details = code_of(stub.AttachJob, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and said in details, (fields, details)
    stub.AttachJob(agent_pb2.AttachJobRequest(job="j", coordinator="127.0.0.1:1", launcher_pid=1, token="a" * 32),
                   timeout=3)


def test_stream_limit_and_bad_watch_request(server, caplog):
    channel, calls, _, servicer = server
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    first = stub.WatchEvents(agent_pb2.WatchEventsRequest(), timeout=10)
    assert next(first).kind == "test.first"
    second = stub.WatchEvents(agent_pb2.WatchEventsRequest(), timeout=3)
    with pytest.raises(grpc.RpcError) as err:
        next(second)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        next(stub.WatchEvents(agent_pb2.WatchEventsRequest(min_severity=9), timeout=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    raw = channel.unary_stream("/trainguard.v1.NodeAgent/WatchEvents", request_serializer=None,
                               response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\x0a\xff\xff", timeout=3))  # not protobuf: refused before the stream counts, no traceback
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    servicer.release.set()
    assert list(first) == []


def test_health_per_subsystem_and_reflection(server):
    channel, _, reporter, _ = server
    health = health_pb2_grpc.HealthStub(channel)

    def status(service):
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=3).status

    assert status("") == health_pb2.HealthCheckResponse.NOT_SERVING
    reporter.set("", True)
    reporter.set_detectors({"roce": True, "gpu": False})
    assert status("") == health_pb2.HealthCheckResponse.SERVING
    assert status(detector_service("roce")) == health_pb2.HealthCheckResponse.SERVING
    assert status(subsystem_service("detectors")) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        status("no.such.service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    listed = health.List(health_pb2.HealthListRequest(), timeout=3).statuses
    assert listed[detector_service("roce")].status == health_pb2.HealthCheckResponse.SERVING
    assert listed[subsystem_service("detectors")].status == health_pb2.HealthCheckResponse.NOT_SERVING
    reporter.shutdown()
    assert status("") == health_pb2.HealthCheckResponse.NOT_SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=3)
    names = {s.name for s in resp.list_services_response.service}
    assert {"trainguard.v1.NodeAgent", "grpc.health.v1.Health"} <= names


def test_bad_bytes_on_health_and_reflection_get_invalid_argument_and_no_traceback(server, caplog):
    """grpc.health.v1 answers anyone reaching the TCP port: random bytes there got gRPC's own INTERNAL and an
    ERROR traceback in the daemon's log per request, oversized ones were parsed whatever max_request_bytes said."""
    channel, _, reporter, _ = server
    reporter.set("", True)
    bad = (b"\x0a\xff\xff", b"\xff" * 7, b"\x0a\x02" + b"\xc3\x28")  # torn, not protobuf, bad UTF-8 in a string
    for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/List"):
        raw = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        for payload in bad if method.endswith("Check") else bad[:2]:  # List's request has no string field
            assert code_of(raw, payload)[0] == grpc.StatusCode.INVALID_ARGUMENT, (method, payload)
        code, details = code_of(raw, b"\x0a\x80\x10" + b"a" * 2048)  # a 2 KB service name: over the 1 KB limit
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the 1024-byte limit" in details
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(watch(bad[0], timeout=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                    request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(reflect(iter([bad[1]]), timeout=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    # Well-formed calls still pass.
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=3).status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=3)
    assert resp.list_services_response.service


def test_idle_health_watchers_hold_no_serving_thread(server):
    """grpcio's health Watch answers through a callback, holding no thread while a probe watches; the guard in
    front of it must keep it so: as a generator it held one per stream, and 4 idle watchers here (16 on the daemon,
    from anyone reaching its TCP port) left no thread for a health check, the daemon's own self-check included."""
    channel, _, reporter, _ = server
    reporter.set("", True)
    health = health_pb2_grpc.HealthStub(channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(8)]
    try:
        for w in watches:
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        for w in watches:
            w.cancel()
