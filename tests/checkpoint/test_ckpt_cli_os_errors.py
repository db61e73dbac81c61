"""`trainguard ckpt`: what the operating system refuses is one line naming the path, and gc never claims a removal
it could not make."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.storage import LocalStore, step_dirname
from trainguard.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ckpt", *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _saved(tmp_path, steps=(1, 2, 3)) -> str:
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"},
                           disk={"keep": 5})
    with Checkpointer(cfg, job="j") as ck:
        for s in steps:
            ck.save({"w": torch.full((64,), float(s))}, s)
    return str(tmp_path / "ck")


def test_export_and_import_into_a_folder_that_cannot_be_made_are_one_line(tmp_path):
    # /proc refuses a new folder even to root: the same path as a folder a user may not write. Both were a
    # FileNotFoundError / PermissionError traceback.
    root = _saved(tmp_path)
    out = _cli("export", root, "/proc/tg-export-here")
    assert out.returncode == 2 and out.stderr.startswith("trainguard: error: /proc/tg-export-here: "), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert _cli("export", root, str(tmp_path / "dcp")).returncode == 0
    imp = _cli("import", str(tmp_path / "dcp"), "/proc", "--job", "k")
    assert imp.returncode == 2 and "/proc/k" in imp.stderr and imp.stderr.count("\n") == 1, imp.stderr


def test_gc_that_could_not_remove_a_step_says_so_and_exits_1(tmp_path, monkeypatch):
    # LocalStore.remove_step leaves what it cannot delete (a trainer's retention must never raise): without write
    # access to the job's folder, gc printed "removed 2 step(s): [1, 2]" and exited 0 with every step in place.
    root = _saved(tmp_path)
    real = LocalStore.remove_step
    monkeypatch.setattr(LocalStore, "remove_step", lambda self, step: None if step == 1 else real(self, step))
    out = _cli("gc", root, "--keep", "1")
    assert out.returncode == 1, out
    assert "removed 1 step(s): [2]" in out.stdout and "could not remove step(s) [1]" in out.stderr, out
    assert sorted(os.listdir(os.path.join(root, "j"))) == ["COMMITTED.json", step_dirname(1), step_dirname(3)]
