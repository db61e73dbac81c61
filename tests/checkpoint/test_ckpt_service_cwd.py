"""A worker whose working directory is not the agent-owned persist process's (a script that chdirs, Hydra's run
folder) with a relative checkpoint directory: the persist process must write where the worker reads."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.service import CheckpointService


@pytest.mark.parametrize("staging", ["memory", "disk"])
def test_relative_checkpoint_directory_under_a_persist_service_started_elsewhere(staging, tmp_path, monkeypatch,
                                                                                 shm_dir, small_tmpfs):
    # The service got "ck" and the staging slot "ck/.trainguard-staging/..." as given and resolved them against its
    # own working directory (the launcher's): steps went to the launcher's folder (the worker, restarted, restored
    # nothing) and, with /dev/shm too small, every persist failed to open its slot.
    memory_dir = shm_dir if staging == "memory" else str(small_tmpfs)  # 1 MiB: the 2 MiB slots fall back to disk
    launcher, worker = tmp_path / "launcher", tmp_path / "worker"
    launcher.mkdir()
    worker.mkdir()
    monkeypatch.chdir(launcher)
    svc = CheckpointService(job="cwd", shm_dir=memory_dir, nice=0).start()
    try:
        monkeypatch.chdir(worker)
        cfg = CheckpointConfig(directory="ck", memory={"directory": memory_dir}, persist={"service": svc.address})
        saved = {"w": torch.arange(512 * 1024, dtype=torch.float32)}
        with Checkpointer(cfg, job="cwd") as ck:
            ck.save(saved, 1)
            assert ck.wait(1, timeout=60)
            assert ck.staging == staging
        live = {"w": torch.zeros(512 * 1024)}
        with Checkpointer(CheckpointConfig(directory="ck", memory={"enabled": False}), job="cwd") as reader:
            assert reader.restore(live) == 1 and reader.last_restore_tier == "disk"
        assert torch.equal(live["w"], saved["w"])
        assert not (launcher / "ck").exists()
    finally:
        svc.stop(timeout=30)
