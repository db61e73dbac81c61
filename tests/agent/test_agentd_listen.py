"""The daemon's TCP listener: a port another process holds is refused in one line of ours, naming the port and
the option to change, with no gRPC log line before it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.config import AgentConfigError
from trainguard.agent.sdnotify import SystemdNotifier


def test_a_taken_grpc_port_is_one_clear_error_naming_port_and_option(tmp_path: Path, capfd) -> None:
    """gRPC's core logged "Failed to add port to server: No address added out of total 1 resolved ..." to stderr
    ahead of our error, which itself quoted gRPC ("set GRPC_VERBOSITY=debug ...")."""
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path / "fake"}"\n[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
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
