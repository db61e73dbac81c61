"""`trainguard demo --workdir`: a folder the demo cannot start fresh in is refused before anything runs."""

from __future__ import annotations

import contextlib
import io

from trainguard.cli import main


def _demo(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["demo", "--steps", "40", "--kill-step", "30", *args])
    return rc, err.getvalue()


def test_a_workdir_holding_an_earlier_demos_checkpoints_is_refused(tmp_path):
    # A second demo into the same folder resumed both jobs from the first one's step 39: the fault at step 30
    # never struck and the demo exited 1 with no word of why.
    (tmp_path / "ckpt-faulty" / "demo-faulty").mkdir(parents=True)
    rc, err = _demo("--workdir", str(tmp_path))
    assert rc == 2 and "earlier demo's checkpoints (ckpt-faulty)" in err and err.count("\n") == 1, err
    assert not (tmp_path / "logs-faulty").exists()  # refused before the first job started


def test_a_workdir_that_is_a_file_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "f"
    path.write_text("x")
    rc, err = _demo("--workdir", str(path))
    assert rc == 2 and err.startswith("trainguard: error: --workdir") and "not a folder" in err, err
