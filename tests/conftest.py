"""Shared fixtures: prove that no process outlives its test."""

from __future__ import annotations

import os
import time
import uuid

import psutil
import pytest

from tg_testutil import marked_processes


@pytest.fixture
def tg_env(tmp_path):
    """Environment for CLI subprocesses, tagged with a marker; fails the test if a tagged process survives."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, TG_TEST_MARKER=marker, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
    yield env
    deadline = time.monotonic() + 5.0
    left = marked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"orphan processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
