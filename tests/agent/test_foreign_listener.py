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


# -- TLS trust and plaintext against TLS (a coordinator that starts after the node: the launcher's one-off probe
# of the coordinator found nobody, and the link's registration retried until join_timeout) -----------------------


@pytest.fixture
def pki(tmp_path: Path):
    from agent_testutil import make_pki

    return make_pki(tmp_path / "pki")


def _tls_coordinator(cert: Path, key: Path):
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery import CoordinatorServer, JobSpec
    from trainguard.recovery.rpc_security import RpcSecurity

    return CoordinatorServer(JobSpec(job="foreign", nnodes=1), listen="127.0.0.1:0",
                             security=RpcSecurity(tls=TlsFiles(str(cert), str(key), ""))).start()


def _open_with(target: str, ca: str = "", server_name: str = "", patience_s: float = 8.0) -> tuple[str, float]:
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery.rpc_security import RpcSecurity

    client = RpcSecurity(tls=TlsFiles("", "", ca), server_name=server_name)
    link = GrpcCoordinatorLink(LinkConfig(job="foreign", coordinator=target, node_id="n1", patience_s=patience_s,
                                          channel=client.channel))
    start = time.monotonic()
    try:
        with pytest.raises(CoordinatorUnavailableError) as err:
            link.open()
        return str(err.value), time.monotonic() - start
    finally:
        link.close()


def test_a_node_whose_ca_did_not_sign_the_coordinators_certificate_is_told_at_once(pki) -> None:
    """gRPC reports CERTIFICATE_VERIFY_FAILED on every try; the node said "not reachable yet" until join_timeout."""
    srv = _tls_coordinator(pki.server2_cert, pki.server2_key)  # signed by ca2; the node trusts ca1
    try:
        message, took = _open_with(srv.target, ca=str(pki.ca))
    finally:
        srv.stop()
    assert took < 5.0, f"waited {took:.1f}s: {message}"
    assert message.startswith(f"TLS with the coordinator {srv.target} failed (certificate verify failed"), message
    assert "--coordinator-ca" in message and "\n" not in message, message


def test_a_coordinator_certificate_for_another_host_name_is_told_at_once(pki) -> None:
    srv = _tls_coordinator(pki.server2_cert, pki.server2_key)
    try:
        message, took = _open_with(srv.target, ca=str(pki.other_ca), server_name="elsewhere.example")
    finally:
        srv.stop()
    assert took < 5.0, f"waited {took:.1f}s: {message}"
    assert "names another host" in message and "--coordinator-server-name" in message, message


def test_a_plaintext_node_dialling_a_tls_coordinator_is_told_at_once(pki) -> None:
    """gRPC says only "Socket closed" (as for a coordinator killed mid-connection); a TLS handshake tells."""
    srv = _tls_coordinator(pki.server_cert, pki.server_key)
    try:
        message, took = _open(srv.target, patience_s=8.0)
    finally:
        srv.stop()
    assert took < 5.0, f"waited {took:.1f}s: {message}"
    assert message.startswith(f"{srv.target} serves TLS but this node dials it in plaintext"), message
    assert "--coordinator-ca" in message and "\n" not in message, message


def test_speaks_tls_tells_a_tls_server_from_a_plaintext_one_and_from_nobody(pki) -> None:
    from trainguard.agent.coordinator_link import find_free_port, speaks_tls
    from trainguard.recovery import CoordinatorServer, JobSpec

    tls = _tls_coordinator(pki.server_cert, pki.server_key)
    plain = CoordinatorServer(JobSpec(job="foreign", nnodes=1), listen="127.0.0.1:0").start()
    try:
        assert speaks_tls(tls.target)
        assert not speaks_tls(plain.target)
        assert not speaks_tls(f"127.0.0.1:{find_free_port('127.0.0.1')}")
    finally:
        tls.stop()
        plain.stop()


def test_a_plaintext_node_still_waits_for_a_plaintext_coordinator_that_starts_late() -> None:
    """A coordinator restarting (nobody at the port, then a plaintext coordinator there) is waited for."""
    from trainguard.agent.coordinator_link import find_free_port
    from trainguard.recovery import CoordinatorServer, JobSpec
    from trainguard.recovery.errors import CoordinatorError

    port = find_free_port("127.0.0.1")
    link = GrpcCoordinatorLink(LinkConfig(job="foreign", coordinator=f"127.0.0.1:{port}", node_id="n1",
                                          patience_s=20.0))
    servers = []

    def start_late() -> None:
        # Retried: the port was free when picked, and a connection's source port may hold it for a moment.
        deadline = time.monotonic() + 5.0
        while not servers:
            try:
                servers.append(CoordinatorServer(JobSpec(job="foreign", nnodes=1), listen=f"127.0.0.1:{port}").start())
            except CoordinatorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    starter = threading.Timer(1.0, start_late)
    starter.start()
    try:
        link.open()
        assert link.lease
    finally:
        starter.join()
        link.close()
        for s in servers:
            s.stop()


def test_the_daemons_reporter_names_a_ca_that_does_not_fit(pki) -> None:
    """The daemon's health reports to a coordinator whose certificate its CA did not sign: REFUSED with what to
    do, not "unreachable" with gRPC's whole error as for an outage."""
    from trainguard.agent.coordinator_report import CoordinatorReporter, NodeVerdict, ReporterState, ReportTarget
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery.node_health import Verdict
    from trainguard.recovery.rpc_security import RpcSecurity

    srv = _tls_coordinator(pki.server2_cert, pki.server2_key)
    reporter = CoordinatorReporter(ReportTarget(srv.target, security=RpcSecurity(tls=TlsFiles("", "", str(pki.ca)))),
                                   lambda: NodeVerdict(Verdict.HEALTHY), "n1", "h1", "i1", interval_s=0.2).start()
    try:
        from tg_testutil import until

        assert until(lambda: reporter.state is not ReporterState.CONNECTING, 5.0)
        assert reporter.state is ReporterState.REFUSED, (reporter.state, reporter.message)
        assert "does not trust its certificate" in reporter.message, reporter.message
    finally:
        reporter.stop()
        srv.stop()


def test_trainguard_run_in_plaintext_against_a_tls_coordinator_exits_2_at_once(pki, tg_env: dict,
                                                                              tmp_path: Path) -> None:
    srv = _tls_coordinator(pki.server_cert, pki.server_key)
    try:
        start = time.monotonic()
        r = run_cli(["run", "--coordinator", srv.target, "--job", "foreign", "--nproc-per-node", "1",
                     "--rdzv-conf", "join_timeout=30", HELLO, str(tmp_path)], tg_env, timeout=60)
        took = time.monotonic() - start
    finally:
        srv.stop()
    errors = [line for line in r.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert r.returncode == 2 and took < 20, (r.returncode, took, r.stderr[-2000:])
    assert len(errors) == 1 and "serves TLS but this node dials it in plaintext" in errors[0], r.stderr[-2000:]


def _mtls_coordinator(pki):
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery import CoordinatorServer, JobSpec
    from trainguard.recovery.rpc_security import RpcSecurity

    return CoordinatorServer(JobSpec(job="foreign", nnodes=1), listen="127.0.0.1:0", security=RpcSecurity(
        tls=TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)))).start()


@pytest.mark.parametrize("cert", ["none", "rogue"])
def test_a_node_without_a_client_certificate_the_coordinator_accepts_is_told_at_once(pki, cert: str) -> None:
    """A coordinator demanding mutual TLS closes the connection of a node without a certificate from its client
    CA: gRPC says "Socket closed" (as for a coordinator killed mid-connection) and the node waited until
    join_timeout. The node's own handshake shows the coordinator alive and refusing the certificate."""
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery.rpc_security import RpcSecurity

    srv = _mtls_coordinator(pki)
    files = TlsFiles(str(pki.rogue_cert), str(pki.rogue_key), str(pki.ca)) if cert == "rogue" \
        else TlsFiles("", "", str(pki.ca))
    link = GrpcCoordinatorLink(LinkConfig(job="foreign", coordinator=srv.target, node_id="n1", patience_s=8.0,
                                          channel=RpcSecurity(tls=files).channel))
    start = time.monotonic()
    try:
        with pytest.raises(CoordinatorUnavailableError) as err:
            link.open()
    finally:
        link.close()
        srv.stop()
    took, message = time.monotonic() - start, str(err.value)
    assert took < 5.0, f"waited {took:.1f}s: {message}"
    assert message.startswith(f"TLS with the coordinator {srv.target} failed") and "--coordinator-cert" in message
    assert ("sends none" in message) == (cert == "none"), message


def test_client_cert_refused_is_false_for_an_accepted_certificate_and_for_nobody(pki) -> None:
    from trainguard.agent.coordinator_link import client_cert_refused, find_free_port

    srv = _mtls_coordinator(pki)
    try:
        assert not client_cert_refused(srv.target, str(pki.client_cert), str(pki.client_key))
        assert client_cert_refused(srv.target)
    finally:
        srv.stop()
    assert not client_cert_refused(f"127.0.0.1:{find_free_port('127.0.0.1')}")


def test_trainguard_runs_probe_names_a_refused_client_certificate(pki) -> None:
    """The launcher's probe only warned ("closed the connection while it was set up: if it serves TLS...")."""
    from trainguard.agent.run_deploy import probe_coordinator
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError

    srv = _mtls_coordinator(pki)
    try:
        with pytest.raises(SecurityConfigError, match="demands a client certificate"):
            probe_coordinator(RpcSecurity(tls=TlsFiles("", "", str(pki.ca))), srv.target)
    finally:
        srv.stop()


@pytest.mark.parametrize("case", ["plaintext", "no_client_cert"])
def test_the_daemons_reporter_names_tls_it_lacks(pki, case: str) -> None:
    """The daemon's reports to a TLS coordinator in plaintext, or without the client certificate it demands:
    "unreachable: UNAVAILABLE: ... Socket closed", as for an outage. REFUSED now, with what to do."""
    from tg_testutil import until
    from trainguard.agent.coordinator_report import CoordinatorReporter, NodeVerdict, ReporterState, ReportTarget
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery.node_health import Verdict
    from trainguard.recovery.rpc_security import RpcSecurity

    srv = _tls_coordinator(pki.server_cert, pki.server_key) if case == "plaintext" else _mtls_coordinator(pki)
    security = RpcSecurity() if case == "plaintext" else RpcSecurity(tls=TlsFiles("", "", str(pki.ca)))
    reporter = CoordinatorReporter(ReportTarget(srv.target, security=security),
                                   lambda: NodeVerdict(Verdict.HEALTHY), "n1", "h1", "i1", interval_s=0.2).start()
    try:
        assert until(lambda: reporter.state is not ReporterState.CONNECTING, 5.0)
        assert reporter.state is ReporterState.REFUSED, (reporter.state, reporter.message)
        word = "dials it in plaintext" if case == "plaintext" else "demands a client certificate"
        assert word in reporter.message, reporter.message
    finally:
        reporter.stop()
        srv.stop()


def test_operator_commands_name_a_foreign_listener_instead_of_no_agent_or_raw_grpc(
        plain_tcp, grpc_without_coordinator, capsys) -> None:
    """`trainguard status --target` at a coordinator or an HTTP server said "no node agent answers", which the README
    says means nothing listens there; `uncordon --coordinator` at the wrong port printed gRPC's raw error."""
    from trainguard.cli import main

    for port, said in ((plain_tcp.port, "HTTP/2"), (grpc_without_coordinator, "NodeAgent service")):
        target = f"127.0.0.1:{port}"
        for command in (["status", "--target", target], ["events", "--target", target]):
            assert main(command) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"trainguard: error: {target} is not a trainguard node agent"), err
            assert said in err and "--target" in err and "\n" not in err, err
    for port, said in ((plain_tcp.port, "HTTP/2"), (grpc_without_coordinator, "Coordinator service")):
        target = f"127.0.0.1:{port}"
        assert main(["uncordon", "n1", "--job", "j", "--coordinator", target]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{target} is not a trainguard coordinator" in err and said in err, err
        assert "point --coordinator at" in err and "\n" not in err, err


def test_the_daemons_coordinator_reports_name_a_plain_tcp_server_at_the_address(plain_tcp) -> None:
    """The daemon's [coordinator] address at an HTTP server was "unreachable", retried for ever as an outage."""
    from tg_testutil import until
    from trainguard.agent.coordinator_report import CoordinatorReporter, NodeVerdict, ReporterState, ReportTarget
    from trainguard.recovery.node_health import Verdict

    target = f"127.0.0.1:{plain_tcp.port}"
    reporter = CoordinatorReporter(ReportTarget(target), lambda: NodeVerdict(Verdict.HEALTHY), "n1", "h1", "i1",
                                   interval_s=0.2).start()
    try:
        assert until(lambda: reporter.state is not ReporterState.CONNECTING, 5.0)
        assert reporter.state is ReporterState.REFUSED, (reporter.state, reporter.message)
        assert reporter.message.startswith(f"{target} is not a trainguard coordinator"), reporter.message
        assert "coordinator.address" in reporter.message, reporter.message
    finally:
        reporter.stop()


def test_status_says_why_the_daemons_coordinator_is_not_serving(tmp_path: Path, grpc_without_coordinator,
                                                               capsys) -> None:
    """`trainguard status` showed "coordinator not_serving" and the reason (here: no coordinator at that address)
    was only in the daemon's journal."""
    from tg_testutil import until
    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.sdnotify import SystemdNotifier
    from trainguard.cli import main

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path / "fake"}"\n[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n'
                      f'[coordinator]\naddress = "127.0.0.1:{grpc_without_coordinator}"\nheartbeat_interval_s = 0.2\n')
    daemon = AgentDaemon(config_loader(str(config), "", str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    try:
        assert until(lambda: "coordinator" in daemon.subsystem_details(), 20.0), daemon.subsystem_details()
        daemon._refresh()
        assert main(["status", "--socket", str(tmp_path / "agent.sock")]) == 0
        out = capsys.readouterr().out
        assert "coordinator not_serving" in out, out
        why = [line for line in out.splitlines() if line.startswith("  coordinator: ")]
        assert len(why) == 1 and f"127.0.0.1:{grpc_without_coordinator}: refused: UNIMPLEMENTED" in why[0], out
        assert "predictor: " not in out  # only subsystems that are not serving get a line
    finally:
        daemon.stop()
