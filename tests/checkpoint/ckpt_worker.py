"""A worker process for the crash tests: saves deterministic states, reports progress on stdout, then waits.

Usage: python ckpt_worker.py CONFIG_JSON JOB RANK WORLD STEPS [--hang]
Each step's state is derived from (rank, step), so any reader can recompute the expected bytes.
"""

from __future__ import annotations

import gc
import json
import sys
import time

if __name__ == "__main__":
    # Importing torch with the cyclic collector running over the growing heap costs ~20 % more CPU (0.3 s a
    # process on 2 cores); it is back on, with the imported objects frozen out of its scans, when main starts.
    gc.disable()

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer


def state_for(rank: int, step: int) -> dict:
    """The deterministic state a worker saves at ``step``."""
    g = torch.Generator().manual_seed(rank * 100003 + step)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(4097, generator=g),
            "meta": {"step": step, "rank": rank, "tag": f"s{step}"}}


def main() -> None:
    gc.freeze()
    gc.enable()
    cfg = CheckpointConfig.from_dict(json.loads(sys.argv[1]))
    job, rank, world, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    ck = Checkpointer(cfg, rank=rank, world_size=world, job=job)
    for step in range(1, steps + 1):
        ck.save(state_for(rank, step), step)
        ok = ck.wait(step, timeout=60)
        print(f"saved {step} {ok}", flush=True)
    print("done", flush=True)
    if "--hang" in sys.argv:
        while True:
            time.sleep(1)
    ck.close()


if __name__ == "__main__":
    main()
