"""A gloo worker that saves through the hook every 2 steps and writes what it restored.

argv: OUT_DIR TOTAL_STEPS. After each step it writes the SHA-256 of its parameters' bytes to
``OUT/digest-r<RANK>-s<STEP>``; at start, ``OUT/restore-r<RANK>-<pid>.json`` says which step it restored and
from which tier, with the digest of the restored parameters.
"""
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import trainguard
from trainguard.checkpoint.config import MemoryTierConfig

out, total = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1234)
model = torch.nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = {"model": model, "optim": opt}


def digest() -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for s in opt.state_dict()["state"].values():
        h.update(s["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()


# Two snapshots kept in memory: the ranks are at most one save apart (every step all-reduces), so a kill at any
# instant leaves a step complete in memory on every rank (with one kept, a rank already overwriting the step
# its peer still holds leaves none, and the restart would come from disk).
session = trainguard.init(save_every=2, checkpoint_options={"memory": MemoryTierConfig(keep=2)})
start = session.restore(state)
tier = getattr(session.checkpointer, "last_restore_tier", None)
with open(os.path.join(out, f"restore-r{rank}-{os.getpid()}.json"), "w") as f:
    json.dump({"next_step": start, "tier": tier, "digest": digest()}, f)
for step in range(start, total):
    opt.zero_grad()
    torch.manual_seed(step * 100 + rank)
    loss = model(torch.randn(16, 256)).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()
    with open(os.path.join(out, f"digest-r{rank}-s{step}"), "w") as f:
        f.write(digest())
    session.step_done(step, state)
    time.sleep(0.05)
session.finish()
session.close()
dist.destroy_process_group()
