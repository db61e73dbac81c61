"""Shared fixtures: run the CLI in a subprocess, and prove no process outlives its test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train.py"


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TG_TEST_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture
def tg_env(tmp_path):
    """Environment for CLI subprocesses, tagged with a marker; fails the test if a tagged process survives."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, TG_TEST_MARKER=marker, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
    yield env
    deadline = time.monotonic() + 5.0
    left = _marked(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"orphan processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def run_cli(args: list[str], env: dict, timeout: float = 90.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``trainguard ARGS`` to completion; kills its whole session on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", *args], env=env, cwd=cwd or REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"trainguard {' '.join(args)} timed out\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
