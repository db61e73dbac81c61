"""Placing saved shards without a process group: 2-D blocks (as a 2-D mesh or tensor parallel writes them) into a
plain tensor, replicas, and shards that do not cover the tensor."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, CheckpointError, Checkpointer, CorruptCheckpointError
from trainguard.checkpoint.storage import LocalStore
from trainguard.checkpoint.writer import write_rank_step

GLOBAL = torch.arange(60 * 40, dtype=torch.float32).view(60, 40)


def _write(tmp_path, blocks: list[tuple[tuple[int, int], tuple[int, int]]]) -> CheckpointConfig:
    store = LocalStore(str(tmp_path / "ck"), "j")
    for r, (o, sh) in enumerate(blocks):
        local = GLOBAL[o[0]:o[0] + sh[0], o[1]:o[1] + sh[1]].contiguous()
        tree = {"t": "dict", "k": ["w", "n"],
                "v": [{"t": "dtensor", "i": 0, "g": [60, 40], "o": list(o), "mesh": [len(blocks)], "pl": ["S(0)"]},
                      5]}
        write_rank_step(store, 7, r, len(blocks), tree, [("w", local)], sharded=True, chunk_bytes=1024)
    return CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})


@pytest.mark.parametrize("world", [1, 2])
def test_2d_blocks_and_a_replica_assemble_into_plain_tensors(tmp_path, world):
    # Three 2-D blocks plus a replica of the first (a Replicate dimension of the mesh writes the same box twice).
    cfg = _write(tmp_path, [((0, 0), (30, 25)), ((0, 25), (30, 15)), ((30, 0), (30, 40)), ((0, 0), (30, 25))])
    for rank in range(world):
        live = {"w": torch.zeros(60, 40), "n": 0}
        with Checkpointer(cfg, rank=rank, world_size=world, job="j") as ck:
            assert ck.restore(live) == 7
            # The replica's box is read once, from one rank only.
            assert not ({0, 3} <= set(ck.last_restore_read))
        assert torch.equal(live["w"], GLOBAL) and live["n"] == 5


def test_shards_that_do_not_cover_the_tensor_are_refused(tmp_path):
    cfg = _write(tmp_path, [((0, 0), (30, 40)), ((40, 0), (20, 40))])  # rows 30..39 were never saved
    with Checkpointer(cfg, rank=0, world_size=1, job="j") as ck:
        with pytest.raises(CorruptCheckpointError, match=r"w: no rank saved \[30:40, :\] of its \[60, 40\] \(400 of 2400 elements"):
            ck.restore({"w": torch.zeros(60, 40), "n": 0})


def test_plain_tensor_parallel_blocks_reshard_through_local_shard(tmp_path):
    """Megatron-style manual TP: each rank holds a plain block; saved on 2 ranks, restored on 3 and on 1."""
    from trainguard.checkpoint import LocalShard

    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False},
                           persist={"service": "inline", "chunk_mib": 1})
    for rank in range(2):  # column-parallel weight: rank r holds columns 20r..20r+19
        block = LocalShard(GLOBAL[:, 20 * rank:20 * rank + 20].clone(), (60, 40), (0, 20 * rank))
        with Checkpointer(cfg, rank=rank, world_size=2, job="tp") as ck:
            ck.save({"w": block}, 4)
            assert ck.wait(4, timeout=30)
    rows = [(0, 20), (20, 20), (40, 20)]  # now row-parallel over 3 ranks
    for rank, (start, n) in enumerate(rows):
        live = LocalShard(torch.zeros(n, 40), (60, 40), (start, 0))
        before = live.tensor
        with Checkpointer(cfg, rank=rank, world_size=3, job="tp") as ck:
            assert ck.restore({"w": live}) == 4
        assert live.tensor is before and torch.equal(before, GLOBAL[start:start + n])
    whole = torch.zeros(60, 40)
    with Checkpointer(cfg, rank=0, world_size=1, job="tp") as ck:
        assert ck.restore({"w": whole}) == 4
    assert torch.equal(whole, GLOBAL)
    with pytest.raises(CheckpointError, match="does not fit"):
        LocalShard(torch.zeros(30, 40), (60, 40), (40, 0))


def test_sharded_export_imports_back_as_its_own_step(tmp_path):
    """`ckpt import` of a sharded `ckpt export` came back as step 0: a resumed run restarted its schedule."""
    from trainguard.checkpoint import LocalShard
    from trainguard.checkpoint.dcp import export_step, import_dcp

    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False},
                           persist={"service": "inline"})
    for rank in range(2):
        block = LocalShard(GLOBAL[30 * rank:30 * rank + 30].clone(), (60, 40), (30 * rank, 0))
        with Checkpointer(cfg, rank=rank, world_size=2, job="tp") as ck:
            ck.save({"w": block, "n": 3}, 1234)
            assert ck.wait(1234, timeout=30)
    assert export_step(str(tmp_path / "ck"), "tp", None, str(tmp_path / "dcp")) == 1234
    assert import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck2"), "tp", world_size=3) == 1234
    assert import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck3"), "tp", step=7) == 7  # --step still wins
    whole = torch.zeros(60, 40)
    cfg2 = CheckpointConfig(directory=str(tmp_path / "ck2"), memory={"enabled": False},
                            persist={"service": "inline"})
    with Checkpointer(cfg2, rank=0, world_size=1, job="tp") as ck:
        assert ck.restore({"w": whole, "n": 0}) == 1234
    assert torch.equal(whole, GLOBAL)
    (tmp_path / "dcp" / "trainguard-export.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match="pass --step"):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck4"), "tp")
