"""The hook in user scripts as the README shows them, launched by plain torchrun (gloo on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tg_testutil
from tg_testutil import REPO

WORKER = Path(__file__).resolve().parent / "hook_user_worker.py"


def free_port() -> int:
    return tg_testutil.free_port()


def _torchrun(nproc: int, args: list, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(WORKER), *map(str, args)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_fsdp2_resume_and_one_ranks_failed_restore_through_the_hook(tmp_path: Path, tg_env: dict) -> None:
    # Two properties, each in its own checkpoint directory (its own job), in the same two torchrun launches of
    # the worker (each launch runs the FSDP2 scenario, then the failing restore's):
    # 1. A fresh AdamW has no state, so the saved moments of the FSDP2 parameters had nothing to be placed into:
    # they came back as plain tensors and the first opt.step() after the restore raised "got mixed torch.Tensor
    # and DTensor". Now the resumed run ends bitwise where the uninterrupted one did.
    # 2. The Checkpointer's restore is a collective: when one rank's restore raises (here a user's
    # load_state_dict assert), every other rank raises CheckpointError. The hook then ran an agreement of its own,
    # which the rank whose error was not a TrainguardError never reached: the others waited in it for that rank's
    # exit and raised gloo's "Connection closed by peer" instead.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    for launch in (1, 2):
        (out / f"fsdp-{launch}").mkdir(parents=True)
    for launch in (1, 2):
        r = _torchrun(2, ["fsdp+restore_fails", ckpt, out, launch], tg_env)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = (json.loads((out / f"fsdp-{launch}" / "result.json").read_text()) for launch in (1, 2))
    assert (a["start"], b["start"]) == (0, 4)
    assert b["digest"] == a["digest"]
    raised = [json.loads((out / f"rank{rank}.json").read_text())["raised"] for rank in (0, 1)]
    assert raised == ["CheckpointError", "AssertionError"]


@pytest.mark.timeout(300)
def test_processes_from_mp_spawn_take_their_place_from_their_process_group(tmp_path: Path, tg_env: dict) -> None:
    # mp.spawn sets no RANK/WORLD_SIZE: the script builds its group with init_process_group(rank=r, world_size=n).
    # Every process took itself for rank 0 of 1, so rank 1's saves were all refused (one writer per job and rank)
    # and the resume loaded one rank's state into both.
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in tg_env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        out.mkdir()
        r = subprocess.run([sys.executable, str(WORKER), "spawn", str(ckpt), str(out), str(free_port())], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append([json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)])
    for rank in (0, 1):
        first, second = runs[0][rank], runs[1][rank]
        assert (first["rank"], first["world"], first["errors"]) == (rank, 2, [])
        assert second["restored"] == 2 and second["w"] == [float(rank)] * 4
    # trainguard.init() before init_process_group cannot know its place: restore says so instead of loading one
    # rank's state into every rank.
    out = tmp_path / "late"
    out.mkdir()
    r = subprocess.run([sys.executable, str(WORKER), "spawn-late", str(ckpt), str(out), str(free_port())], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads((out / f"rank{rank}.json").read_text())["raised"] for rank in (0, 1)] == ["UsageError"] * 2


@pytest.mark.timeout(300)
def test_saves_of_a_session_made_before_its_process_group_are_refused_naming_the_order(tmp_path: Path,
                                                                                       tg_env: dict) -> None:
    # trainguard.init() before init_process_group in processes mp.spawn started: each took itself for rank 0 of
    # 1. Without a restore() to say so, the first process to save committed its own state as the job's whole step
    # (world size 1), and the other latched "another process writes this job ... give it another job name" at
    # every save. Now every save is refused on every rank with the error restore() gives, and nothing is written.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in tg_env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, str(WORKER), "spawn-late-save", str(ckpt), str(out), str(free_port())],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        errors = json.loads((out / f"rank{rank}.json").read_text())["errors"]
        assert [kind for kind, _ in errors] == ["UsageError", "UsageError"], errors
        assert "call init_process_group() first" in errors[0][1]
    assert not list(ckpt.rglob("*.commit"))


@pytest.mark.timeout(120)
def test_a_zero_dimensional_numpy_array_resumes(tmp_path: Path) -> None:
    # np.ascontiguousarray gives at least one dimension, so np.array(0.5) (a best loss kept as an array) was saved
    # as shape [1] and the restore into the live 0-d array raised StateMismatchError: the job could not resume.
    import numpy as np

    import trainguard

    job = f"np0-{tmp_path.name}"
    with trainguard.init(checkpoint_dir=str(tmp_path / "ckpt"), job=job) as session:
        assert session.save({"best": np.array(0.5), "hist": np.arange(3.0)}, 0)
    state = {"best": np.array(9.0), "hist": np.zeros(3)}
    with trainguard.init(checkpoint_dir=str(tmp_path / "ckpt"), job=job) as session:
        assert session.restore(state) == 1
    assert state["best"].shape == () and float(state["best"]) == 0.5
    assert state["hist"].tolist() == [0.0, 1.0, 2.0]
    # Restored without a live array to fill, it keeps its shape too.
    fresh = {"best": None, "hist": None}
    with trainguard.init(checkpoint_dir=str(tmp_path / "ckpt"), job=job) as session:
        assert session.restore(fresh) == 1
    assert fresh["best"].shape == () and float(fresh["best"]) == 0.5


@pytest.mark.timeout(120)
def test_a_loop_that_ignores_restores_result_is_latched(tmp_path: Path) -> None:
    # `session.restore(state)` and then `for step in range(total)`: the new run's saves replaced the old run's
    # checkpoints of the same steps, and every restart resumed the old run's newest step, with no word.
    import trainguard
    from trainguard.errors import UsageError

    job, ckpt = f"again-{tmp_path.name}", str(tmp_path / "ckpt")
    with trainguard.init(checkpoint_dir=ckpt, job=job, save_every=5) as session:
        for step in range(10):
            session.step_done(step, {"w": torch.full((2,), float(step))})
    state = {"w": torch.zeros(2)}
    with trainguard.init(checkpoint_dir=ckpt, job=job, save_every=5) as session:
        assert session.restore(state) == 10
        for step in range(3):
            session.step_done(step, state)
    assert len(session.errors) == 1 and isinstance(session.errors[0], UsageError)
    assert "restore() loaded step 9" in str(session.errors[0]) and "(10)" in str(session.errors[0])
    # Starting where restore() says is no error.
    with trainguard.init(checkpoint_dir=ckpt, job=job, save_every=5) as session:
        start = session.restore(state)
        for step in range(start, start + 3):
            session.step_done(step, state)
    assert session.errors == []


@pytest.mark.timeout(120)
def test_save_every_without_a_checkpoint_directory_says_nothing_is_saved(tmp_path: Path, tg_env: dict) -> None:
    # trainguard.init(save_every=20) relies on $TRAINGUARD_CHECKPOINT_DIR, which plain torchrun does not set: the
    # run saved nothing and a relaunch started from step 0, with no word. Without save_every nothing is said.
    env = {k: v for k, v in tg_env.items() if k != "TRAINGUARD_CHECKPOINT_DIR"}
    # Both settings in one process (save_every=0 first, then 20; a marker between them): one interpreter and
    # torch import instead of two. The warning is a plain log.warning, said at every init that asks for saves.
    script = ("import sys, trainguard, torch\n"
              "for every in (0, 20):\n"
              "    s = trainguard.init(save_every=every)\n"
              "    for step in range(3):\n"
              "        s.step_done(step, {'w': torch.zeros(2)})\n"
              "    s.close()\n"
              "    print('=== tg-test: every', every, 'done', file=sys.stderr, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    zero, twenty = r.stderr.split("=== tg-test: every 0 done")
    assert "=== tg-test: every 20 done" in twenty, r.stderr[-2000:]
    said = ["no checkpoint directory is set" in text for text in (twenty, zero)]
    assert said == [True, False], r.stderr[-2000:]
