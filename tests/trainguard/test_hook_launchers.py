"""The training hook outside trainguard run: a lone python process and plain torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tg_testutil import EXAMPLE, REPO
from trainguard.checkpoint.staging import WRITERS_DIR
from trainguard.worker_env import checkpoint_job_name


def _python(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
def test_lone_process_checkpoints_and_resumes(tmp_path: Path, tg_env: dict) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    r = _python([str(EXAMPLE), "--steps", "20", "--save-every", "5", "--checkpoint-dir", str(ckpt),
                 "--out", str(out)], tg_env)
    assert r.returncode == 0, r.stderr[-2000:]
    first = json.loads(out.read_text())
    assert first["world_size"] == 1 and first["restored_step"] is None
    # A second run with more steps continues from the last checkpoint (step 19) instead of starting over.
    r = _python([str(EXAMPLE), "--steps", "30", "--save-every", "5", "--checkpoint-dir", str(ckpt),
                 "--out", str(out)], tg_env)
    assert r.returncode == 0, r.stderr[-2000:]
    second = json.loads(out.read_text())
    assert second["restored_step"] == 19 and second["restored_tier"] in ("memory", "disk")
    # ... and ends where an uninterrupted 30-step run ends.
    r = _python([str(EXAMPLE), "--steps", "30", "--save-every", "0", "--out", str(tmp_path / "ref.json")], tg_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "ref.json").read_text())["params_sha256"] == second["params_sha256"]


@pytest.mark.timeout(600)
def test_plain_torchrun(tmp_path: Path, tg_env: dict) -> None:
    out = tmp_path / "out.json"
    r = _python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
                 "--steps", "20", "--save-every", "10", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--out", str(out)], tg_env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["steps"] == 20
    assert (tmp_path / "ckpt").exists()
    # Relaunching the same --standalone command resumes: torchrun gives each launch a fresh uuid as its run id,
    # and the hook named its checkpoint job after it, so every relaunch started over from step 0.
    r = _python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
                 "--steps", "22", "--save-every", "10", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--out", str(out)], tg_env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["restored_step"] == 19
    # One job folder for both launches (beside the disk tier's writer leases, .trainguard-writers).
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name != WRITERS_DIR] == [
        checkpoint_job_name(str(EXAMPLE), str(tmp_path / "ckpt"))]


@pytest.mark.timeout(600)
def test_trainguard_run_resumes_a_scripts_own_checkpoint_directory_and_one_from_the_environment(
        tmp_path: Path, tg_env: dict) -> None:
    # Found by a review: given no --checkpoint-dir, trainguard run named the job after its start time and the hook
    # took that name over the directory the script gave trainguard.init() (or $TRAINGUARD_CHECKPOINT_DIR): every
    # relaunch was a new job folder that restored nothing, where plain python and torchrun resumed.
    from tg_testutil import run_cli

    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    first = run_cli(["run", "--nproc-per-node", "1", "--max-restarts", "0", str(EXAMPLE), "--steps", "10",
                     "--save-every", "5", "--checkpoint-dir", str(ckpt), "--out", str(out)], tg_env, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(out.read_text())["restored_step"] is None
    # Relaunched with the directory in the environment (and more steps): the same job, as under torchrun.
    env = {**tg_env, "TRAINGUARD_CHECKPOINT_DIR": str(ckpt)}
    again = run_cli(["run", "--nproc-per-node", "1", "--max-restarts", "0", str(EXAMPLE), "--steps", "12",
                     "--save-every", "5", "--out", str(out)], env, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(out.read_text())["restored_step"] == 9
    assert [p.name for p in ckpt.iterdir() if p.name != WRITERS_DIR] == [checkpoint_job_name(str(EXAMPLE), str(ckpt))]
