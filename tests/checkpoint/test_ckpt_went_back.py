"""A job that goes back to an older step: the copies of the steps it went back from belong to an abandoned run.

Two ranks (two Checkpointers, each with its own real persist process) save steps 100 and 120, go back to 100
(``restore(step=100)``: a loss spike, or ranks agreeing on an older step), and train on. Rank 0 reaches and saves
the new run's step 120; rank 1 saves step 101 and is killed before its 120. Rank 1's old copy of 120 and rank 0's
new one used to make step 120 "complete": a restore loaded two runs' states into one job.
"""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint import arena as arena_mod


def _state(rank: int, step: int, run: str) -> dict:
    return {"w": torch.full((256,), float(step)), "rank": rank, "run": run}


def _went_back(make_config, **config) -> tuple:
    """Saves the scenario above; returns the config and job."""
    cfg, job = make_config(**config), "back"
    cks = [Checkpointer(cfg, rank=r, world_size=2, job=job) for r in (0, 1)]
    try:
        for step in (100, 120):
            for r, ck in enumerate(cks):
                assert ck.save(_state(r, step, "old"), step).wait(60)
        for r, ck in enumerate(cks):
            state = _state(r, 0, "")
            assert ck.restore(state, step=100) == 100 and state["run"] == "old"
            assert ck.save(_state(r, 101, "new"), 101).wait(60)
        assert cks[0].save(_state(0, 120, "new"), 120).wait(60)
    finally:
        for ck in cks:
            ck.close()
    return cfg, job


@pytest.mark.timeout(120)
def test_a_step_of_the_run_gone_back_from_never_meets_the_new_runs_copy_in_memory(make_config) -> None:
    cfg, job = _went_back(make_config, memory={"keep": 2, "keep_on_close": True}, disk={"enabled": False})
    listed = arena_mod.memory_manifests(cfg.memory.directory, job, retired=True)
    assert {r: man.tree is not None for r, (_, man) in listed.get(120, {}).items()} == {0: True}
    for r in (0, 1):
        with Checkpointer(cfg, rank=r, world_size=2, job=job) as ck:
            state = _state(r, 0, "")
            assert ck.restore(state) == 101
            assert state["run"] == "new" and state["w"][0].item() == 101.0


@pytest.mark.timeout(120)
def test_a_step_of_the_run_gone_back_from_never_meets_the_new_runs_copy_on_disk(make_config, tmp_path) -> None:
    cfg, job = _went_back(make_config, memory={"enabled": False}, remote={"url": f"file://{tmp_path}/remote"})
    for root in ("ckpt", "remote"):
        assert sorted(p.name for p in (tmp_path / root / job / "step_000000000120").iterdir()) == [
            "rank_00000.commit", "rank_00000.data", "rank_00000.manifest.json"], root
    for r in (0, 1):
        with Checkpointer(cfg, rank=r, world_size=2, job=job) as ck:
            state = _state(r, 0, "")
            assert ck.restore(state) == 101 and ck.last_restore_tier == "disk"
            assert state["run"] == "new" and state["w"][0].item() == 101.0


@pytest.mark.timeout(120)
def test_the_steps_gone_back_from_leave_no_empty_folders_on_disk_or_remote(make_config, tmp_path) -> None:
    """Disk removed the emptied folders of the steps the job went back from; a file:// remote kept them, listed
    by `ckpt ls` as incomplete steps for good, and `ckpt gc` never removed them (newer than the newest commit)."""
    cfg = make_config(memory={"enabled": False}, remote={"url": f"file://{tmp_path}/remote"})
    with Checkpointer(cfg, job="j") as ck:
        for step in range(1, 6):
            assert ck.save({"w": torch.full((4,), float(step))}, step).wait(60)
    with Checkpointer(cfg, job="j") as ck:
        state = {"w": torch.zeros(4)}
        assert ck.restore(state, step=2) == 2
        assert ck.save(state, 3).wait(60)
    for root in ("ckpt", "remote"):
        steps = sorted(p.name for p in (tmp_path / root / "j").iterdir() if p.name.startswith("step_"))
        assert steps[-1] == "step_000000000003" and "step_000000000004" not in steps, (root, steps)
