"""The hook latches a failed background tier in ``Session.errors`` (the README's promise), not only a failed
``save()`` call."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
import torch

from trainguard.checkpoint.errors import StorageUnavailableError
from trainguard.hook import MAX_LATCHED_ERRORS, Session


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_write_that_fails_in_the_background_is_latched(tmp_path, monkeypatch) -> None:
    """Found by checking the README against behaviour: with the checkpoint folder on a full disk, the persist
    process's writes failed (ENOSPC, logged) and session.errors was still [] after close()."""
    shm = f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", shm)
    disk = tmp_path / "full"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        s = Session(checkpoint_dir=str(disk), save_every=1, job="full")
        state = {"w": torch.ones(256, 1024)}  # 1 MiB: no room on the 64 KiB disk
        assert s.save(state, 1)  # the snapshot is taken; the disk write fails later, in the persist process
        s.close()
        assert s.errors and all(isinstance(e, StorageUnavailableError) for e in s.errors), s.errors
        assert any("No space left" in str(e) or "disk" in str(e) for e in s.errors), s.errors
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(shm, ignore_errors=True)


def test_the_latched_errors_keep_the_newest(tmp_path) -> None:
    s = Session(job="many")
    for i in range(MAX_LATCHED_ERRORS + 5):
        s._latch(StorageUnavailableError(f"failure {i}"), "save")
    assert len(s.errors) == MAX_LATCHED_ERRORS and str(s.errors[-1]) == f"failure {MAX_LATCHED_ERRORS + 4}"
    s.close()
