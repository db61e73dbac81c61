"""Retired memory copies (``memory.keep = 1``): a copy trimmed from the tier when its rank's next copy completes
keeps its bytes until the slot is reused, so ranks killed one save apart still restore the step they all hold
from memory, not from disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from ckpt_worker import state_for

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.service import CheckpointService

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ckpt_worker.py"


def _run_ranks_apart(tmp_path: Path, shm_dir: str, job: str) -> tuple[dict, CheckpointService]:
    """Two real worker processes of one job (world 2, keep 1): rank 0 saves steps 1 and 2 (its 1 is retired),
    rank 1 only step 1 (as if killed while saving 2); both are then SIGKILLed. The agent-owned service keeps the
    arena for their successors, as in a real run."""
    cfg = {"directory": str(tmp_path / "ck"), "memory": {"directory": shm_dir, "keep": 1}}
    svc = CheckpointService(job=job, shm_dir=shm_dir).start()
    env = dict(os.environ, TRAINGUARD_CHECKPOINT_SERVICE=svc.address)
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg), job, str(r), "2", str(steps),
                               "--hang"], stdout=subprocess.PIPE, text=True, env=env)
             for r, steps in ((0, 2), (1, 1))]
    try:
        for p in procs:
            for line in p.stdout:
                if line.startswith("saved"):
                    assert line.split()[2] == "True", line
                if line.strip() == "done":
                    break
            else:
                raise AssertionError(f"worker exited early with {p.wait()}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    cfg["persist"] = {"service": svc.address}
    return cfg, svc


def _restore(cfg: dict, job: str, rank: int) -> tuple[int | None, str | None, dict]:
    with Checkpointer(CheckpointConfig.from_dict(cfg), rank=rank, world_size=2, job=job) as ck:
        state = {"w": torch.zeros(64, 1024), "b": torch.zeros(4097), "meta": None}
        return ck.restore(state), ck.last_restore_tier, state


def test_ranks_one_save_apart_restore_common_step_from_memory_and_a_corrupt_one_from_disk(tmp_path, shm_dir):
    # One pair of ranks one save apart for both checks (their two worker processes, torch imports each, are the
    # cost): the restores of the first check only read the arena, which the second then corrupts.
    job = "retired"
    cfg, svc = _run_ranks_apart(tmp_path, shm_dir, job)
    try:
        # The tier itself still lists exactly memory.keep = 1 copy per rank, and no step every rank holds.
        listed = arena_mod.memory_manifests(shm_dir, job)
        assert {s: sorted(r) for s, r in listed.items()} == {1: [1], 2: [0]}
        with Checkpointer(CheckpointConfig.from_dict(cfg), rank=0, world_size=2, job=job) as ck:
            assert [i.step for i in ck.steps() if "memory" in i.tiers] == []
            assert [i.step for i in ck.steps()] == [1]  # disk: rank 1 never saved 2
        # Both ranks restart as a real 2-process gloo job; Session.restore agrees on one step with an all-reduce.
        env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_CHECKPOINT_SERVICE"}
        procs = [subprocess.Popen([sys.executable, str(HERE / "retired_restore_worker.py"), json.dumps(cfg), job,
                                   str(r), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(env, RANK=str(r), WORLD_SIZE="2", PYTHONPATH=str(HERE)))
                 for r in (0, 1)]
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        facts = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        assert facts == [{"rank": r, "step": 1, "tier": "memory", "bitwise": True} for r in (0, 1)], facts

        # A corrupt retired copy falls through to disk.
        retired = [os.path.join(d, f"slot_{i}.retired.json") for _r, d, i in
                   arena_mod.rank_files(os.path.join(shm_dir, job), arena_mod._SLOT_RETIRED_RE)]
        assert len(retired) == 1 and "rank_00000" in retired[0]
        data = retired[0].replace(".retired.json", ".data")
        with open(data, "r+b") as f:  # one flipped byte of rank 0's retired step-1 copy
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0x40]))
        step, tier, state = _restore(cfg, job, 0)
        assert (step, tier) == (1, "disk")
        assert torch.equal(state["w"], state_for(0, 1)["w"])
    finally:
        svc.stop(remove_memory=True)
    assert not os.path.exists(os.path.join(shm_dir, job))  # retired copies go with the arena


def test_reused_slot_drops_its_retired_manifest(make_config):
    with Checkpointer(make_config(memory={"keep": 1}), job="reuse") as ck:
        for s in range(1, 5):
            ck.save({"w": torch.full((1000,), float(s))}, s)
            assert ck.wait(s, timeout=60)
            names = sorted(n for n in os.listdir(ck.arena.dir) if n.endswith(".json"))
            # keep + 1 = 2 slots: the newest copy listed, the previous one retired, nothing older left behind
            assert len(names) == (1 if s == 1 else 2), names
            assert sum(n.endswith(".retired.json") for n in names) == (0 if s == 1 else 1), names
        assert [i.step for i in ck.steps() if "memory" in i.tiers] == [4]
        live = {"w": torch.zeros(1000)}
        assert ck.restore(live, step=3) == 3 and ck.last_restore_tier == "memory"  # the retired copy serves 3
        assert torch.equal(live["w"], torch.full((1000,), 3.0))
