"""Where the daemon's paths point: relative ``--socket``/``--state-dir`` mean the folder the command was typed in,
relative paths in the file or the environment are refused (under systemd the daemon runs from /)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from trainguard.agent import config as cfg
from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.config import AgentConfig, AgentConfigError
from trainguard.agent.sdnotify import SystemdNotifier
from trainguard.proto import agent_pb2, agent_pb2_grpc


def _config(tmp_path: Path) -> Path:
    (tmp_path / "fake").mkdir()
    path = tmp_path / "agent.toml"
    path.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path / "fake"}"\n[metrics]\nlisten = ""\n'
                    f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    return path


def test_relative_socket_and_state_dir_flags_mean_the_folder_they_were_typed_in(tmp_path, monkeypatch):
    """`trainguard agent --socket agent.sock --state-dir state` served on `unix:agent.sock` and wrote `state/`
    relative to whatever folder the process was in when it bound them; a chdir (or WorkingDirectory=/) put them
    elsewhere, and launchers looked for the socket by the path as typed."""
    typed_in = tmp_path / "ops"
    typed_in.mkdir()
    config = _config(tmp_path)
    monkeypatch.chdir(typed_in)
    load = config_loader("../agent.toml", "", "agent.sock", "state")  # as parsed from the command line
    monkeypatch.chdir(tmp_path / "fake")  # the daemon's folder is not the operator's
    daemon = AgentDaemon(load, SystemdNotifier(None))
    try:
        daemon.start()
        assert daemon.config.source == str(config)
        assert daemon.config.grpc.socket == str(typed_in / "agent.sock")
        assert (typed_in / "agent.sock").is_socket() and (typed_in / "state" / "agent.lock").is_file()
        assert sorted(os.listdir(tmp_path / "fake")) == []
        with grpc.insecure_channel(f"unix:{typed_in / 'agent.sock'}") as channel:
            agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=10)
    finally:
        daemon.stop()


@pytest.mark.parametrize("text, env, needle", [
    ('[agent]\nstate_dir = "state"\n', {}, "agent.state_dir: 'state' is a relative path; give an absolute one"),
    ('[grpc]\nsocket = "run/agent.sock"\n', {}, "grpc.socket: 'run/agent.sock' is a relative path"),
    ("", {cfg.SOCKET_ENV: "agent.sock"},
     f"grpc.socket (set by ${cfg.SOCKET_ENV}): 'agent.sock' is a relative path"),
    ("", {cfg.STATE_DIR_ENV: "./st"}, f"agent.state_dir (set by ${cfg.STATE_DIR_ENV}): './st' is a relative path"),
    # a URL in the environment or the file was "a relative path" too (only the flags said "is a URL")
    ("", {cfg.STATE_DIR_ENV: "file:///tmp/x"},
     f"agent.state_dir (set by ${cfg.STATE_DIR_ENV}): 'file:///tmp/x' is a URL; it must be a local folder"),
    ('[grpc]\nsocket = "unix:///run/a.sock"\n', {}, "grpc.socket: 'unix:///run/a.sock' is a URL"),
    ('[memory_tier]\nroot = "file:///dev/shm/x"\n', {}, "memory_tier.root: 'file:///dev/shm/x' is a URL"),
    # read against the folder the daemon started in (/ under systemd) where every other path must be absolute
    ('[predictor]\nmodel = "models/m.json"\n', {}, "predictor.model: 'models/m.json' is a relative path"),
    ('[predictor]\nmodel = "s3://b/m.json"\n', {}, "predictor.model: 's3://b/m.json' is a URL"),
])
def test_relative_paths_in_the_file_or_environment_are_refused(tmp_path, text, env, needle):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(AgentConfigError) as err:
        AgentConfig.load(path, env=env)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("text, env, needle", [
    # a URL was called "a relative path"
    ('[detectors]\nroot = "file:///sys"\n', {}, "detectors.root: 'file:///sys' is a URL; give a local absolute path"),
    # the variable went unnamed, unlike every other key's: the operator looked for the value in the file
    ("", {cfg.DETECTORS_ROOT_ENV: "rel"}, f"detectors.root (set by ${cfg.DETECTORS_ROOT_ENV}): 'rel' is a relative"),
])
def test_a_bad_detectors_root_is_named_as_a_url_or_by_its_variable(tmp_path, text, env, needle):
    from trainguard.errors import ConfigError

    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        AgentConfig.load(path, env=env).detector_loader()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
