"""A coordinator reporter names a refusal for what it is: a coordinator that answers and refuses the node's
reports (bad token, a method it lacks) is REFUSED with the status code and its meaning, not "unreachable"."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
import pytest

from trainguard.agent.coordinator_report import CoordinatorReporter, NodeVerdict, ReporterState, ReportTarget
from trainguard.proto import coordinator_pb2_grpc
from trainguard.recovery.node_health import Verdict
from trainguard.recovery.rpc_security import RpcSecurity, TokenCheck

TOKEN = "ga26-test-token-0123456789"


@pytest.fixture()
def coordinator():
    """A real gRPC server requiring the job token, whose Coordinator service implements nothing (UNIMPLEMENTED,
    as an older coordinator answers); yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TokenCheck(TOKEN)])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator_pb2_grpc.CoordinatorServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _report(address: str, token: str = "") -> tuple[ReporterState, str]:
    """The state and message of a reporter to ``address`` after its first report."""
    reporter = CoordinatorReporter(ReportTarget(address, security=RpcSecurity(token=token)),
                                   lambda: NodeVerdict(Verdict.HEALTHY), "n1", "h1", "i1", interval_s=60.0,
                                   timeout_s=5.0).start()
    try:
        deadline = time.monotonic() + 30
        while reporter.state is ReporterState.CONNECTING:
            assert time.monotonic() < deadline, "no report within 30 s"
            time.sleep(0.01)
        return reporter.state, reporter.message
    finally:
        reporter.stop()


def test_a_refused_report_names_the_code_and_its_meaning(coordinator, caplog) -> None:
    caplog.set_level("WARNING", logger="trainguard.agent.coordinator_report")
    state, message = _report(coordinator)
    assert state is ReporterState.REFUSED and message.startswith("UNAUTHENTICATED (bad or missing credentials")
    assert "refuses node n1's health reports: UNAUTHENTICATED" in caplog.text and "unreachable" not in caplog.text
    state, message = _report(coordinator, TOKEN)
    assert state is ReporterState.REFUSED and message.startswith("UNIMPLEMENTED (")


def test_a_closed_port_is_still_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        state, message = _report(f"127.0.0.1:{port}")
    assert state is ReporterState.UNREACHABLE and message.startswith("UNAVAILABLE")


def test_a_cordoned_node_returned_to_service_by_an_operator_reports_on(caplog) -> None:
    """The daemon keeps reporting while an operator uncordons its node (trainguard uncordon): its reporter goes
    back from CORDONED to REPORTING (that transition was refused, which killed the reporter's thread)."""
    from trainguard.recovery.service import CoordinatorServer, JobSpec

    caplog.set_level("WARNING", logger="trainguard.agent.coordinator_report")
    srv = CoordinatorServer(JobSpec(job="rep-unc", nnodes=2), listen="127.0.0.1:0").start()
    verdict = [NodeVerdict(Verdict.FATAL, "nvidia: GPU fell off the bus")]
    reporter = CoordinatorReporter(ReportTarget(srv.target, job="rep-unc"), lambda: verdict[0], "n1", "h1", "i1",
                                   interval_s=0.05, timeout_s=5.0).start()
    try:
        deadline = time.monotonic() + 30
        while reporter.state is not ReporterState.CORDONED:
            assert time.monotonic() < deadline, f"never cordoned: {reporter.state} {reporter.message}"
            time.sleep(0.01)
        verdict[0] = NodeVerdict(Verdict.HEALTHY)
        # Refused while the daemon's newest report is still the fatal one; its healthy one lands an interval later.
        done, message = False, ""
        while not done:
            assert time.monotonic() < deadline, f"never uncordoned: {message}"
            done, message, fut = srv.core.uncordon("rep-unc", "n1", "GPU reseated")
            srv.core.wait_durable(fut)
            if not done:
                assert "still reports a fatal fault" in message, message
                time.sleep(0.02)
        while reporter.state is not ReporterState.REPORTING:
            assert time.monotonic() < deadline, f"still {reporter.state}: {reporter.message}"
            time.sleep(0.01)
        assert "returned node n1 to service" in caplog.text
    finally:
        reporter.stop()
        srv.stop(0)
