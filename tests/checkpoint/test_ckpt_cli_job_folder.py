"""`trainguard ckpt` given a job's own folder where the checkpoint root goes."""

from __future__ import annotations

import contextlib
import io
import os

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


def test_verify_of_a_step_that_does_not_exist_says_so(tmp_path) -> None:
    # It said "NOT COMMITTED (some rank's commit marker is missing)": an operator went looking for a torn save.
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        ck.save({"w": torch.ones(10)}, 3)
    (tmp_path / "ck" / "j" / "step_000000000002").mkdir()  # a save that never committed
    for step, expect in (("5", "step 5: NO SUCH STEP in "), ("2", "step 2: NOT COMMITTED")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main(["ckpt", "verify", str(tmp_path / "ck"), "--step", step])
        assert rc == 1 and out.getvalue().startswith(expect), out.getvalue()
        assert ("newest committed: 3;" in out.getvalue()) == (step == "5")


def test_a_data_file_replaced_by_a_folder_is_named_by_verify_and_restore_falls_back(tmp_path) -> None:
    # verify said "CORRUPT: [Errno 19] No such device" (mmap of a folder), naming neither the file nor why
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((10,), float(s))}, s)
    data = tmp_path / "ck" / "j" / "step_000000000002" / "rank_00000.data"
    data.unlink()
    data.mkdir()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["ckpt", "verify", str(tmp_path / "ck"), "--job", "j"])
    assert rc == 1 and f"data file {data} is not a regular file (mode d" in out.getvalue(), out.getvalue()
    w = torch.zeros(10)
    with Checkpointer(cfg, job="j") as ck:
        assert ck.restore({"w": w}) == 1 and torch.equal(w, torch.ones(10))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["rank_00000.data", "rank_00000.manifest.json", "rank_00000.commit"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_an_error_not_a_hang(tmp_path, name) -> None:
    """Opening a FIFO blocks until a writer comes: a restore at start-up, `ckpt verify` and `ckpt gc` hung for
    good on one left where a step's data file, manifest or commit marker belongs."""
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((10,), float(s))}, s)
    path = tmp_path / "ck" / "j" / "step_000000000002" / name
    path.unlink()
    os.mkfifo(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["ckpt", "verify", str(tmp_path / "ck"), "--job", "j", "--step", "2"])
        gc = main(["ckpt", "gc", str(tmp_path / "ck"), "--job", "j", "--keep", "1", "--dry-run"])
    assert rc == 1 and gc == 0, out.getvalue()
    w = torch.zeros(10)
    with Checkpointer(cfg, job="j") as ck:
        assert ck.restore({"w": w}) == 1 and torch.equal(w, torch.ones(10))


def test_listing_a_missing_remote_root_says_what_is_wrong() -> None:
    # it said "cannot list memory://x: /x" (fsspec's bare path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["ckpt", "ls", "memory://no-such-root-here"])
    assert rc == 2 and "cannot list memory://no-such-root-here: no such folder; memory:// is the memory of one " \
                       "process" in err.getvalue(), err.getvalue()
