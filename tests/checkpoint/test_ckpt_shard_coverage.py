"""Ranks' `LocalShard` blocks that do not tile their tensor (a gap, an overlap): each rank's copy verifies on its
own, so the layout is what restore, `ckpt verify`, `gc` and `export` must check, all with the one check, and a
reshard before it writes anything."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer, CorruptCheckpointError, LocalShard
from trainguard.checkpoint.storage import LocalStore
from trainguard.checkpoint.writer import write_rank_step
from trainguard.cli import main

# (offset, rows) of each of two ranks' blocks of a [10, 3] tensor
LAYOUTS = {"gap": [(0, 4), (6, 4)], "overlap": [(0, 6), (4, 6)], "ok": [(0, 5), (5, 5)]}
MESSAGES = {"gap": r"x: no rank saved \[4:6, :\] of its \[10, 3\] \(6 of 30 elements are in no saved shard\)",
            "overlap": r"x: ranks 0 and 1 both saved \[4:6, 0:3\] of its \[10, 3\] \(their blocks \[0:6, 0:3\] "
                       r"and \[4:10, 0:3\] overlap\)"}


def _cfg(tmp_path) -> CheckpointConfig:
    return CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})


def _save(tmp_path, layout: str, step: int = 1) -> None:
    """Two ranks saved one after the other (no process group), each its block of x plus replicated values."""
    for r, (off, n) in enumerate(LAYOUTS[layout]):
        with Checkpointer(_cfg(tmp_path), rank=r, world_size=2, job="j") as ck:
            ck.save({"a": torch.full((2,), float(step)), "epoch": step,
                     "x": LocalShard(torch.full((n, 3), float(10 * step + r + 1)), (10, 3), (off, 0))}, step)
            assert ck.wait(step, timeout=60)


def _fresh() -> dict:
    # "a" and "epoch" come before x: a check made as x loads would find them already overwritten.
    return {"a": torch.zeros(2), "epoch": 0, "x": LocalShard(torch.full((10, 3), -7.0), (10, 3), (0, 0))}


def _untouched(state: dict) -> bool:
    return (torch.equal(state["a"], torch.zeros(2)) and state["epoch"] == 0
            and torch.equal(state["x"].tensor, torch.full((10, 3), -7.0)))


def _cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ckpt", *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("layout", ["gap", "overlap"])
@pytest.mark.parametrize("corrupt_ok", [False, True])
def test_a_reshard_of_shards_that_do_not_tile_refuses_before_writing(tmp_path, layout, corrupt_ok):
    """Before, the overlaps were copied into x and the coverage counted after: the restore raised over a tensor
    with rows 0-3 and 6-9 overwritten, with corrupt_ok=True too, and an overlap read "a rank's copy is missing"."""
    _save(tmp_path, layout)
    state = _fresh()
    with Checkpointer(_cfg(tmp_path), rank=0, world_size=1, job="j") as ck:
        if corrupt_ok:  # as for a step failing its checksums: no other step, so a fresh start, state untouched
            assert ck.restore(state, corrupt_ok=True) is None
        else:
            with pytest.raises(CorruptCheckpointError, match=MESSAGES[layout]) as exc:
                ck.restore(state)
            assert "do not tile the tensor" in str(exc.value) and "already loaded" not in str(exc.value)
    assert _untouched(state)


def test_a_step_whose_shards_do_not_tile_falls_back_to_the_older_step(tmp_path):
    _save(tmp_path, "ok", step=1)
    _save(tmp_path, "gap", step=2)
    for corrupt_ok in (False, True):
        state = _fresh()
        with Checkpointer(_cfg(tmp_path), rank=0, world_size=1, job="j") as ck:
            assert ck.restore(state, corrupt_ok=corrupt_ok) == 1
        assert state["epoch"] == 1 and torch.equal(state["a"], torch.ones(2))
        assert state["x"].tensor[:, 0].tolist() == [11.0] * 5 + [12.0] * 5


def test_the_saving_layout_still_restores_and_a_tiling_layout_reshards(tmp_path):
    """Each rank restoring its own block reads only its own copy: no other rank's manifest, no layout check."""
    _save(tmp_path, "gap")
    for r, (off, n) in enumerate(LAYOUTS["gap"]):
        live = {"a": torch.zeros(2), "epoch": 0, "x": LocalShard(torch.zeros(n, 3), (10, 3), (off, 0))}
        with Checkpointer(_cfg(tmp_path), rank=r, world_size=2, job="j") as ck:
            assert ck.restore(live) == 1
        assert torch.equal(live["x"].tensor, torch.full((n, 3), float(11 + r)))
    whole = {"a": torch.zeros(2), "epoch": 0, "x": torch.zeros(10, 3)}
    _save(tmp_path / "ok", "ok")
    with Checkpointer(_cfg(tmp_path / "ok"), rank=0, world_size=1, job="j") as ck:
        assert ck.restore(whole) == 1
    assert whole["x"][:, 0].tolist() == [11.0] * 5 + [12.0] * 5


@pytest.mark.parametrize("layout", ["gap", "overlap"])
def test_verify_gc_and_export_report_the_same_problem_as_restore(tmp_path, layout):
    """Before, `ckpt verify` said OK (exit 0) and gc kept the step as valid while export refused it."""
    _save(tmp_path, layout)
    root = str(tmp_path / "ck")
    out = _cli("verify", root)
    assert out.returncode == 1, out.stdout
    assert out.stdout.count(": OK") == 2  # each rank's copy is intact; the step is not
    assert "step 1: INCONSISTENT SHARDS: " in out.stdout
    assert len(re.findall(MESSAGES[layout], out.stdout)) == 1
    gc = _cli("gc", root, "--keep", "1", "--dry-run")
    assert gc.returncode == 1 and "CORRUPT, not counted" in gc.stdout and "inconsistent shards: x:" in gc.stdout
    dest = tmp_path / "out"
    exp = _cli("export", root, str(dest))
    assert exp.returncode == 2 and re.search(MESSAGES[layout], exp.stderr), exp.stderr
    assert not dest.exists() or not os.listdir(dest)  # refused before any file was written


def test_verify_of_a_consistent_sharded_step_is_ok(tmp_path):
    _save(tmp_path, "ok")
    out = _cli("verify", str(tmp_path / "ck"))
    assert out.returncode == 0 and "INCONSISTENT" not in out.stdout


def _manifests(tmp_path, blocks: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> dict:
    store = LocalStore(str(tmp_path / "raw"), "j")
    out = {}
    for r, (g, o, sh) in enumerate(blocks):
        tree = {"t": "dict", "k": ["w"],
                "v": [{"t": "dtensor", "i": 0, "g": list(g), "o": list(o), "mesh": [], "pl": ["local"]}]}
        out[r] = write_rank_step(store, 3, r, len(blocks), tree, [("w", torch.zeros(sh))], sharded=True)
    return out


@pytest.mark.parametrize("blocks,problem", [
    # a 2-D grid with one block missing: no whole row or column is missing, so the count names it
    ([((4, 4), (0, 0), (2, 2)), ((4, 4), (0, 2), (2, 2)), ((4, 4), (2, 0), (2, 2))],
     r"w: no rank saved some elements of its \[4, 4\] \(4 of 16 elements are in no saved shard\)"),
    # column-parallel blocks leaving columns 3..4 out
    ([((4, 6), (0, 0), (4, 3)), ((4, 6), (0, 5), (4, 1))], r"w: no rank saved \[:, 3:5\] of its \[4, 6\]"),
    ([((4, 4), (0, 0), (2, 4)), ((6, 4), (2, 0), (2, 4))],
     r"w: rank 0 saved it as a block of a \[4, 4\] tensor, rank 1 of a \[6, 4\] one"),
    # a replica (the same box twice) and an empty shard (uneven sharding) are no overlap
    ([((4, 4), (0, 0), (4, 4)), ((4, 4), (0, 0), (4, 4)), ((4, 4), (4, 0), (0, 4))], None),
])
def test_layout_problems_name_the_region_or_the_disagreement(tmp_path, blocks, problem):
    from trainguard.checkpoint.shards import shard_layout_problems

    problems = shard_layout_problems(_manifests(tmp_path, blocks))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and re.match(problem, problems[0]), problems
