"""The checkpoint job of a lone process (plain ``python train.py``: no torchrun, no ``job=``)."""

from __future__ import annotations

import logging
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch

import trainguard

_LAUNCH_VARS = ("TRAINGUARD_JOB", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "TRAINGUARD_CHECKPOINT_DIR",
                "TRAINGUARD_AGENT_SOCKET", "TRAINGUARD_CHECKPOINT_SERVICE")


@pytest.fixture
def lone(monkeypatch, tmp_path):
    """A lone process's environment, with the in-memory tier in a folder of this test's own; returns a function
    that makes ``sys.argv[0]`` the given script of ``tmp_path``."""
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    shm = f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", shm)

    def run_as(script: str) -> None:
        monkeypatch.setattr(sys, "argv", [str(tmp_path / script)])

    yield run_as
    shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.timeout(120)
def test_two_lone_scripts_are_two_jobs_and_a_rerun_resumes(tmp_path: Path, lone) -> None:
    # Every lone process was job "default": a second script with the same checkpoint directory restored the first
    # one's model, and while the first ran, the second had every save refused (one writer per job and rank).
    ckpt = str(tmp_path / "ckpt")
    lone("train.py")
    with trainguard.init(checkpoint_dir=ckpt) as first:
        assert first.save({"w": torch.full((4,), 1.0)}, 0)
    assert first.errors == []
    lone("other.py")
    state = {"w": torch.full((4,), 2.0)}
    second = trainguard.init(checkpoint_dir=ckpt)
    try:
        assert second.restore(state) == 0 and state["w"].tolist() == [2.0] * 4
        assert second.job != first.job
        assert second.save(state, 0)
        # The same script again, while the other one runs, is the same job: it resumes its own step and saves.
        lone("train.py")
        state = {"w": torch.zeros(4)}
        with trainguard.init(checkpoint_dir=ckpt) as again:
            assert again.job == first.job
            assert again.restore(state) == 1 and state["w"].tolist() == [1.0] * 4
            assert again.save(state, 1)
        assert again.errors == []
    finally:
        second.close()
    assert second.errors == []


@pytest.mark.timeout(60)
def test_a_given_job_name_wins_and_old_default_checkpoints_are_pointed_at(tmp_path: Path, lone, monkeypatch,
                                                                          caplog) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "default" / "step_000000000007").mkdir(parents=True)  # saved by a lone process before
    lone("train.py")
    with caplog.at_level(logging.WARNING, logger="trainguard.hook"):
        with trainguard.init(checkpoint_dir=str(ckpt)) as session:
            assert session.job.startswith("train-")
    assert "pass trainguard.init(job='default')" in caplog.text
    with trainguard.init(checkpoint_dir=str(ckpt), job="mine") as session:
        assert session.job == "mine"
    monkeypatch.setenv("TRAINGUARD_JOB", "theirs")
    with trainguard.init(checkpoint_dir=str(ckpt)) as session:
        assert session.job == "theirs"
    with trainguard.init(checkpoint_dir=str(ckpt), job="mine") as session:
        assert session.job == "mine"
    monkeypatch.delenv("TRAINGUARD_JOB")
    with trainguard.init() as session:  # no checkpoints: the name is never used for a folder
        assert session.job == "default"
