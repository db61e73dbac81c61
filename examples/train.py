"""A small, real, deterministic DDP training job that uses the trainguard hook.

An MLP learns scikit-learn's handwritten digits (1,797 8x8 images, shipped with the package) with DDP over
gloo on CPU. Given a seed, every run makes the same updates in the same order, and the batch of step ``s``
depends only on ``s`` (not on how the run got there), so a run that is killed and resumed from a checkpoint
ends with parameters bitwise equal to a run that never failed.

Run it under trainguard::

    trainguard run --nproc-per-node 2 examples/train.py --checkpoint-dir /tmp/ckpt

or under torchrun, or alone (``python examples/train.py``: a world of one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainguard
from trainguard.drill.digits import load_digits

TRAIN_SAMPLES = 1500


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits split into a fixed train and test set (same split for every rank and every run)."""
    x, y = load_digits()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x = torch.tensor(x, dtype=torch.float32)[perm] / 16.0
    y = torch.tensor(y, dtype=torch.long)[perm]
    return x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES], x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:]


def batch_indices(step: int, global_batch: int, seed: int) -> torch.Tensor:
    """Sample indices of ``step``'s global batch: a fresh seeded permutation per epoch."""
    per_epoch = TRAIN_SAMPLES // global_batch
    epoch, within = divmod(step, per_epoch)
    perm = torch.randperm(TRAIN_SAMPLES, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[within * global_batch:(within + 1) * global_batch]


def params_digest(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of every parameter, in order: equal digests mean bitwise-equal models."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    """Trains, checkpointing through trainguard, and prints the final test accuracy."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (0: never)")
    ap.add_argument("--checkpoint-dir", default=None, help="default: $TRAINGUARD_CHECKPOINT_DIR")
    ap.add_argument("--memory-keep", type=int, default=1,
                    help="snapshots each rank keeps in memory (2 keeps the previous one while the next is saved, so a "
                         "kill during a save still finds a step every rank holds in memory)")
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step, to mimic compute")
    ap.add_argument("--out", default=None, help="rank 0 writes final metrics (JSON) here")
    args = ap.parse_args()

    if "RANK" not in os.environ:  # a lone `python train.py`: a world of one on a free local port
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    session = trainguard.init(checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                              checkpoint_options={"memory": {"keep": args.memory_keep}})
    state = {"model": model, "optim": optim}
    start = session.restore(state)
    if rank == 0:
        print(f"[rank 0] generation {session.generation}: starting at step {start} of {args.steps}", flush=True)

    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        idx = batch_indices(step, args.global_batch, args.seed)[rank::world]
        optim.zero_grad()
        loss = loss_fn(model(x_train[idx]), y_train[idx])
        loss.backward()
        optim.step()
        if args.step_delay:
            time.sleep(args.step_delay)
        session.step_done(step, state)
        if session.should_stop:
            break

    session.finish()  # the loop is over: the evaluation below is not a hang
    session.wait()
    restored_tier = getattr(session.checkpointer, "last_restore_tier", None)
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        result = {"steps": args.steps, "loss": loss.item(), "test_accuracy": accuracy,
                  "params_sha256": params_digest(model.module), "world_size": world,
                  "restored_step": session.restored_step, "restart_count": session.restart_count,
                  "restored_tier": restored_tier}
        print(f"[rank 0] done: {args.steps} steps, loss {loss.item():.4f}, test accuracy {accuracy:.4f}", flush=True)
        if args.out:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, args.out)
    session.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
