"""Starting where something already listens: a TCP port another process holds is refused in one line of ours,
naming the port and the option to change (no gRPC log line before it); a second agent on a running one's socket is
told about that agent, not about a port the running one holds; a second agent on a running one's memory_tier.root
is refused at its start, naming the running one's pid."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.agent import arena_keeper
from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.config import AgentConfigError
from trainguard.agent.errors import AgentError
from trainguard.agent.sdnotify import SystemdNotifier


def _write_config(tmp_path: Path, metrics: str = "") -> Path:
    (tmp_path / "fake").mkdir(exist_ok=True)
    config = tmp_path / f"agent{metrics.replace(':', '-')}.toml"
    config.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path / "fake"}"\n'
                      f'[metrics]\nlisten = "{metrics}"\n[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    return config


def test_a_taken_grpc_port_is_one_clear_error_naming_port_and_option(tmp_path: Path, capfd) -> None:
    """gRPC's core logged "Failed to add port to server: No address added out of total 1 resolved ..." to stderr
    ahead of our error, which itself quoted gRPC ("set GRPC_VERBOSITY=debug ...")."""
    config = _write_config(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        daemon = AgentDaemon(config_loader(str(config), f"127.0.0.1:{port}", str(tmp_path / "agent.sock"),
                                           str(tmp_path / "state")), SystemdNotifier(None))
        capfd.readouterr()
        try:
            with pytest.raises(AgentConfigError) as err:
                daemon.start()
        finally:
            daemon.stop()
            daemon.release_locks()
    stderr = capfd.readouterr().err
    assert "Failed to add port" not in stderr, stderr
    message = str(err.value)
    assert f"port {port} (127.0.0.1:{port}) is in use" in message and "--grpc-listen HOST:PORT" in message, message
    assert "GRPC_VERBOSITY" not in message and "\n" not in message, message
    assert not (tmp_path / "agent.sock").exists(), "a refused start left its socket file"


def test_a_second_agent_on_the_socket_is_told_about_the_running_agent_first(tmp_path: Path) -> None:
    """A second `trainguard agent` with its own --state-dir but the running one's socket (a copied unit file) was
    refused with "metrics.listen: cannot listen on 127.0.0.1:9477 (Address already in use)": the running agent's
    metrics port, bound before the socket's lock was tried."""
    sock = str(tmp_path / "agent.sock")
    first = AgentDaemon(config_loader(str(_write_config(tmp_path, "127.0.0.1:0")), "", sock, str(tmp_path / "st1")),
                        SystemdNotifier(None))
    first.start()
    try:
        taken = f"127.0.0.1:{first._metrics_server.port}"
        second = AgentDaemon(config_loader(str(_write_config(tmp_path, taken)), "", sock, str(tmp_path / "st2")),
                             SystemdNotifier(None))
        try:
            with pytest.raises(AgentError) as err:
                second.start()
        finally:
            second.release_locks()
        assert f"another trainguard agent (pid {os.getpid()}) holds {sock}.lock" in str(err.value), str(err.value)
    finally:
        first.stop()


def test_a_second_agent_on_the_memory_tier_root_fails_at_start_naming_the_first(tmp_path: Path) -> None:
    """Found by review: two daemons given one memory_tier.root (each its own socket and state folder) both ran,
    adopted each other's jobs' arenas and removed them ttl_s later under the running jobs. The second now stops at
    its start with one line naming the first's pid and the setting, before touching an arena; the first lets go of
    the root when it stops (in-process too, or the next daemon on that root would be refused)."""
    (tmp_path / "shm" / "job1").mkdir(parents=True)  # a job's arena, adopted by the first daemon
    first = AgentDaemon(config_loader(str(_write_config(tmp_path)), "", str(tmp_path / "a.sock"),
                                      str(tmp_path / "st1")), SystemdNotifier(None))
    first.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "NOTIFY_", "WATCHDOG_"))}
        second = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "agent", "--config",
                                   str(_write_config(tmp_path)), "--socket", str(tmp_path / "b.sock"),
                                   "--state-dir", str(tmp_path / "st2"), "--grpc-listen", "127.0.0.1:0"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = second.communicate(timeout=60)  # generous (a loaded 2-core box), within the test timeout
        finally:
            if second.poll() is None:  # it started after all: never leave it running
                second.kill()
                second.wait()
        assert second.returncode != 0, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert f"another trainguard daemon (pid {os.getpid()}" in lines[0] and "memory_tier.root" in lines[0], stderr
        assert (tmp_path / "shm" / "job1").is_dir()
    finally:
        first.stop()
    assert os.path.realpath(tmp_path / "shm") not in arena_keeper._HELD_ROOTS  # released by the stop
