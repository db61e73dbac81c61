"""Sharded state (FSDP2, tensor parallel) in real multi-process gloo jobs on CPU: saved shard-locally on 4 ranks,
restored in the same layout, resharded onto 2 ranks and onto 1 plain process, exported to DCP (loaded by
``dcp.load`` at 2 ranks) and imported from a 4-rank ``dcp.save`` checkpoint; all bitwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ckpt_cli_dcp import _cli
from tg_testutil import communicate_all

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.storage import data_name, manifest_name, step_dirname

HERE = Path(__file__).parent
# ~15 s for the module on a quiet 2-core machine, ~50 s loaded (4 + 2 sharded_worker ranks, 2 agree_worker
# ranks); bounded well above.
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed"),
              pytest.mark.timeout(480)]


def _run(scenario: str, world: int, workdir: Path, timeout: float = 240) -> list[dict]:
    """Runs ``world`` ranks of sharded_worker.py; returns each rank's JSON facts (fails on any rank's failure)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "sharded_worker.py"), scenario, str(r), str(world),
                               str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    out = []
    for r, (rc, stdout, stderr) in enumerate(communicate_all(procs, timeout)):
        assert rc == 0, f"rank {r} of {scenario} failed:\n{stderr[-4000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-rank FSDP2 + Adam job and a 4-rank tensor-parallel job, saved shard-locally (plus references)."""
    work = tmp_path_factory.mktemp("sharded")
    facts = _run("save", 4, work)
    return work, facts


def test_saved_shard_locally_and_restored_in_the_same_layout(saved):
    work, facts = saved
    root = work / "ckpt" / "fsdp"
    sizes = []
    for r in range(4):
        man = Manifest.from_json((root / step_dirname(3) / manifest_name(r)).read_bytes())
        assert man.sharded and man.world_size == 4
        sizes.append(man.data_bytes)
        nodes = json.dumps(man.tree)
        assert '"t": "dtensor"' in nodes and '"g": [256, 64]' in nodes and f'"o": [{64 * r}, 0]' in nodes
    ref = torch.load(work / "ref_fsdp.pt", weights_only=True)
    full_bytes = sum(v.numel() * v.element_size() for v in ref.values())
    assert max(sizes) < full_bytes / 2  # each rank wrote its shards only (no gather to rank 0)
    for f in facts:
        assert f["same_layout_diff"] == []
        assert list(f["same_layout_read"]) == [str(f["rank"])]  # only its own copy was read


@pytest.fixture(scope="module")
def two_ranks(saved):
    """The saved "fsdp" job exported by `ckpt export`, the dcp.save checkpoint imported by `ckpt import`, a copy
    of "fsdp" with one rank's data corrupt, then one 2-rank launch running the reshard and the DDP-to-FSDP2
    scenarios in turn (starting the ranks costs more than either scenario). Returns the folder, both CLI
    results and each rank's facts."""
    work, _ = saved
    root = work / "ckpt"
    exp = _cli("export", str(root), "--job", "fsdp", str(work / "exported"))
    imp = _cli("import", str(work / "dcp_native"), str(root), "--job", "imported", "--world-size", "3")
    shutil.copytree(root / "fsdp", root / "fsdp_bad")
    bad = root / "fsdp_bad" / step_dirname(3) / data_name(2)
    raw = bytearray(bad.read_bytes())
    raw[1000] ^= 0xFF
    bad.write_bytes(bytes(raw))
    return work, exp, imp, _run("reshard,ddp_to_fsdp", 2, work)


def test_reshard_to_two_ranks_dcp_export_import_and_corrupt_rank(two_ranks):
    work, exp, imp, facts = two_ranks
    root = work / "ckpt"
    assert exp.returncode == 0, exp.stderr
    assert imp.returncode == 0, imp.stderr
    for f in facts:
        assert f["fsdp_diff"] == [] and f["tp_diff"] == [] and f["import_diff"] == [] and f["dcp_diff"] == []
        assert f["tier"] == "disk"
        assert "model.0.weight" in f["fsdp_keys"] and "optim.state.0.weight.exp_avg_sq" in f["fsdp_keys"]
        # Each rank read only the saved ranks its shards overlap (rank 1 the replicated leaves of its source).
        touched = {int(r) for r in f["read"]}
        assert touched <= ({0, 1} if f["rank"] == 0 else {1, 2, 3}), touched
    assert facts[0]["read"] and sum(facts[0]["read"].values()) < sum(
        os.path.getsize(root / "fsdp" / step_dirname(3) / data_name(r)) for r in range(4)) * 0.75
    # Rank 0 needs saved ranks 0-1 (intact), rank 1 needs the corrupt rank 2: both raise, neither hangs.
    assert facts[1]["bad_raised"] == "CorruptCheckpointError"
    assert facts[0]["bad_raised"] == "CheckpointError"  # a TrainguardError: the checkpointer's agreement raised it


def test_reshard_to_one_plain_process_for_evaluation(saved):
    from sharded_worker import config, make_model

    work, _ = saved
    ref = torch.load(work / "ref_fsdp.pt", weights_only=True)
    model = make_model(42)
    with Checkpointer(config(str(work)), rank=0, world_size=1, job="fsdp") as ck:
        assert ck.restore({"model": model}) == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[f"model.{k}"]), k
    tp_ref = torch.load(work / "ref_tp.pt", weights_only=True)
    plain = make_model(43)
    with Checkpointer(config(str(work)), rank=0, world_size=1, job="tp") as ck:
        assert ck.restore({"model": plain}) == 1
    for k, v in plain.state_dict().items():
        assert torch.equal(v, tp_ref[k]), k


def test_direct_restore_in_a_process_group_agrees_on_one_step(tmp_path):
    # The README's sharded example calls Checkpointer.restore on every rank without the hook. Rank 1's copy of
    # the newest step is torn: it fell back to step 1 while rank 0 loaded step 2, and the job trained from a mix
    # of both. Now every rank resumes from step 1; with no step left for rank 1, every rank raises (none hangs).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "agree_worker.py"), str(r), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    facts = []
    for r, (rc, stdout, stderr) in enumerate(communicate_all(procs, 120)):
        assert rc == 0, f"rank {r} failed:\n{stderr[-4000:]}"
        facts.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [f["a"] for f in facts] == [1, 1]
    assert [f["a_w"] for f in facts] == [1.0, 11.0]  # step 1 of each rank, not rank 0's step 2
    assert facts[0]["b"] == "CheckpointError" and facts[1]["b"] == "CorruptCheckpointError"


def test_a_plain_ddp_checkpoint_restores_into_fsdp2_with_its_optimizer(two_ranks):
    """Moving a job from DDP to FSDP2: the model's restore raised "got mixed torch.Tensor and DTensor" (copy_ of
    the full tensor into the sharded parameter), and Adam's moments, loaded whole, failed the first step() the
    same way. Each rank now copies its own region of every plain tensor, moments included; bitwise. (Its own
    job "ddp" in the 2-rank launch of the reshard test.)"""
    facts = two_ranks[3]
    assert [f["rank"] for f in facts] == [0, 1]
    for f in facts:
        assert f["ddp_to_fsdp_diff"] == [], f


def _corrupt_copy(work: Path, job: str, how: str) -> None:
    """A copy of the saved "fsdp" job as ``job`` whose rank 2 data is bad (``flip``: one byte; ``cut``: the last
    half gone)."""
    root = work / "ckpt"
    shutil.copytree(root / "fsdp", root / job)
    bad = root / job / step_dirname(3) / data_name(2)
    raw = bytearray(bad.read_bytes())
    if how == "flip":
        raw[len(raw) // 2] ^= 0xFF
    else:
        del raw[len(raw) // 2:]
    bad.write_bytes(bytes(raw))


@pytest.mark.parametrize("how,verify", [("flip", True), ("cut", False)])
def test_a_bad_copy_in_a_reshard_with_corrupt_ok_leaves_the_state_untouched(saved, how, verify):
    """A reshard reads other ranks' copies lazily: a corrupt (or torn) one was found only after the shards of the
    intact copies were copied in, and corrupt_ok=True then returned None (a "fresh start") over a model holding
    part of step 3. With corrupt_ok=True every copy is opened (and verified) before anything is written."""
    from sharded_worker import config, make_model

    work, _ = saved
    _corrupt_copy(work, f"fsdp_{how}", how)
    cfg = config(str(work))
    cfg.verify_on_restore = verify
    model = make_model(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(cfg, rank=0, world_size=1, job=f"fsdp_{how}") as ck:
        assert ck.restore({"model": model}, corrupt_ok=True) is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_restore_failing_part_way_does_not_pass_for_a_fresh_start(saved, monkeypatch):
    """A read error (EIO) in rank 2's copy once ranks 0 and 1 were loaded: corrupt_ok=True must not return None
    over that half-loaded state, and corrupt_ok=False says the state is half-loaded."""
    import errno

    from sharded_worker import config, make_model

    from trainguard.checkpoint import CorruptCheckpointError
    from trainguard.checkpoint.reader import RankCopy

    work, _ = saved
    real = RankCopy.tensor

    def failing(self, index):
        if self.manifest.rank == 2:
            raise OSError(errno.EIO, "Input/output error", str(self.where))
        return real(self, index)

    monkeypatch.setattr(RankCopy, "tensor", failing)
    for corrupt_ok in (True, False):
        with Checkpointer(config(str(work)), rank=0, world_size=1, job="fsdp") as ck:
            with pytest.raises(CorruptCheckpointError, match="part of step 3 was already loaded") as err:
                ck.restore({"model": make_model(7)}, corrupt_ok=corrupt_ok)
        assert ("cannot start fresh" in str(err.value)) == corrupt_ok
