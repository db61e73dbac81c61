"""A job that shrank resaves a step the larger world left half committed: the new copies make it complete."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from trainguard.checkpoint import Checkpointer, LocalShard


def _shard(rank: int, world: int, fill: float | None = None) -> dict[str, LocalShard]:
    n = 8 // world
    block = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) if fill is None else torch.full((n,), fill)
    return {"w": LocalShard(block, (8,), (rank * n,))}


def test_a_step_resaved_after_a_shrink_commits_despite_the_larger_worlds_markers(make_config, tmp_path):
    # Node A (ranks 0, 1 of 4) dies while persisting step 5; node B's ranks 2 and 3 had committed it. The job
    # shrinks to 2 ranks, restores step 4 and saves step 5 again. Before, ranks 2 and 3's markers (world size 4)
    # beside the new ones (world size 2) kept step 5 incomplete in every tier for ever, though wait() said True.
    cfg = make_config(memory={"keep": 2, "keep_on_close": True}, remote={"url": f"file://{tmp_path}/remote"})
    for rank in range(4):
        with Checkpointer(cfg, rank=rank, world_size=4, job="shrink") as c:
            c.save(_shard(rank, 4), 4)
            assert c.wait()
            if rank >= 2:
                c.save(_shard(rank, 4), 5)
                assert c.wait()
    for rank in range(2):
        with Checkpointer(cfg, rank=rank, world_size=2, job="shrink") as c:
            state = _shard(rank, 2, fill=-1.0)
            assert c.restore(state) == 4
            c.save(_shard(rank, 2), 5)
            assert c.wait()
    with Checkpointer(cfg, rank=1, world_size=2, job="shrink") as c:
        listed = {i.step: (i.world_size, i.tiers) for i in c.steps()}
        assert listed[5] == (2, ["memory", "disk", "remote"])
        state = _shard(1, 2, fill=-1.0)
        assert c.restore(state) == 5
        assert torch.equal(state["w"].tensor, torch.arange(4.0, 8.0))
    out = subprocess.run([sys.executable, "-m", "trainguard", "ckpt", "ls", cfg.directory, "--job", "shrink",
                          "--json", "--shm", cfg.memory.directory], capture_output=True, text=True, check=True)
    rows = {(r["step"], r["tier"]): r for r in json.loads(out.stdout)["steps"]}
    for tier in ("disk", "memory"):
        assert rows[(5, tier)]["complete"] and rows[(5, tier)]["world_size"] == 2, rows[(5, tier)]
