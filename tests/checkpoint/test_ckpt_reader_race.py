"""A process restoring from the directory of a live trainer (an evaluation job) while the trainer's retention
removes the steps it just listed."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.storage import LocalStore, step_dirname


def _live_config(tmp_path) -> CheckpointConfig:
    """A trainer's directory keeping 2 steps, written inline so each save is on disk when it returns."""
    return CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, disk={"keep": 2},
                            persist={"service": "inline"})


def _saver(trainer: Checkpointer):
    """save(step): the trainer commits a step whose tensor holds the step number."""
    def save(step: int) -> None:
        trainer.save({"w": torch.full((1024,), float(step))}, step)
        assert trainer.wait(step, timeout=60)

    return save


@pytest.mark.parametrize("corrupt_ok", [False, True])
def test_a_reader_whose_listed_steps_the_trainer_removed_restores_a_newer_step(corrupt_ok, tmp_path, monkeypatch):
    # Found by the checkpoint review (an evaluation loop restoring while a 2-rank job saved every step): the
    # reader listed steps 1-2, the trainer committed 3-4 and its retention (keep 2) removed 1-2, and the reader
    # raised CorruptCheckpointError "every committed step failed to load ... run `trainguard ckpt verify`" although
    # nothing was corrupt (with corrupt_ok=True it started from scratch). Now it tries the steps committed since.
    cfg = _live_config(tmp_path)
    with Checkpointer(cfg, job="j") as trainer, Checkpointer(cfg, job="j") as reader:
        save = _saver(trainer)
        save(1)
        save(2)
        real_listing = LocalStore.committed_steps
        saved_meanwhile = []

        def listing_then_the_trainer_goes_on(store: LocalStore) -> list:
            listed = real_listing(store)
            if store is reader.disk and not saved_meanwhile:
                saved_meanwhile.extend([3, 4])
                save(3)
                save(4)
            return listed

        monkeypatch.setattr(LocalStore, "committed_steps", listing_then_the_trainer_goes_on)
        live = {"w": torch.zeros(1024)}
        assert reader.restore(live, corrupt_ok=corrupt_ok) == 4
        assert float(live["w"][0]) == 4.0 and reader.last_restore_tier == "disk"
        assert [i.step for i in reader.steps()] == [3, 4]  # 1 and 2 are really gone


@pytest.mark.parametrize("command", ["verify", "gc"])
def test_ckpt_commands_on_a_live_jobs_directory_do_not_call_removed_steps_corrupt(command, tmp_path, monkeypatch):
    # Found by the same review: `trainguard ckpt verify` on the directory of a job saving every step printed
    # "CORRUPT: manifest is missing" and exited 1 for the steps the job's retention removed while it read them
    # (4 runs of 15), and `ckpt gc` kept them as corrupt and said no step verifies.
    from trainguard.cli import main

    cfg = _live_config(tmp_path)
    with Checkpointer(cfg, job="j") as trainer:
        save = _saver(trainer)
        save(1)
        save(2)
        real_listing = LocalStore.committed_steps
        calls = []

        def listing_then_the_trainer_goes_on(store: LocalStore) -> list:
            listed = real_listing(store)
            if not calls:
                calls.append(listed)
                save(3)
                save(4)  # retention (keep 2) removes steps 1 and 2
            return listed

        monkeypatch.setattr(LocalStore, "committed_steps", listing_then_the_trainer_goes_on)
        out = io.StringIO()
        args = ["ckpt", command, str(tmp_path / "ck")] + (["--keep", "1"] if command == "gc" else [])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main(args)
    assert calls == [[(1, 1), (2, 1)]]  # the command listed steps 1 and 2 (world size 1)
    assert rc == 0, out.getvalue()
    assert "CORRUPT" not in out.getvalue()
    if command == "verify":
        assert "step 1: REMOVED while verifying" in out.getvalue()
    assert sorted(os.listdir(tmp_path / "ck" / "j")) == ["COMMITTED.json", step_dirname(3), step_dirname(4)]
