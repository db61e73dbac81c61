"""Something that is not a trainguard coordinator listens at the coordinator's address: `trainguard run` says so at
once, in one line naming the address and what to do, and exits non-zero, instead of "not reachable yet" until the
join timeout. Real listeners: a plain TCP server (HTTP/1.x, or an SSH-like banner) and a gRPC server without the
Coordinator service."""

from __future__ import annotations

import socket
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from tg_testutil import run_cli
from trainguard.agent.coordinator_link import GrpcCoordinatorLink, LinkConfig
from trainguard.agent.errors import CoordinatorUnavailableError

HELLO = str(Path(__file__).resolve().parent / "scripts" / "print_env.py")


class PlainTcpServer:
    """A TCP listener speaking something else: ``http1`` answers any request with an HTTP/1.1 400, ``banner``
    greets with an SSH banner."""

    def __init__(self, mode: str) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.mode = mode
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    if self.mode == "banner":
                        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                    conn.settimeout(2.0)
                    conn.recv(4096)
                    if self.mode == "http1":
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["http1", "banner"])
def plain_tcp(request):
    server = PlainTcpServer(request.param)
    yield server
    server.close()


@pytest.fixture
def grpc_without_coordinator():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def _open(target: str, patience_s: float = 20.0) -> tuple[str, float]:
    link = GrpcCoordinatorLink(LinkConfig(job="foreign", coordinator=target, node_id="n1", patience_s=patience_s))
    start = time.monotonic()
    try:
        with pytest.raises(CoordinatorUnavailableError) as err:
            link.open()
        return str(err.value), time.monotonic() - start
    finally:
        link.close()


def test_a_plain_tcp_server_at_the_address_is_named_at_once(plain_tcp) -> None:
    target = f"127.0.0.1:{plain_tcp.port}"
    message, took = _open(target, patience_s=4.0)
    assert took < 3.0, f"waited {took:.1f}s: {message}"
    assert message.startswith(f"{target} is not a trainguard coordinator") and "HTTP/2" in message, message
    assert "--rdzv-endpoint" in message and "\n" not in message, message


def test_a_grpc_server_without_the_coordinator_service_is_named(grpc_without_coordinator) -> None:
    target = f"127.0.0.1:{grpc_without_coordinator}"
    message, took = _open(target)
    assert took < 3.0
    assert message.startswith(f"{target} is not a trainguard coordinator") and "Coordinator service" in message
    assert "--rdzv-endpoint" in message, message


def test_of_a_coordinator_list_the_other_addresses_are_still_tried() -> None:
    """A list names where the coordinator may be restarted: one address held by something else is not the end."""
    server = PlainTcpServer("http1")
    try:
        message, _ = _open(f"127.0.0.1:{server.port},127.0.0.1:1", patience_s=0.5)
    finally:
        server.close()
    assert "unreachable for" in message, message


def test_trainguard_run_node_0_on_a_port_held_by_a_plain_tcp_server_exits_at_once(tg_env: dict) -> None:
    """torchrun's c10d node 0 finds the endpoint's port taken and joins what listens there: a web server on that
    port had it say "not reachable yet" for the whole join timeout."""
    server = PlainTcpServer("http1")
    try:
        endpoint = f"127.0.0.1:{server.port}"
        start = time.monotonic()
        r = run_cli(["run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                     "--nproc-per-node", "1", HELLO, "/nonexistent"], tg_env, timeout=60)
        took = time.monotonic() - start
    finally:
        server.close()
    errors = [line for line in r.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert r.returncode != 0 and took < 20, (r.returncode, took, r.stderr[-2000:])
    assert len(errors) == 1 and f"{endpoint} is not a trainguard coordinator" in errors[0], r.stderr[-2000:]
    assert "not reachable yet" not in r.stderr, r.stderr[-2000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_tls_node_dialling_a_plaintext_coordinator_is_told_at_once(tmp_path: Path) -> None:
    """A node given --coordinator-ca dialling a coordinator that serves plaintext: the TLS handshake fails with
    WRONG_VERSION_NUMBER (the server answered the ClientHello with no TLS record) on every try, and the node said
    "not reachable yet" until join_timeout, as for a coordinator restarting. One line now, at once, naming the
    address and the TLS flags."""
    from agent_testutil import make_pki
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery import CoordinatorServer, JobSpec
    from trainguard.recovery.rpc_security import RpcSecurity

    pki = make_pki(tmp_path / "pki")
    srv = CoordinatorServer(JobSpec(job="foreign", nnodes=1), listen="127.0.0.1:0").start()
    try:
        client = RpcSecurity(tls=TlsFiles("", "", str(pki.ca)))
        link = GrpcCoordinatorLink(LinkConfig(job="foreign", coordinator=srv.target, node_id="n1", patience_s=8.0,
                                              channel=client.channel))
        start = time.monotonic()
        try:
            with pytest.raises(CoordinatorUnavailableError) as err:
                link.open()
        finally:
            link.close()
        took, message = time.monotonic() - start, str(err.value)
    finally:
        srv.stop()
    assert took < 5.0, f"waited {took:.1f}s: {message}"
    assert message.startswith(f"{srv.target} does not speak TLS") and "--coordinator-ca" in message, message
    assert "\n" not in message, message


def test_trainguard_runs_tls_probe_of_a_plaintext_coordinator_says_it_serves_plaintext(tmp_path: Path) -> None:
    """`trainguard run --coordinator X --coordinator-ca` probes X first; a plaintext coordinator failed the probe
    with "check --coordinator-ca (the CA that signed its certificate)", a certificate it does not have."""
    from agent_testutil import make_pki
    from trainguard.agent.run_deploy import probe_coordinator
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery import CoordinatorServer, JobSpec
    from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError

    pki = make_pki(tmp_path / "pki")
    srv = CoordinatorServer(JobSpec(job="foreign", nnodes=1), listen="127.0.0.1:0").start()
    try:
        with pytest.raises(SecurityConfigError) as err:
            probe_coordinator(RpcSecurity(tls=TlsFiles("", "", str(pki.ca))), srv.target)
    finally:
        srv.stop()
    assert str(err.value).startswith(f"{srv.target} does not speak TLS"), err.value
