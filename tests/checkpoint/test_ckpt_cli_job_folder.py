"""`trainguard ckpt` given a job's own folder where the checkpoint root goes."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.cli import main


@pytest.mark.parametrize("steps", [[1], [1, 2]])
@pytest.mark.parametrize("command", ["ls", "verify", "gc"])
def test_a_job_folder_given_as_the_root_is_refused_naming_the_root_and_job(command, steps, tmp_path) -> None:
    # Found by the checkpoint review: `ckpt ls ROOT/JOB` said it "holds 3 jobs (step_000000000397, ...)"; with one
    # step, that step was taken for the job: `ls` printed no steps and exited 0, `verify` said "no committed step".
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        for s in steps:
            ck.save({"w": torch.full((100,), float(s))}, s)
    out, err = io.StringIO(), io.StringIO()
    extra = ["--keep", "1"] if command == "gc" else []
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ckpt", command, str(tmp_path / "ck" / "j"), *extra])
    assert rc == 2, out.getvalue()
    assert f"is the folder of job 'j' (it holds step folders); pass the checkpoint root above it: {tmp_path / 'ck'} " \
           "--job j" in err.getvalue()
