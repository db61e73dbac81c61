"""`trainguard status` against an agent socket this user may not open says so (it said "no node agent answers",
sending the operator after a daemon that was running). The real CLI against a real listening unix socket."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest


def _status(sock: str, prefix: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return subprocess.run([*prefix, sys.executable, "-m", "trainguard.cli", "status", "--socket", sock,
                           "--timeout", "2"], capture_output=True, text=True, timeout=60, env=env)


def test_status_on_a_socket_it_may_not_open_says_permission_denied():
    prefix: list[str] = []
    if os.geteuid() == 0:
        # root opens any socket (CAP_DAC_OVERRIDE): the command runs without that capability instead
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        drop = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--"]
    folder = tempfile.mkdtemp(prefix="tg-denied-")
    sock = os.path.join(folder, "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(sock)
        server.listen(4)
        os.chmod(sock, 0o000)  # an agent listens, but this user may not open its socket
        out = _status(sock, prefix)
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1, out.stderr
        assert "permission denied" in out.stderr and sock in out.stderr, out.stderr
        assert "--socket" in out.stderr and "no node agent answers" not in out.stderr
    finally:
        server.close()
        os.unlink(sock)
        os.rmdir(folder)


def test_status_on_a_socket_nobody_listens_on_still_says_no_agent_answers(tmp_path):
    sock = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock)
    server.close()  # the file stays, nobody listens: a stopped daemon's socket
    out = _status(sock, [])
    assert out.returncode == 2 and "no node agent answers" in out.stderr, out.stderr
