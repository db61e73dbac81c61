"""One rank of a real 2-process gloo restart for the retired-memory-copy test: restores through
:class:`trainguard.hook.Session` (its restore agrees on one step across ranks with an all-reduce) and prints what it
restored as JSON.

Usage: python retired_restore_worker.py CONFIG_JSON JOB RANK WORKDIR   (RANK and WORLD_SIZE=2 set in its env)
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
from ckpt_worker import state_for

from trainguard.hook import Session


def main() -> None:
    gc.freeze()
    gc.enable()
    cfg, job, rank, workdir = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg-{job}", rank=rank, world_size=2)
    try:
        options = {k: v for k, v in cfg.items() if k != "directory"}
        session = Session(checkpoint_dir=cfg["directory"], job=job, checkpoint_options=options)
        state = {"w": torch.zeros(64, 1024), "b": torch.zeros(4097), "meta": None}
        next_step = session.restore(state)
        exp = state_for(rank, next_step - 1)
        print(json.dumps({"rank": rank, "step": next_step - 1, "tier": session.checkpointer.last_restore_tier,
                          "bitwise": bool(torch.equal(state["w"], exp["w"]) and torch.equal(state["b"], exp["b"])
                                          and state["meta"] == exp["meta"])}), flush=True)
        session.checkpointer.close()
    finally:
        dist.destroy_process_group()
    # Everything is printed and the Checkpointer closed: leave at once, not through the interpreter's finalization
    # with torch loaded (seconds of garbage collection per rank on 2 loaded cores). A failure above still raises
    # and exits non-zero with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
