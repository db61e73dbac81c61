"""The node daemon started the way the shipped systemd unit starts it, without systemd.

`ExecStart=` and `Environment=` are read from ``deploy/trainguard-agent.service``; only what systemd itself
would supply is substituted: the console script's path (the unit names
`trainguard` without a folder), the configuration
path (``--config``), ``${RUNTIME_DIRECTORY}`` and ``${STATE_DIRECTORY}`` (per-test folders), and
``$NOTIFY_SOCKET`` (a datagram socket the test reads READY=1 from). Imported by name by the agent tests.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "trainguard-agent.service"


def unit_command(config: Path, runtime_dir: Path, state_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart as argv (with the substitutions above) and its Environment= variables."""
    text = UNIT.read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", text, re.M).group(1)
    exec_start = exec_start.replace("${RUNTIME_DIRECTORY}", str(runtime_dir)).replace(
        "${STATE_DIRECTORY}", str(state_dir))
    argv = shlex.split(exec_start)
    assert argv[0] == "trainguard", argv
    argv[0] = str(Path(sys.executable).with_name("trainguard"))
    argv[argv.index("--config") + 1] = str(config)
    env = dict(kv.split("=", 1) for kv in re.findall(r"^Environment=(\S+)$", text, re.M))
    return argv, env


class UnitDaemon:
    """``trainguard agent`` as the unit runs it; killed on :meth:`close`.

    Args:
        tmp: a folder of its own (config, runtime and state folders, log, notify socket).
        config_text: the agent.toml contents.
        env: the base environment (the test's).
    """

    def __init__(self, tmp: Path, config_text: str, env: dict[str, str]) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.runtime = tmp / "run"
        self.runtime.mkdir(mode=0o750, exist_ok=True)
        config = tmp / "agent.toml"
        if "[memory_tier]" not in config_text:  # the daemon holds its root: /dev/shm/trainguard is the whole box's
            config_text += f'\n[memory_tier]\nroot = "{tmp / "shm"}"\n'
        config.write_text(config_text)
        argv, unit_env = unit_command(config, self.runtime, tmp / "state")
        self.socket_path = self.runtime / "agent.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify.sock"))
        full = {k: v for k, v in env.items() if not k.startswith(("TRAINGUARD_AGENT", "NOTIFY_", "WATCHDOG_"))}
        full.update(unit_env, NOTIFY_SOCKET=str(tmp / "notify.sock"))
        self.log_file = open(tmp / "agent.log", "wb")
        self.proc = subprocess.Popen(argv, env=full, stdout=subprocess.DEVNULL, stderr=self.log_file)

    def log(self) -> str:
        """Everything the daemon logged so far."""
        return (self.tmp / "agent.log").read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Waits for READY=1; returns the STATUS= line sent with it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.notify.settimeout(1.0)
            try:
                data = self.notify.recv(4096).decode()
            except socket.timeout:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}") from None
                continue
            fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
            if fields.get("READY") == "1":
                return fields.get("STATUS", "")
        raise AssertionError(f"no READY=1 within {timeout}s:\n{self.log()}")

    def wait_log(self, needle: str, timeout: float = 30.0) -> None:
        """Waits until the daemon's log contains ``needle``."""
        deadline = time.monotonic() + timeout
        while needle not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} not in the daemon's log:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def wait_sampled(self, detector: str, timeout: float = 30.0) -> None:
        """Waits until ``detector`` has taken a sample (its metrics are in GetHealth): the next change of the
        hardware is then an event, not the baseline."""
        import grpc

        from trainguard.proto import agent_pb2, agent_pb2_grpc

        with grpc.insecure_channel(f"unix:{self.socket_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)

            def sampled() -> bool:
                health = stub.GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
                return any(d.name == detector and d.metrics for d in health.detectors)

            wait_until(sampled, timeout, f"a sample of the {detector} detector")

    def close(self) -> None:
        """Stops the daemon (SIGTERM, then SIGKILL) and closes its files."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.notify.close()
        self.log_file.close()


def wait_until(cond, timeout: float, what: str, period: float = 0.05) -> None:
    """Polls ``cond()`` until true; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(period)


def pcie_daemon_config(node_id: str, sysfs: Path, extra: str = "") -> str:
    """agent.toml for a quiet test daemon: a 0.2 s loop, text log, no TCP gRPC or metrics listener, only the
    PCIe detector (on the fake sysfs tree at ``sysfs``), no predictor; ``extra`` appends further tables."""
    return f"""
[agent]
node_id = "{node_id}"
loop_interval_s = 0.2
[log]
format = "text"
[grpc]
listen = ""
[metrics]
listen = ""
[detectors]
enabled = ["pcie"]
root = "{sysfs}"
interval_s = 0.2
[predictor]
enabled = false
{extra}"""


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without variables pointing a launcher at a daemon or a job token (each test sets its own)."""
    return {k: v for k, v in env.items() if not k.startswith(("TRAINGUARD_AGENT", "TRAINGUARD_JOB_TOKEN"))}


@contextlib.contextmanager
def inproc_daemon(tmp_path: Path):
    """A node daemon in this process with no detectors, predictor or metrics port, serving its unix socket under
    ``tmp_path``; yields ``(daemon, stub)`` of a channel to that socket and stops it after."""
    import grpc

    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.sdnotify import SystemdNotifier
    from trainguard.proto import agent_pb2_grpc

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n[predictor]\nenabled = false\n'
                      f'[metrics]\nlisten = ""\n[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "agent.sock"
    daemon = AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    try:
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            yield daemon, agent_pb2_grpc.NodeAgentStub(channel)
    finally:
        daemon.stop()


__all__ = ["UNIT", "UnitDaemon", "clean_env", "inproc_daemon", "pcie_daemon_config", "unit_command", "wait_until"]
