"""The agent's memory-tier report (agent/memory_tier.py): verified holdings of the node's arena, a corrupt copy
never reported, a reused slot re-verified, copies of another checkpoint location ignored, and the restore plan
handed to each local worker's environment."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest

from trainguard.agent.memory_tier import MemoryTier, apply_restore_plan
from trainguard.agent.workers import WorkerSpec
from trainguard.checkpoint.arena import Arena, write_tag
from trainguard.checkpoint.config import RESTORE_PLAN_ENV
from trainguard.checkpoint.manifest import Manifest, compute_checksums, plan_layout
from trainguard.proto import coordinator_pb2 as pb


@pytest.fixture
def root():
    d = f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _copy(root: str, rank: int, step: int, slot: int = 0, location: str = "/ckpt", fill: int = 7) -> Arena:
    """Writes one complete memory-tier copy the way the persist process leaves it (data, manifest, tag)."""
    entries, nbytes = plan_layout([("w", "float32", (3000,))], 4096)
    arena = Arena(root, "job", rank, 2)
    s = arena.get(slot, nbytes)
    s.map[:nbytes] = bytes([fill]) * nbytes
    man = Manifest(job="job", step=step, rank=rank, world_size=2, tensors=entries, tree={}, data_bytes=nbytes,
                   chunk_bytes=4096, created=time.time(), location=location)
    man.chunks = compute_checksums(memoryview(s.map), nbytes, 4096)
    with open(s.paths.manifest, "wb") as f:
        f.write(man.to_json())
    write_tag(s.paths, str(step))
    return arena


def test_reports_verified_copies_and_never_a_corrupt_one(root) -> None:
    a0, a1 = _copy(root, 0, 10), _copy(root, 1, 10)
    _copy(root, 0, 5, slot=1, location="/elsewhere")  # same job name, another checkpoint directory
    tier = MemoryTier(root, "job", "/ckpt")
    held = tier.scan()
    assert [(h.step, h.world_size, list(h.ranks)) for h in held] == [(10, 2, [0, 1])]
    _copy(root, 1, 10).slots[0].map[5000] ^= 0xFF  # rank 1's copy rewritten, then damaged
    tier2 = MemoryTier(root, "job", "/ckpt")
    assert [(h.step, list(h.ranks)) for h in tier2.scan()] == [(10, [0])] and tier2.corrupt == 1
    _copy(root, 1, 20)  # the slot is rewritten with a new step: verified anew and reported
    assert [(h.step, list(h.ranks)) for h in tier2.scan()] == [(20, [1]), (10, [0])]
    assert tier2.holdings() == tier2.scan()
    a0.close()
    a1.close()


def test_background_scan_and_the_plan_in_each_workers_environment(root) -> None:
    _copy(root, 0, 4)
    tier = MemoryTier(root, "job", "/ckpt", interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while not tier.holdings() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [h.step for h in tier.holdings()] == [4]
    finally:
        tier.stop()
    plan = pb.MemoryRestorePlan(step=4, memory_steps=[4], ranks=[
        pb.RankRestore(rank=0, source=pb.RESTORE_SOURCE_LOCAL_MEMORY),
        pb.RankRestore(rank=1, source=pb.RESTORE_SOURCE_PEER_MEMORY, peer_node="b")])
    specs = [WorkerSpec(r, r, ["x"], {RESTORE_PLAN_ENV: "stale"}) for r in (0, 1)]
    apply_restore_plan(specs, plan, generation=3)
    got = [json.loads(s.env[RESTORE_PLAN_ENV]) for s in specs]
    assert got[0] == {"generation": 3, "step": 4, "memory_steps": [4], "source": "local_memory", "peer_node": ""}
    assert (got[1]["source"], got[1]["peer_node"]) == ("peer_memory", "b")
    apply_restore_plan(specs, None, generation=4)  # no plan: no stale one left behind
    assert all(RESTORE_PLAN_ENV not in s.env for s in specs)


def test_no_checkpoint_dir_no_tier(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", str(tmp_path / "shm"))
    assert MemoryTier.for_checkpoint_dir(None, "job") is None
    tier = MemoryTier.for_checkpoint_dir(str(tmp_path / "c"), "job")
    assert tier.shm_root == str(tmp_path / "shm") and tier.location == os.path.realpath(tmp_path / "c")
    assert tier.scan() == []


def test_job_memory_takes_the_plan_of_a_new_generation_only_and_merges_heartbeat_fields(root) -> None:
    from trainguard.agent.job_memory import HeartbeatParts, JobMemory
    from trainguard.agent.replica_agent import ReplicaConfig

    _copy(root, 0, 4)
    jm = JobMemory(MemoryTier(root, "job", "/ckpt"), None)
    plan = pb.MemoryRestorePlan(step=4, memory_steps=[4])
    start = pb.NodeHeartbeatResponse(command=pb.NODE_COMMAND_RESTART, restore_plan=plan)
    start.rank_table.generation = 3
    jm.follow(start, current_generation=2)
    assert jm.plan == plan
    jm.follow(start, current_generation=3)  # the same START heard again once its workers run: kept
    jm.follow(pb.NodeHeartbeatResponse(command=pb.NODE_COMMAND_NONE), current_generation=3)
    assert jm.plan == plan
    again = pb.NodeHeartbeatResponse(command=pb.NODE_COMMAND_START)
    again.rank_table.generation = 4
    jm.follow(again, current_generation=3)
    assert jm.plan is None  # a START without a plan: no stale plan for the new workers

    class Workers:
        def heartbeat_fields(self):
            return {"generation": 3, "last_step": 9}

    fields = HeartbeatParts(Workers(), jm, None).heartbeat_fields()
    assert fields["generation"] == 3 and [h.step for h in fields["memory"]] == [4] and fields["replica_address"] == ""
    assert JobMemory.for_node("/ckpt", "job", "host", ReplicaConfig(), "n", "127.0.0.1") is None
