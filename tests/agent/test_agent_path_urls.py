"""`trainguard agent` refuses a URL given for a local path (it became ``/cwd/http:/host/x.toml`` and was
reported as a file not found). The real CLI in a subprocess; it must stop before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _agent(args: list[str], cwd: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "agent", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**clean, **env})


@pytest.mark.parametrize("flag,url,what", [
    ("--config", "http://host/x.toml", "a local file"),
    ("--socket", "unix://run/agent.sock", "a local unix socket path"),
    ("--state-dir", "s3://bucket/state", "a local folder"),
])
def test_a_url_for_a_local_path_flag_is_refused(tmp_path, flag, url, what):
    out = _agent([flag, url, "--config", str(tmp_path / "none.toml")] if flag != "--config" else [flag, url],
                 str(tmp_path))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1, out.stderr
    assert f"{flag} {url!r} is a URL; it must be {what}" in out.stderr, out.stderr
    assert str(tmp_path) not in out.stderr  # not taken for a path under the current folder
    assert os.listdir(tmp_path) == []  # no state folder, socket or log made


def test_a_url_in_the_config_variable_is_refused(tmp_path):
    out = _agent([], str(tmp_path), TRAINGUARD_AGENT_CONFIG="https://host/agent.toml")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "$TRAINGUARD_AGENT_CONFIG 'https://host/agent.toml' is a URL; it must be a local file" in out.stderr
