"""The agent daemon as systemd runs it: a real subprocess, a notify socket the test owns, real signals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from agent_testutil import make_pki
from trainguard.agent.tls import TlsFiles, channel_credentials
from trainguard.proto import agent_pb2, agent_pb2_grpc

AGENT = [sys.executable, "-m", "trainguard.cli", "agent"]


class Agent:
    """One ``trainguard agent`` subprocess with its notify socket; always killed on teardown."""

    def __init__(self, tmp: Path, config_text: str, watchdog_usec: int | None = 1_000_000, extra_env=None):
        self.tmp = tmp
        self.config = tmp / "agent.toml"
        if "[memory_tier]" not in config_text:  # the daemon holds its root: /dev/shm/trainguard is the whole box's
            config_text += f'\n[memory_tier]\nroot = "{tmp / "shm"}"\n'
        self.config.write_text(config_text)
        self.socket_path = tmp / "run" / "agent.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify.sock"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "NOTIFY_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = str(tmp / "notify.sock")
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        env.update(extra_env or {})
        self.stderr = open(tmp / "agent.log", "wb")
        self.proc = subprocess.Popen(
            [*AGENT, "--config", str(self.config), "--socket", str(self.socket_path), "--state-dir",
             str(tmp / "state"), "--grpc-listen", "127.0.0.1:0"],
            env=env, stdout=subprocess.DEVNULL, stderr=self.stderr,
        )
        self.messages: list[dict[str, str]] = []

    def log(self) -> str:
        return (self.tmp / "agent.log").read_text(errors="replace")

    def wait_for(self, key: str, timeout: float = 30.0) -> dict[str, str]:
        """Reads notifications until one carries ``key``; returns its fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.notify.settimeout(max(0.01, min(1.0, deadline - time.monotonic())))
            try:
                data = self.notify.recv(4096).decode()
            except socket.timeout:
                if self.proc.poll() is not None:
                    raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log()}") from None
                continue
            fields = dict(line.split("=", 1) for line in data.splitlines())
            self.messages.append(fields)
            if key in fields:
                return fields
        raise AssertionError(f"no {key} within {timeout}s; got {self.messages}\n{self.log()}")

    @property
    def tcp_port(self) -> int:
        status = next(m["STATUS"] for m in reversed(self.messages) if "tcp:" in m.get("STATUS", ""))
        return int(re.search(r"tcp:(\d+)", status).group(1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.notify.close()
        self.stderr.close()


@pytest.fixture
def agents(tmp_path):
    started: list[Agent] = []

    def start(config_text: str = "", **kw) -> Agent:
        d = tmp_path / f"a{len(started)}"
        d.mkdir()
        a = Agent(d, config_text, **kw)
        started.append(a)
        return a

    yield start
    for a in started:
        a.close()


BASE = """
[metrics]
listen = "127.0.0.1:0"
[log]
format = "journal"
[detectors]
root = "{root}"
"""


def health(target: str, creds=None, **kw) -> agent_pb2.NodeHealth:
    channel = grpc.secure_channel(target, creds, kw.get("options", [])) if creds else grpc.insecure_channel(target)
    with channel:
        return agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=5)


def test_systemd_lifecycle_ready_watchdog_reload_stop(agents, tmp_path):
    (tmp_path / "fake").mkdir()
    agent = agents(BASE.format(root=tmp_path / "fake"))
    ready = agent.wait_for("READY")
    assert "serving on unix:" in ready["STATUS"]
    mode = os.stat(agent.socket_path).st_mode & 0o777
    assert mode == 0o660, oct(mode)
    assert os.stat(agent.socket_path.parent).st_mode & 0o007 == 0  # folder closed to other users too
    assert health(f"unix:{agent.socket_path}").node_id
    # Keep-alives while healthy (every 0.5 s for the 1 s interval; each bounded here with slack for a loaded box).
    agent.wait_for("WATCHDOG", timeout=5)
    agent.wait_for("WATCHDOG", timeout=5)
    # SIGHUP: RELOADING=1 with a monotonic timestamp, a new log level applied, READY=1 again.
    agent.config.write_text(agent.config.read_text().replace('format = "journal"', 'format = "journal"\nlevel = "debug"'))
    agent.proc.send_signal(signal.SIGHUP)
    reloading = agent.wait_for("RELOADING", timeout=10)
    assert int(reloading["MONOTONIC_USEC"]) > 0
    agent.wait_for("READY", timeout=10)
    assert "configuration reloaded" in agent.log()
    # SIGTERM: STOPPING=1, clean exit, nothing left behind.
    pid = agent.proc.pid
    children = psutil.Process(pid).children(recursive=True)
    agent.proc.send_signal(signal.SIGTERM)
    agent.wait_for("STOPPING", timeout=10)
    assert agent.proc.wait(30) == 0, agent.log()
    assert not agent.socket_path.exists()
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert "Traceback" not in agent.log()
    # journald format: every line has a priority prefix and no timestamp of its own.
    assert all(re.match(r"<[0-7]>", line) for line in agent.log().splitlines() if line), agent.log()


def test_bad_reload_keeps_running_config(agents, tmp_path):
    agent = agents(BASE.format(root=tmp_path), watchdog_usec=None)
    agent.wait_for("READY")
    agent.config.write_text(agent.config.read_text() + "\n[grpc]\nbogus = 1\n")
    agent.proc.send_signal(signal.SIGHUP)
    agent.wait_for("RELOADING", timeout=10)
    assert "reload failed" in agent.wait_for("READY", timeout=10)["STATUS"]
    assert health(f"unix:{agent.socket_path}").node_id
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[grpc]\nmax_workers = "many"\n', "grpc.max_workers: expected an integer"),
        ("[grpc]\nlisten_on = 1\n", "unknown key 'listen_on' in [grpc]"),
        ('[tls]\nenabled = true\ncert_file = "/nonexistent/cert.pem"\nkey_file = "/nonexistent/key.pem"\n',
         "tls.cert_file: cannot read /nonexistent/cert.pem"),
        ('[detectors]\nenabled = ["host", "nosuch"]\n', "unknown detector 'nosuch'"),
        # Readable but no PEM: found only when the reporter's channel is built; it named the file, not the key.
        ('[coordinator]\naddress = "127.0.0.1:1"\ntls_ca_file = "/proc/version"\n',
         "coordinator.tls_ca_file: CA file /proc/version: not a PEM CA bundle"),
        # Below what AttachJob must take (a job's CA bundle): gRPC dropped the attachments of such jobs.
        ("[grpc]\nmax_message_bytes = 65536\n", "grpc.max_message_bytes: 65536 is below the 3211264 bytes"),
    ],
)
def test_bad_config_fails_at_start_with_one_line(agents, text, needle):
    agent = agents(text, watchdog_usec=None)
    assert agent.proc.wait(60) == 2
    err = agent.log().strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err and str(agent.config) in err
    agent.notify.settimeout(0.1)
    with pytest.raises(socket.timeout):
        agent.notify.recv(100)  # never READY


def test_mutual_tls_on_the_daemon(agents, tmp_path):
    pki = make_pki(tmp_path / "pki")
    agent = agents(BASE.format(root=tmp_path) + f"""
[tls]
enabled = true
cert_file = "{pki.server_cert}"
key_file = "{pki.server_key}"
client_ca_file = "{pki.ca}"
""", watchdog_usec=None)
    agent.wait_for("READY")
    target = f"127.0.0.1:{agent.tcp_port}"
    opts = {"options": [("grpc.ssl_target_name_override", "localhost")]}
    good = channel_credentials(TlsFiles(str(pki.client_cert), str(pki.client_key), str(pki.ca)))
    assert health(target, good, **opts).node_id
    rogue = channel_credentials(TlsFiles(str(pki.rogue_cert), str(pki.rogue_key), str(pki.ca)))
    for creds in (rogue, None):
        with pytest.raises(grpc.RpcError) as err:
            health(target, creds, **opts)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    tls = ["--target", target, "--ca", str(pki.ca), "--server-name", "localhost"]
    ok = cli("status", *tls, "--cert", str(pki.client_cert), "--key", str(pki.client_key))
    assert ok.returncode == 0 and "agent.started" in ok.stdout, ok.stderr
    refused = cli("status", *tls, "--cert", str(pki.rogue_cert), "--key", str(pki.rogue_key), "--timeout", "2")
    assert refused.returncode == 2 and "UNAVAILABLE" in refused.stderr
    # SIGHUP rotates the server certificate (here to one from CA 2) without restarting the listener.
    agent.config.write_text(agent.config.read_text().replace(str(pki.server_cert), str(pki.server2_cert))
                            .replace(str(pki.server_key), str(pki.server2_key)))
    agent.proc.send_signal(signal.SIGHUP)
    agent.wait_for("RELOADING", timeout=10)
    assert "reload failed" not in agent.wait_for("READY", timeout=10).get("STATUS", "")
    rotated = channel_credentials(TlsFiles(str(pki.client_cert), str(pki.client_key), str(pki.other_ca)))
    assert health(target, rotated, **opts).node_id
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def interrupt_and_reap(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """Ends a ``--watch``/``--follow`` child as a user does (Ctrl-C) and reaps it, whatever happens: killed and
    reaped when still running after ``timeout`` (generous: the interpreter may still be starting on a loaded box).
    Returns its exit status after the interrupt, or None when it had to be killed."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:  # timed out, or interrupted while waiting: never leave it running
            proc.kill()
            proc.wait()


def test_a_watcher_that_ignores_the_interrupt_is_killed_and_reaped() -> None:
    """Found by review: a `status --watch` child that had not ended within the test's 10 s after SIGINT (a loaded
    box) was left running (13 min later still there); the helper the watch tests end their children with kills
    and reaps it instead."""
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        assert interrupt_and_reap(proc, timeout=0.5) is None
        assert proc.returncode == -signal.SIGKILL  # reaped: no zombie, nothing left running
    finally:
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_and_events_cli(agents, tmp_path):
    agent = agents(BASE.format(root=tmp_path), watchdog_usec=None)
    agent.wait_for("READY")
    sock = ["--socket", str(agent.socket_path)]
    table = cli("status", *sock)
    assert table.returncode == 0, table.stderr
    assert "trainguard" in table.stdout and "agent.started" in table.stdout and "no workers" in table.stdout
    assert "health: server ok" in table.stdout and "metrics ok" in table.stdout
    as_json = cli("status", "--json", "--target", f"127.0.0.1:{agent.tcp_port}")
    assert as_json.returncode == 0, as_json.stderr
    import json

    doc = json.loads(as_json.stdout)
    assert doc["node_id"] and "agent.started" in [e["kind"] for e in doc["recent_events"]]
    assert doc["health_services"][""] == "SERVING"
    assert doc["health_services"]["trainguard.agent.detector.host"] in ("SERVING", "NOT_SERVING")
    events = cli("events", *sock, "--json")
    kinds = [json.loads(line)["kind"] for line in events.stdout.splitlines()]
    assert kinds.count("agent.started") == 1
    # --follow: replayed events, then a new one caused by SIGHUP, each once.
    follow = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "events", "--follow", *sock],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()

    def wait_line(kind: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(kind in line for line in lines):
            time.sleep(0.05)
        assert any(kind in line for line in lines), lines

    try:
        wait_line("agent.started")
        agent.proc.send_signal(signal.SIGHUP)
        wait_line("agent.reloaded")
    finally:
        follow.kill()
        follow.wait()  # SIGKILL: it ends; a bounded wait only risked leaving it unreaped
    assert sum("agent.started" in line for line in lines) == 1
    # `--follow | head -1`: head exits after the replayed event; the follower must notice the closed pipe at
    # once (no new event will come to write into it) and end with the pipe's 141, no traceback.
    piped = subprocess.run(
        ["bash", "-c", 'set -o pipefail; "$0" -m trainguard.cli events --follow --socket "$1" | head -1',
         sys.executable, str(agent.socket_path)], capture_output=True, text=True, timeout=60)
    assert piped.returncode == 141, (piped.returncode, piped.stderr)
    assert len(piped.stdout.splitlines()) == 1 and "Traceback" not in piped.stderr, piped.stdout
    # --watch refreshes until interrupted.
    watch = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "status", "--watch", "0.2", *sock],
                             stdout=subprocess.PIPE, text=True)
    shown: list[str] = []
    try:
        reader = threading.Thread(target=lambda: shown.extend(iter(watch.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(line.startswith("node ") for line in shown) < 2:
            time.sleep(0.05)
    finally:
        status = interrupt_and_reap(watch)  # reaped even when the wait above raised
    assert status == 0, status
    reader.join(30)
    assert sum(line.startswith("node ") for line in shown) >= 2, shown
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0
    gone = cli("status", *sock, "--timeout", "1")
    assert gone.returncode == 2 and len(gone.stderr.strip().splitlines()) == 1
    assert "no node agent answers at unix:" in gone.stderr


def test_status_watch_json_keeps_stdout_json_while_the_agent_is_down(agents, tmp_path):
    """`status --watch --json` promises one JSON object per line; while the agent was unreachable (restarting) it
    printed "trainguard: no node agent answers ..." on stdout among them, and a `| jq` consumer broke on it. The
    note goes to stderr now, as `events --follow` does its reconnection notes."""
    agent = agents(BASE.format(root=tmp_path), watchdog_usec=None)
    agent.wait_for("READY")
    watch = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "status", "--watch", "0.1", "--json",
                              "--timeout", "1", "--socket", str(agent.socket_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(iter(watch.stdout.readline, "")), daemon=True),
               threading.Thread(target=lambda: err.extend(iter(watch.stderr.readline, "")), daemon=True)]
    for r in readers:
        r.start()

    def wait(cond, what: str) -> None:
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline and watch.poll() is None, f"{what}: out={out[-3:]} err={err[-3:]}"
            time.sleep(0.05)

    try:
        wait(lambda: len(out) >= 1, "a first health document")
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(30) == 0
        seen = len(out)
        # Two refreshes after the agent is gone: the watcher saw it unreachable (on one stream or the other).
        wait(lambda: len(out) + sum("no node agent answers" in line for line in err) >= seen + 2,
             "refreshes while the agent is down")
    finally:
        status = interrupt_and_reap(watch)
        for r in readers:
            r.join(30)
    assert status == 0, (status, err)
    import json

    for line in out:
        assert json.loads(line)["node_id"], line
    assert any("no node agent answers" in line for line in err), err


def test_a_removed_socket_file_is_noticed_and_the_agent_restarted(agents, tmp_path):
    """The unix socket is how launchers and `trainguard status` reach the agent. Removed by hand (a cleanup of
    /run) it cannot be bound again by the running server, and the self-check went on answering over its own
    connection made before: the watchdog was fed, health said SERVING, and every launcher ran alone unnoticed.
    Now health (the kubelet's liveness probe) says NOT_SERVING and the watchdog stops, so the agent is restarted."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    agent = agents(BASE.format(root=tmp_path) + "[agent]\nloop_interval_s = 0.1\n")
    agent.wait_for("READY")
    agent.wait_for("WATCHDOG", timeout=10)
    os.unlink(agent.socket_path)

    def overall() -> int:
        with grpc.insecure_channel(f"127.0.0.1:{agent.tcp_port}") as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    deadline = time.monotonic() + 20
    while overall() == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, agent.log()[-2000:]
        time.sleep(0.05)
    assert "was removed" in agent.log()
    # No keep-alive from then on (the interval is 1 s: one would come every 0.5 s).
    agent.notify.settimeout(0.2)
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        try:
            data = agent.notify.recv(4096).decode()
        except socket.timeout:
            continue
        assert "WATCHDOG=1" not in data, data
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0
