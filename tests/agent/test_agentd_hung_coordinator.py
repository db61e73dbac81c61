"""How the daemon's health reports to coordinators are paced and ended.

- A coordinator that accepts the daemon's health report and never answers (its host frozen, its process
  SIGSTOPped, a partition after the connection was up) must not hold the daemon: a DetachJob of the job whose
  coordinator hangs answers at once, and SIGTERM stops the daemon at once, not after `coordinator.timeout_s`.
- `systemctl reload` applies a new `coordinator.heartbeat_interval_s` now, not after the old interval, and the
  contents of the coordinators' TLS files rotated in place.
- An address where no coordinator serves is named as a wrong address.

Real processes and sockets: the daemon started as the shipped unit starts it, and real gRPC servers in the test
standing for the coordinators (one whose ReportNodeHealth blocks until the test ends, one that answers).
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from agentd_unit import UnitDaemon, clean_env, pcie_daemon_config, wait_until
from trainguard.proto import agent_pb2, agent_pb2_grpc, coordinator_pb2

pytestmark = pytest.mark.timeout(120)


class HangingCoordinator:
    """A gRPC server whose ``Coordinator.ReportNodeHealth`` never answers (``answer``: answers at once); counts
    the calls that reached it."""

    def __init__(self, answer: bool = False) -> None:
        self.release = threading.Event()
        if answer:
            self.release.set()
        self.calls: list[str] = []  # the reports in flight or ended, as text (the node id is in it)
        self._lock = threading.Lock()

        def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.calls.append(request.decode(errors="replace"))
            self.release.wait(600)
            return coordinator_pb2.NodeHealthReportResponse().SerializeToString()

        handler = grpc.method_handlers_generic_handler("trainguard.v1.Coordinator", {
            "ReportNodeHealth": grpc.unary_unary_rpc_method_handler(hang)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((handler,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def reports_from(self, node: str) -> int:
        """How many reports naming ``node`` reached the server."""
        with self._lock:
            return sum(1 for c in self.calls if node in c)

    def close(self) -> None:
        self.release.set()
        self.server.stop(grace=None)


def test_a_coordinator_that_never_answers_holds_neither_detach_job_nor_the_stop(tmp_path: Path, tg_env: dict):
    configured, joined = HangingCoordinator(), HangingCoordinator()
    (tmp_path / "sysfs").mkdir()
    # The longest deadline the config allows: before the fix each hung report held the daemon that long.
    daemon = UnitDaemon(tmp_path / "daemon", pcie_daemon_config("hung-n1", tmp_path / "sysfs", f"""[coordinator]
address = "{configured.address}"
timeout_s = 600
"""), clean_env(tg_env))
    try:
        daemon.wait_ready()
        wait_until(lambda: configured.reports_from("hung-n1") > 0, 30, "a report to the configured coordinator")
        with grpc.insecure_channel(f"unix:{daemon.socket_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            stub.AttachJob(agent_pb2.AttachJobRequest(job="hung-job", launcher_pid=os.getpid(), node_id="hung-n2",
                                                      coordinator=joined.address), timeout=10)
            wait_until(lambda: joined.reports_from("hung-n2") > 0, 30, "a report to the job's coordinator")
            # The job's reporter is stopped while its report hangs: the launcher's DetachJob must still answer.
            stub.DetachJob(agent_pb2.DetachJobRequest(job="hung-job", launcher_pid=os.getpid(), ended=True),
                           timeout=20)
        daemon.proc.terminate()
        assert daemon.proc.wait(30) == 0, daemon.log()[-3000:]
        log = daemon.log()
        assert "Traceback" not in log, log[-3000:]
        # Ending a call on purpose is not the coordinator being unreachable.
        assert "unreachable" not in log, log[-3000:]
    finally:
        daemon.close()
        configured.close()
        joined.close()


def test_a_reload_applies_a_shorter_heartbeat_interval_at_once(tmp_path: Path, tg_env: dict):
    """The reporters took a reloaded interval only after their next report, so lowering it from 600 s waited up to
    600 s (for ever while the coordinator was unreachable: only an answer set it)."""
    coordinator = HangingCoordinator(answer=True)
    (tmp_path / "sysfs").mkdir()

    def config(interval_s: float) -> str:
        return pcie_daemon_config("paced-n1", tmp_path / "sysfs", f"""[coordinator]
address = "{coordinator.address}"
heartbeat_interval_s = {interval_s}
""")

    daemon = UnitDaemon(tmp_path / "daemon", config(600), clean_env(tg_env))
    try:
        daemon.wait_ready()
        wait_until(lambda: coordinator.reports_from("paced-n1") > 0, 30, "the first report")
        (tmp_path / "daemon" / "agent.toml").write_text(config(0.2))
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_log("configuration reloaded")
        wait_until(lambda: coordinator.reports_from("paced-n1") >= 4, 30, "reports at the reloaded interval")
    finally:
        daemon.close()
        coordinator.close()


def test_a_reload_presents_the_rotated_client_certificate_to_the_coordinators(tmp_path: Path, tg_env: dict):
    """Client certificates for the coordinators (`coordinator.tls_cert_file`) are rotated in place, like the
    daemon's own `tls.*` files; `systemctl reload` kept presenting the old one until a restart, so once it expired
    (or, here, was refused) the node went unreported. A real `trainguard coordinator` with mutual TLS."""
    import shutil
    import subprocess
    import sys

    from agent_testutil import make_pki

    pki = make_pki(tmp_path / "pki")
    env = clean_env(tg_env)
    port_file = tmp_path / "coordinator.port"
    coord = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "rotate-job", "--listen", "127.0.0.1:0",
         "--store", "memory://", "--port-file", str(port_file), "--tls-cert", str(pki.server_cert),
         "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "coordinator.log", "wb"))
    # The daemon starts with a certificate the coordinator refuses (another CA), then gets a good one in place.
    cert, key = tmp_path / "node.pem", tmp_path / "node.key"
    shutil.copyfile(pki.rogue_cert, cert)
    shutil.copyfile(pki.rogue_key, key)
    (tmp_path / "sysfs").mkdir()
    daemon = None
    try:
        wait_until(lambda: port_file.exists() or coord.poll() is not None, 30, "the coordinator's port")
        assert coord.poll() is None, (tmp_path / "coordinator.log").read_text()
        address = f"localhost:{int(port_file.read_text())}"
        daemon = UnitDaemon(tmp_path / "daemon", pcie_daemon_config("rotated-n1", tmp_path / "sysfs", f"""
[coordinator]
address = "{address}"
heartbeat_interval_s = 0.2
tls_ca_file = "{pki.ca}"
tls_cert_file = "{cert}"
tls_key_file = "{key}"
"""), env)
        daemon.wait_ready()
        # The refusal names the certificate to fix (fd0e35e; before, "unreachable ... Socket closed").
        daemon.wait_log(f"coordinator {address} (config) refuses node rotated-n1's health reports")
        shutil.copyfile(pki.client_cert, cert)
        shutil.copyfile(pki.client_key, key)
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_log("configuration reloaded")
        daemon.wait_log(f"reporting node rotated-n1 health to coordinator {address} (config)")
    finally:
        if daemon is not None:
            daemon.close()
        coord.terminate()
        coord.wait(15)


def test_an_address_that_serves_no_coordinator_is_named_as_such(tmp_path: Path, tg_env: dict):
    """`coordinator.address` naming a gRPC port that is no coordinator's (the coordinator's plaintext
    --health-listen port, another node's agent) was logged as "the coordinator has no ReportNodeHealth: upgrade
    it", sending the operator after an upgrade instead of the address."""
    from grpc_health.v1 import health, health_pb2_grpc

    health_only = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), health_only)
    address = f"127.0.0.1:{health_only.add_insecure_port('127.0.0.1:0')}"
    health_only.start()
    (tmp_path / "sysfs").mkdir()
    daemon = UnitDaemon(tmp_path / "daemon", pcie_daemon_config("wrong-n1", tmp_path / "sysfs", f"""[coordinator]
address = "{address}"
"""), clean_env(tg_env))
    try:
        daemon.wait_ready()
        daemon.wait_log(f"coordinator {address} (config) refuses")
        line = next(line for line in daemon.log().splitlines() if f"coordinator {address} (config) refuses" in line)
        assert "UNIMPLEMENTED" in line and "check the address" in line, line
    finally:
        daemon.close()
        health_only.stop(grace=None)
