"""One rank of a 2-rank gloo job that uses the Checkpointer directly (no hook), as the README's sharded example.

Usage: python agree_worker.py RANK WORKDIR. Saves steps 1 and 2 of job ``a`` and step 1 of job ``b``; rank 1 then
tears its own data file of ``a``'s step 2 and of ``b``'s step 1; both ranks restore each job and print one JSON
line: the step each restore returned (or the error it raised) and the restored value.
"""

from __future__ import annotations

import gc
import json
import os
import sys

if __name__ == "__main__":
    # Importing torch with the cyclic collector running over the growing heap costs ~20 % more CPU (0.3 s a
    # process on 2 cores); it is back on, with the imported objects frozen out of its scans, when main starts.
    gc.disable()

import torch
import torch.distributed as dist

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.storage import data_name, step_dirname


def main() -> None:
    gc.freeze()
    gc.enable()
    rank, workdir = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg", rank=rank, world_size=2)
    cfg = CheckpointConfig(directory=f"{workdir}/ck", memory={"enabled": False}, persist={"service": "inline"})
    for job, steps in (("a", (1, 2)), ("b", (1,))):
        with Checkpointer(cfg, rank=rank, world_size=2, job=job) as ck:
            for s in steps:
                ck.save({"w": torch.full((8,), float(10 * rank + s))}, s)
                assert ck.wait(s, timeout=60)
    dist.barrier()
    if rank == 1:
        for job, s in (("a", 2), ("b", 1)):
            os.truncate(os.path.join(workdir, "ck", job, step_dirname(s), data_name(1)), 100)
    dist.barrier()
    facts: dict = {"rank": rank}
    for job in ("a", "b"):
        live = {"w": torch.zeros(8)}
        with Checkpointer(cfg, rank=rank, world_size=2, job=job) as ck:
            try:
                facts[job] = ck.restore(live)
            except Exception as exc:
                facts[job] = type(exc).__name__
        facts[f"{job}_w"] = float(live["w"][0])
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(facts), flush=True)
    # Everything is printed and every Checkpointer closed: leave at once, not through the interpreter's
    # finalization with torch loaded (seconds of garbage collection per rank on 2 loaded cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
