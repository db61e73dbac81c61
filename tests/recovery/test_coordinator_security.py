"""TLS, mutual TLS and the job token on a real coordinator over real sockets: the right client gets in; a wrong
CA, no client certificate, a foreign client certificate, no token and a wrong token are all refused, and a
refused call changes nothing. Then a real `trainguard run` joins a secured coordinator (and one with a wrong
token is turned away with a one-line error)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_testutil import make_pki  # noqa: E402

from trainguard.agent.tls import TlsFiles  # noqa: E402
from trainguard.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from trainguard.recovery import CoordinatorServer, JobSpec  # noqa: E402
from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError, token_from  # noqa: E402

JOB = "secure-job"
TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _server(security: RpcSecurity, nnodes: int = 1) -> CoordinatorServer:
    spec = JobSpec(job=JOB, nnodes=nnodes, max_restarts=1, heartbeat_interval_s=0.2, store="memory://")
    return CoordinatorServer(spec, listen="127.0.0.1:0", security=security).start()


@pytest.fixture(scope="module")
def mtls(pki):
    srv = _server(RpcSecurity(TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)), TOKEN))
    yield srv
    srv.stop(0)


def _register(security: RpcSecurity, target: str, node: str = "n0") -> coordinator_pb2.RegisterNodeResponse:
    with security.channel(target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        info = common_pb2.NodeInfo(node_id=node, topology=common_pb2.Topology(host=node, device_count=1))
        return stub.RegisterNode(coordinator_pb2.RegisterNodeRequest(job=JOB, node=info, free_port=12345),
                                 timeout=5)


def _client(pki, cert="client", ca="ca", token=TOKEN) -> RpcSecurity:
    files = TlsFiles(str(getattr(pki, f"{cert}_cert")) if cert else "", str(getattr(pki, f"{cert}_key")) if cert else "",
                     str(getattr(pki, ca)))
    return RpcSecurity(files, token, server_name="localhost")


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_right_ca_client_cert_and_token_register(pki, mtls) -> None:
    assert _register(_client(pki), mtls.target, "good").lease_id
    assert "good" in mtls.core.members()


@pytest.mark.parametrize("case, expected", [
    ("wrong CA", grpc.StatusCode.UNAVAILABLE),          # the client does not trust the coordinator's certificate
    ("no client cert", grpc.StatusCode.UNAVAILABLE),    # mutual TLS: handshake refused
    ("foreign client cert", grpc.StatusCode.UNAVAILABLE),
    ("plaintext", grpc.StatusCode.UNAVAILABLE),
    ("no token", grpc.StatusCode.UNAUTHENTICATED),
    ("wrong token", grpc.StatusCode.UNAUTHENTICATED),
])
def test_refused_and_nothing_changes(pki, mtls, case, expected) -> None:
    client = {
        "wrong CA": _client(pki, ca="other_ca"),
        "no client cert": _client(pki, cert=None),
        "foreign client cert": _client(pki, cert="rogue"),
        "plaintext": RpcSecurity(token=TOKEN),
        "no token": _client(pki, token=""),
        "wrong token": _client(pki, token="f" * 32),
    }[case]
    node = "x-" + case.replace(" ", "-")
    assert _code(lambda: _register(client, mtls.target, node)) == expected
    assert node not in mtls.core.members()


def test_health_answers_without_token_but_only_over_tls(pki, mtls) -> None:
    sec = _client(pki, token="")
    with sec.channel(mtls.target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_token_only_plaintext_coordinator(pki) -> None:
    srv = _server(RpcSecurity(token=TOKEN))
    try:
        assert _code(lambda: _register(RpcSecurity(), srv.target, "anon")) == grpc.StatusCode.UNAUTHENTICATED
        assert _register(RpcSecurity(token=TOKEN), srv.target, "ok").lease_id
        assert set(srv.core.members()) == {"ok"}
    finally:
        srv.stop(0)


def test_bad_security_settings_are_one_line_errors(tmp_path, pki) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(SecurityConfigError, match="at least 16"):
        token_from(str(short))
    with pytest.raises(SecurityConfigError, match="cannot read"):
        token_from(str(tmp_path / "missing"))
    assert token_from(None, {"TRAINGUARD_JOB_TOKEN": TOKEN}) == TOKEN
    with pytest.raises(SecurityConfigError, match="--tls-client-ca needs"):
        RpcSecurity(TlsFiles(ca_file=str(pki.ca))).check_server()
    with pytest.raises(SecurityConfigError, match="do not load or do not match"):
        # a certificate with another certificate's key
        _server(RpcSecurity(TlsFiles(str(pki.server_cert), str(pki.client_key))))


def _run(tg_env, tmp_path, target: str, pki, token_file: Path, ca: str = "ca") -> subprocess.CompletedProcess:
    script = tmp_path / "ok.py"
    script.write_text("print('worker ran')\n")
    return subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", "--no-standby", "--job", JOB, "--coordinator", target,
         "--node-id", "node-a", "--coordinator-ca", str(getattr(pki, ca)), "--coordinator-cert", str(pki.client_cert),
         "--coordinator-key", str(pki.client_key), "--coordinator-server-name", "localhost",
         "--token-file", str(token_file), str(script)],
        env={**tg_env, "TRAINGUARD_RUN_REGISTRY": str(tmp_path / "runs")}, capture_output=True, text=True,
        timeout=90)


def test_trainguard_run_joins_a_secured_coordinator_and_a_wrong_token_is_turned_away(pki, tmp_path, tg_env) -> None:
    srv = _server(RpcSecurity(TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)), TOKEN))
    try:
        bad = tmp_path / "bad-token"
        bad.write_text("y" * 32)
        out = _run(tg_env, tmp_path, srv.target, pki, bad)
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert "UNAUTHENTICATED" in last and "job token" in last, out.stderr[-2000:]
        assert srv.core.members() == {}
        good = tmp_path / "token"
        good.write_text(TOKEN + "\n")
        out = _run(tg_env, tmp_path, srv.target, pki, good, ca="other_ca")  # fails at once, not after 60 s
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 2 and "TLS with the coordinator" in last and "--coordinator-ca" in last, out.stderr
        out = _run(tg_env, tmp_path, srv.target, pki, good)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "worker ran" in out.stdout and "job succeeded" in out.stderr
    finally:
        srv.stop(0)


def test_a_client_retrying_without_the_token_makes_one_warning_per_window(pki, caplog) -> None:
    """A client without the token retries (or a scanner knocks) at every turn: the first refusal is a WARNING
    that names the fix, the repeats of the same kind within the window are DEBUG lines; a wrong token, another
    kind, gets its own WARNING."""
    import logging

    caplog.set_level(logging.DEBUG, logger="trainguard.recovery.rpc_security")
    srv = _server(RpcSecurity(token=TOKEN))
    try:
        for i in range(8):
            assert _code(lambda: _register(RpcSecurity(), srv.target, f"anon{i}")) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: _register(RpcSecurity(token="x" * 32), srv.target, "wrong")) == \
            grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.stop(0)
    lines = [r for r in caplog.records if r.name == "trainguard.recovery.rpc_security"]
    warnings = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "no job token" in warnings[0] and "--token-file" in warnings[0] and "a wrong job token" in warnings[1]
    assert sum(r.levelno == logging.DEBUG and "no job token" in r.getMessage() for r in lines) == 7
