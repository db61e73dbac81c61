"""A fresh run started in an old job name and checkpoint directory that holds higher steps of that job.

Saving a lower step means the job went back, so each rank's copies of the higher steps are removed from every
tier. A run started from scratch there (no restore()) therefore deleted the earlier run's newer checkpoints at
its first save, silently, and retention then kept whichever steps were newest. Now that first save is refused
with an error naming the steps and the ways out; ``checkpoint.overwrite`` replaces them on purpose."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.storage import LocalStore


def _state(step: int) -> dict:
    return {"w": torch.full((64,), float(step))}


def _old_run(cfg: CheckpointConfig, steps=(100, 200, 300)) -> None:
    with Checkpointer(cfg, job="exp") as ck:
        for s in steps:
            assert ck.save(_state(s), s).wait(60)


def test_a_fresh_run_is_refused_before_it_deletes_an_old_runs_higher_steps(make_config) -> None:
    cfg = make_config(disk={"keep": 3})
    _old_run(cfg)
    store = LocalStore(cfg.disk_directory, "exp")
    with Checkpointer(cfg, job="exp") as ck:
        with pytest.raises(CheckpointError) as info:
            ck.save(_state(10), 10)
        msg = str(info.value)
        assert "steps 100, 200, 300" in msg and "restore()" in msg and "checkpoint.overwrite = true" in msg
    assert [s for s, _ in store.committed_steps()] == [100, 200, 300]  # nothing deleted
    with Checkpointer(cfg, job="exp") as ck:  # resuming that run: restore, then save on
        state = _state(0)
        assert ck.restore(state) == 300 and ck.save(_state(301), 301).wait(60)
    assert [s for s, _ in store.committed_steps()] == [200, 300, 301]


def test_a_fresh_run_is_refused_over_the_memory_tier_a_crashed_run_left(make_config) -> None:
    cfg = make_config(disk={"enabled": False}, memory={"keep_on_close": True})
    _old_run(cfg, steps=(100,))
    with Checkpointer(cfg, job="exp") as ck:
        with pytest.raises(CheckpointError, match=r"memory \(.*\): steps 100"):
            ck.save(_state(10), 10)
        state = _state(0)
        assert ck.restore(state) == 100 and float(state["w"][0]) == 100.0  # still there


def test_overwrite_replaces_the_old_runs_steps_and_leaves_no_empty_folder_nor_stale_record(make_config) -> None:
    cfg = make_config(disk={"keep": 3})
    _old_run(cfg)
    store = LocalStore(cfg.disk_directory, "exp")
    with Checkpointer(make_config(disk={"keep": 3}, overwrite=True), job="exp") as ck:
        for s in (10, 20):
            assert ck.save(_state(s), s).wait(60)
    assert [s for s, _ in store.committed_steps()] == [10, 20]
    assert store.list_steps() == [10, 20]  # the replaced steps' folders are gone, not listed as incomplete
    with open(os.path.join(cfg.disk_directory, "exp", "COMMITTED.json")) as f:
        assert json.load(f)["step"] == 20  # the record named step 300, which no longer existed


def test_a_fresh_run_in_an_empty_or_lower_location_saves_as_before(make_config) -> None:
    cfg = make_config()
    _old_run(cfg, steps=(5,))
    with Checkpointer(cfg, job="exp") as ck:  # higher than what is there: a fresh run may continue numbering
        assert ck.save(_state(6), 6).wait(60)
        assert ck.save(_state(3), 3).wait(60)  # then going back within this run is allowed, as before
    with Checkpointer(cfg, job="other") as ck:  # another job name beside it
        assert ck.save(_state(1), 1).wait(60)


def test_a_fresh_run_on_a_new_node_does_not_delete_the_remote_tiers_higher_steps(make_config, tmp_path) -> None:
    """A new node's disk is empty, but the remote (uploaded by the earlier run) holds the higher steps, which
    the first save's upload removed there. The upload is refused instead (training is not held up listing a
    remote that may hang); a resumed run, or one with ``overwrite``, uploads as before."""
    from trainguard.checkpoint.storage import FsspecStore

    remote = {"url": f"file://{tmp_path}/remote"}
    _old_run(make_config(memory={"enabled": False}, remote=remote), steps=(100,))
    events = []
    cfg = make_config(memory={"enabled": False}, remote=remote, directory=str(tmp_path / "new-node-disk"))
    with Checkpointer(cfg, job="exp", on_event=events.append) as ck:
        assert not ck.save(_state(10), 10).wait(60)  # on disk, not uploaded
    said = " ".join(str(getattr(e, "message", e)) for e in events)
    assert "step 10 not uploaded" in said and "higher steps 100" in said and "checkpoint.overwrite" in said
    store = FsspecStore(remote["url"], "exp")
    assert [s for s, _ in store.committed_steps()] == [100]
    over = make_config(memory={"enabled": False}, remote=remote, directory=str(tmp_path / "third"), overwrite=True)
    with Checkpointer(over, job="exp") as ck:
        assert ck.save(_state(11), 11).wait(60)
    assert [s for s, _ in store.committed_steps()] == [11]
