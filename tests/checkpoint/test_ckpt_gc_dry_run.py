"""`trainguard ckpt gc --dry-run` names exactly the steps a real gc then deletes, and deletes nothing itself."""

from __future__ import annotations

import contextlib
import io
import os

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.storage import step_dirname
from trainguard.cli import main


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["ckpt", *args])
    return rc, out.getvalue()


def test_dry_run_lists_what_gc_removes_and_removes_nothing(tmp_path) -> None:
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"},
                           disk={"keep": 10})
    with Checkpointer(cfg, job="j") as ck:
        for s in range(1, 6):
            ck.save({"w": torch.full((1000,), float(s))}, s)
    job_dir = tmp_path / "ck" / "j"
    torn = job_dir / step_dirname(0)  # a crashed save: a step directory without a commit
    torn.mkdir()
    before = sorted(os.listdir(job_dir))
    rc, out = _cli("gc", str(tmp_path / "ck"), "--keep", "2", "--dry-run")
    assert rc == 0 and out.strip().splitlines()[-1] == "would remove 4 step(s): [0, 1, 2, 3]"
    assert sorted(os.listdir(job_dir)) == before
    rc, out = _cli("gc", str(tmp_path / "ck"), "--keep", "2")
    assert rc == 0 and out.strip().splitlines()[-1] == "removed 4 step(s): [0, 1, 2, 3]"
    assert sorted(os.listdir(job_dir)) == ["COMMITTED.json", step_dirname(4), step_dirname(5)]
