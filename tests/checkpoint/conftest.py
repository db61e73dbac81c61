"""Fixtures shared by the checkpoint tests: small models, configs pointing at per-test directories."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from trainguard.checkpoint import CheckpointConfig


@pytest.fixture
def shm_dir():
    """A per-test arena root on the real tmpfs (/dev/shm), removed afterwards."""
    d = f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}"
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_config(tmp_path, shm_dir):
    """Builds a config for this test's directories; keyword arguments override fields."""

    def make(**kw) -> CheckpointConfig:
        memory = {"directory": shm_dir, **kw.pop("memory", {})}
        kw.setdefault("directory", str(tmp_path / "ckpt"))
        return CheckpointConfig(memory=memory, **kw)

    return make


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, like a container's /dev/shm that is too small for the staging slots."""
    d = tmp_path / "small-shm"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)
