"""Job-wide memory tier (checkpoint/restore_plan.py): a rank whose node holds its own copy of a step restores it
from memory when the coordinator's restore plan says every rank's copy is in its own node's memory, although the
other ranks' copies lie on other hosts; without the plan, or when its copy is missing or corrupt, it reads disk.

Two arena roots stand for two hosts; the disk tier is shared, as a cluster file system would be."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.arena import Arena, memory_manifests, write_tag
from trainguard.checkpoint.storage import LocalStore
from trainguard.checkpoint.tree import capture
from trainguard.checkpoint.writer import write_rank_step
from trainguard.checkpoint.config import RESTORE_PLAN_ENV
from ckpt_helpers import assert_same, flat, small_model, train_step


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Step 3 of 2 ranks committed on the shared disk, and each rank's copy in its own host's arena.

    The copies are written as the disk writer and the persist process leave them (the drill test covers the
    whole path through a Checkpointer's save); this keeps the module free of persist processes.
    """
    tmp_path = tmp_path_factory.mktemp("jw")
    roots = [f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    states = []
    for rank, root in enumerate(roots):
        cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), memory={"directory": root})
        m, opt = small_model(seed=rank)
        train_step(m, opt)
        cap = capture({"model": m, "optim": opt})
        store = LocalStore(cfg.disk_directory, "jw")
        man = write_rank_step(store, 3, rank, 2, cap.tree, [(c.key, c.tensor) for c in cap.tensors])
        man.location = cfg.location
        data = open(store.local_data_path(3, rank), "rb").read(man.data_bytes)
        slot = Arena(root, "jw", rank, 2).get(0, man.data_bytes)
        slot.map[:man.data_bytes] = data
        with open(slot.paths.manifest, "wb") as f:
            f.write(man.to_json())
        write_tag(slot.paths, "3")
        states.append(flat(m, opt))
    yield tmp_path, roots, states
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)


def _restore(tmp_path, root: str, rank: int) -> tuple[Checkpointer, dict[str, torch.Tensor], int | None]:
    cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), memory={"directory": root})
    ck = Checkpointer(cfg, rank=rank, world_size=2, job="jw")
    m, opt = small_model(seed=9)
    train_step(m, opt)
    step = ck.restore({"model": m, "optim": opt})
    return ck, flat(m, opt), step


def test_planned_step_restores_each_rank_from_its_own_hosts_memory(two_hosts, monkeypatch) -> None:
    tmp_path, roots, states = two_hosts
    ck, got, step = _restore(tmp_path, roots[0], 0)
    assert step == 3 and ck.last_restore_tier == "disk"  # today: the memory tier needs every copy on one host
    monkeypatch.setenv(RESTORE_PLAN_ENV, json.dumps({"generation": 2, "step": 3, "memory_steps": [3],
                                                     "source": "local_memory"}))
    for rank in (0, 1):
        ck, got, step = _restore(tmp_path, roots[rank], rank)
        assert step == 3 and ck.last_restore_tier == "memory"
        assert_same(got, states[rank])
    ck, _, _ = _restore(tmp_path, roots[1], 0)  # rank 0's copy is not on host 1: disk
    assert ck.last_restore_tier == "disk"


def test_corrupt_or_unplanned_local_copy_falls_back_to_disk(two_hosts, monkeypatch) -> None:
    tmp_path, roots, states = two_hosts
    monkeypatch.setenv(RESTORE_PLAN_ENV, json.dumps({"memory_steps": [2]}))  # a step this host does not hold
    ck, got, step = _restore(tmp_path, roots[0], 0)
    assert step == 3 and ck.last_restore_tier == "disk"
    monkeypatch.setenv(RESTORE_PLAN_ENV, json.dumps({"memory_steps": [3]}))
    paths, man = memory_manifests(roots[0], "jw")[3][0]
    with open(paths.data, "r+b") as f:  # one flipped byte inside the first tensor
        f.seek(man.tensors[0].offset)
        b = f.read(1)
        f.seek(man.tensors[0].offset)
        f.write(bytes([b[0] ^ 0xFF]))
    try:
        ck, got, step = _restore(tmp_path, roots[0], 0)
        assert step == 3 and ck.last_restore_tier == "disk"
        assert_same(got, states[0])
    finally:  # the fixture is shared by this module's tests
        with open(paths.data, "r+b") as f:
            f.seek(man.tensors[0].offset)
            f.write(b)
    monkeypatch.setenv(RESTORE_PLAN_ENV, "{not json")
    ck, _, step = _restore(tmp_path, roots[0], 0)
    assert step == 3 and ck.last_restore_tier == "disk"
