"""TLS and mutual TLS on a real gRPC server: the right client gets in, every other one is refused."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_testutil import make_pki
from trainguard.agent.config import AgentConfigError
from trainguard.agent.health import HealthReporter
from trainguard.agent.tls import ServerCertificates, TlsFiles, channel_credentials, load_key_pair

OPTS = [("grpc.ssl_target_name_override", "localhost")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def start_server(certs: ServerCertificates):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reporter = HealthReporter()
    reporter.set("", True)
    reporter.add_to_server(server)
    port = server.add_secure_port("127.0.0.1:0", certs.credentials())
    server.start()
    return server, port


def check(port: int, creds: grpc.ChannelCredentials | None):
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, creds, OPTS) if creds else grpc.insecure_channel(target)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)


@pytest.fixture(scope="module")
def mtls_port(pki):
    server, port = start_server(ServerCertificates(TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca))))
    yield port
    server.stop(None)


def test_mutual_tls_accepts_client_signed_by_trusted_ca(pki, mtls_port):
    creds = channel_credentials(TlsFiles(str(pki.client_cert), str(pki.client_key), str(pki.ca)))
    assert check(mtls_port, creds).status == health_pb2.HealthCheckResponse.SERVING


def test_client_cert_from_another_ca_is_refused(pki, mtls_port):
    creds = channel_credentials(TlsFiles(str(pki.rogue_cert), str(pki.rogue_key), str(pki.ca)))
    with pytest.raises(grpc.RpcError) as err:
        check(mtls_port, creds)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_without_certificate_is_refused(pki, mtls_port):
    with pytest.raises(grpc.RpcError) as err:
        check(mtls_port, channel_credentials(TlsFiles(ca_file=str(pki.ca))))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_to_tls_port_is_refused(mtls_port):
    with pytest.raises(grpc.RpcError) as err:
        check(mtls_port, None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_server_only_tls_and_client_verifies_server(pki):
    server, port = start_server(ServerCertificates(TlsFiles(str(pki.server_cert), str(pki.server_key))))
    try:
        assert check(port, channel_credentials(TlsFiles(ca_file=str(pki.ca)))).status == 1
        with pytest.raises(grpc.RpcError):  # the server's certificate does not chain to CA 2
            check(port, channel_credentials(TlsFiles(ca_file=str(pki.other_ca))))
    finally:
        server.stop(None)


def test_reload_rotates_certificate_and_keeps_old_on_error(pki):
    certs = ServerCertificates(TlsFiles(str(pki.server_cert), str(pki.server_key)))
    server, port = start_server(certs)
    try:
        with pytest.raises(AgentConfigError, match="do not load or do not match"):
            certs.reload(TlsFiles(str(pki.server_cert), str(pki.client_key)))
        assert check(port, channel_credentials(TlsFiles(ca_file=str(pki.ca)))).status == 1
        # Rotate to a certificate from CA 2: new handshakes use it, with no restart of the listener.
        certs.reload(TlsFiles(str(pki.server2_cert), str(pki.server2_key)))
        assert check(port, channel_credentials(TlsFiles(ca_file=str(pki.other_ca)))).status == 1
        with pytest.raises(grpc.RpcError):
            check(port, channel_credentials(TlsFiles(ca_file=str(pki.ca))))
    finally:
        server.stop(None)


def test_bad_files_name_the_problem(pki, tmp_path):
    with pytest.raises(AgentConfigError, match=r"tls\.cert_file .*nope\.pem: cannot read \(No such file"):
        load_key_pair(str(tmp_path / "nope.pem"), str(pki.server_key))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(AgentConfigError, match=r"junk\.pem: no PEM certificate"):
        load_key_pair(str(junk), str(pki.server_key))
    with pytest.raises(AgentConfigError, match="not a PEM CA bundle|holds no certificate"):
        ServerCertificates(TlsFiles(str(pki.server_cert), str(pki.server_key), str(junk)))
