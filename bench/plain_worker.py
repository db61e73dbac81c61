"""No-hook worker of the restart drill: a plain torch DDP script that never imports trainguard.

It does what an unmodified training script does: ``init_process_group`` from torchrun's environment, its own
``torch.save`` checkpoint every 5 steps (rank 0, atomically), resume from it at start. Like
``bench/drill_worker.py`` it appends ``restart_count step unix_time pid`` to ``<out>/rank<R>.log`` after every
step, so the drill driver times the recovery from outside, the same way for every launcher.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    """Trains for ``argv[2]`` steps of ``argv[3]`` seconds each, checkpointing every 5 steps."""
    out, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    net = nn.Linear(32, 32)
    optim = torch.optim.SGD(net.parameters(), lr=0.01)
    path = os.path.join(out, "plain-ckpt.pt")
    start = torch.zeros(1, dtype=torch.int64)
    if rank == 0 and os.path.exists(path):
        state = torch.load(path, weights_only=True)
        net.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start[0] = state["step"] + 1
    dist.broadcast(start, 0)  # every rank resumes at rank 0's step; DDP broadcasts rank 0's parameters
    model = DistributedDataParallel(net)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    with open(os.path.join(out, f"rank{rank}.log"), "a", buffering=1) as log:
        for step in range(int(start[0]), steps):
            optim.zero_grad()
            model(x).square().mean().backward()
            optim.step()
            time.sleep(delay)
            if rank == 0 and step % 5 == 4:
                torch.save({"model": net.state_dict(), "optim": optim.state_dict(), "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
            log.write(f"{restart} {step} {time.time():.6f} {os.getpid()}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
