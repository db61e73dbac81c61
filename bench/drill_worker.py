"""Worker of the restart drill: a gloo DDP job that logs every completed step with its time.

Each rank appends ``restart_count step unix_time pid`` to ``<out>/rank<R>.log`` after every step, so the drill
driver can strike at a chosen step and time the recovery from outside, the same way for every launcher.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainguard
from trainguard.worker_env import WorkerEnv


def main() -> None:
    """Trains for ``argv[2]`` steps, checkpointing every 5 through the trainguard hook."""
    out, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = WorkerEnv.from_env().restart_count
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(32, 32))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    session = trainguard.init(checkpoint_dir=os.path.join(out, "ckpt"), save_every=5)
    state = {"model": model, "optim": optim}
    start = session.restore(state)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    with open(os.path.join(out, f"rank{rank}.log"), "a", buffering=1) as log:
        for step in range(start, steps):
            optim.zero_grad()
            model(x).square().mean().backward()
            optim.step()
            time.sleep(delay)
            session.step_done(step, state)
            log.write(f"{restart} {step} {time.time():.6f} {os.getpid()}\n")
    session.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
