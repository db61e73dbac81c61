"""`trainguard ckpt import` into a step the job already has: refused without --force, replaced atomically with it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from trainguard.checkpoint.storage import step_dirname
from trainguard.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ckpt", *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _dcp(path: Path, value: float) -> str:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.full((64, 4), value), "b": torch.full((8,), value)}, checkpoint_id=str(path))
    return str(path)


def _digest(step_dir: Path) -> dict[str, str]:
    """Every file of a step folder by name, as a content hash."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step_dir.iterdir())}


def test_import_over_an_existing_step_needs_force(tmp_path):
    root = str(tmp_path / "ck")
    first, second = _dcp(tmp_path / "a", 1.0), _dcp(tmp_path / "b", 2.0)
    assert _cli("import", first, root, "--job", "j", "--step", "5").returncode == 0
    step_dir = tmp_path / "ck" / "j" / step_dirname(5)
    before = _digest(step_dir)

    again = _cli("import", second, root, "--job", "j", "--step", "5")
    assert again.returncode == 2, again
    assert again.stderr.count("\n") == 1 and "step 5" in again.stderr and "--force" in again.stderr, again.stderr
    assert _digest(step_dir) == before  # nothing written

    forced = _cli("import", second, root, "--job", "j", "--step", "5", "--force")
    assert forced.returncode == 0, forced.stderr
    assert _digest(step_dir) != before
    assert _cli("verify", root, "--job", "j", "--step", "5").returncode == 0
    # The staging folder is gone and never listed as a step or a job.
    assert sorted(os.listdir(tmp_path / "ck" / "j")) == ["COMMITTED.json", step_dirname(5)]
    assert sorted(os.listdir(tmp_path / "ck")) == ["j"]


_CRASH_AFTER_FIRST_RANK = """
import os, signal, sys
from trainguard.checkpoint.storage import LocalStore
commit = LocalStore.commit_rank
def crash_after_one(self, *a, **k):
    done = commit(self, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # the import dies with one rank of the new step committed
    return done
LocalStore.commit_rank = crash_after_one
from trainguard.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_crash_mid_import_with_force_leaves_the_old_step_whole(tmp_path):
    root = str(tmp_path / "ck")
    first, second = _dcp(tmp_path / "a", 1.0), _dcp(tmp_path / "b", 2.0)
    assert _cli("import", first, root, "--job", "j", "--step", "5", "--world-size", "2").returncode == 0
    step_dir = tmp_path / "ck" / "j" / step_dirname(5)
    before = _digest(step_dir)

    crashed = subprocess.run([sys.executable, "-c", _CRASH_AFTER_FIRST_RANK, "ckpt", "import", second, root,
                              "--job", "j", "--step", "5", "--world-size", "2", "--force"],
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    # Written in place, rank 0's new copy sat beside rank 1's old one under both commit markers: a committed step
    # that mixed two checkpoints (and verified, each rank's files being consistent).
    assert _digest(step_dir) == before
    ls = _cli("ls", root, "--job", "j", "--json")
    assert ls.returncode == 0, ls.stderr
    assert [(r["step"], r["complete"]) for r in json.loads(ls.stdout)["steps"]] == [(5, True)], ls.stdout
    # The killed import's staging folder (its bytes included) stayed behind; the next import removes it, and
    # leaves the folder of an import still running (its lock held) and a just-created one without its lock yet.
    job_dir = tmp_path / "ck" / "j"
    crashed_dirs = [n for n in os.listdir(job_dir) if n.startswith(".import-")]
    assert len(crashed_dirs) == 1, os.listdir(job_dir)
    running = job_dir / ".import-running"
    running.mkdir()
    held = os.open(running / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    young, old = job_dir / ".import-young", job_dir / ".import-old"
    young.mkdir()
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    try:
        assert _cli("import", first, root, "--job", "j", "--step", "6").returncode == 0
        left = sorted(n for n in os.listdir(job_dir) if n.startswith(".import-"))
    finally:
        os.close(held)
    assert left == [".import-running", ".import-young"], left


def test_an_export_imported_twice_under_its_own_step_needs_force(tmp_path):
    from trainguard.checkpoint import CheckpointConfig, Checkpointer

    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        ck.save({"w": torch.arange(10.0)}, 9)
    assert _cli("export", str(tmp_path / "ck"), str(tmp_path / "out")).returncode == 0
    root = str(tmp_path / "ck2")
    assert _cli("import", str(tmp_path / "out"), root, "--job", "k").returncode == 0
    again = _cli("import", str(tmp_path / "out"), root, "--job", "k")
    assert again.returncode == 2 and "step 9" in again.stderr and "--force" in again.stderr, again.stderr
    assert _cli("import", str(tmp_path / "out"), root, "--job", "k", "--force").returncode == 0
    assert _cli("verify", root, "--job", "k").returncode == 0


def test_ckpt_gc_removes_the_staging_folders_of_dead_imports(tmp_path):
    """An import killed mid-way left its staging folder (every byte it wrote) until the next import into the job;
    `ckpt gc` left it too. It now removes the folders whose lock nobody holds (the kernel drops a dead import's),
    names them in --dry-run, and leaves a running import's and one whose lock file is not made yet."""
    from trainguard.checkpoint import CheckpointConfig, Checkpointer

    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        ck.save({"w": torch.arange(10.0)}, 1)
    job_dir = tmp_path / "ck" / "j"
    dead, running, young = job_dir / ".import-dead", job_dir / ".import-running", job_dir / ".import-young"
    for d in (dead, running, young):
        d.mkdir()
    (dead / ".lock").touch()
    (dead / "data").write_bytes(b"\0" * 4096)
    held = os.open(running / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        dry = _cli("gc", str(tmp_path / "ck"), "--job", "j", "--keep", "1", "--dry-run")
        assert dry.returncode == 0 and "would remove the staging folder(s) of 1 import(s)" in dry.stdout, dry
        assert ".import-dead" in dry.stdout and dead.is_dir()
        done = _cli("gc", str(tmp_path / "ck"), "--job", "j", "--keep", "1")
        assert done.returncode == 0 and "removed the staging folder(s) of 1 import(s)" in done.stdout, done
        left = sorted(n for n in os.listdir(job_dir) if n.startswith(".import-"))
    finally:
        os.close(held)
    assert left == [".import-running", ".import-young"], left
    assert _cli("verify", str(tmp_path / "ck"), "--job", "j").returncode == 0
