"""Worker of the soak drill: a deterministic DDP job that logs every step, save and checkpoint error with its time.

The model and data are those of ``examples/train.py`` (an MLP on scikit-learn's digits, read from the CSV file
scikit-learn ships; gloo on CPU; the batch of step ``s`` a function of ``s`` only), so a run that is killed and resumed ends bitwise equal to a fault-free run of
the same number of steps. Each rank appends to ``<events>/rank<R>.steps`` one line per completed step::

    unix_time generation step pid step_done_seconds saved(0/1)

to ``<events>/rank<R>.events`` one JSON line per checkpoint warning or error the hook logs (ENOSPC and the
like), and to ``<events>/rank<R>.restores`` one JSON line per restore (generation, step, tier, seconds), so the
drill can time detection, recovery and restore from outside. Rank 0 writes ``params_sha256`` to ``--out``.

Run as ``trainguard run --nproc-per-node 2 -m trainguard.drill.soak_worker --steps N --events DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainguard
from trainguard.drill.digits import load_digits
from trainguard.worker_env import WorkerEnv

TRAIN_SAMPLES = 1500


class _EventLog(logging.Handler):
    """Appends the hook's checkpoint warnings and errors to the rank's event file, with their time."""

    def __init__(self, path: str) -> None:
        super().__init__(level=logging.WARNING)
        self._f = open(path, "a", buffering=1)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "checkpoint" in msg.lower():
            self._f.write(json.dumps({"t": record.created, "level": record.levelname, "message": msg[:300]}) + "\n")


def _batch(step: int, global_batch: int, seed: int) -> torch.Tensor:
    per_epoch = TRAIN_SAMPLES // global_batch
    epoch, within = divmod(step, per_epoch)
    perm = torch.randperm(TRAIN_SAMPLES, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[within * global_batch:(within + 1) * global_batch]


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    """Trains ``--steps`` steps, logging each one; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps to train (or set by --stop-file)")
    ap.add_argument("--stop-file", default=None,
                    help="train until the step count written in this file appears (read once per step)")
    ap.add_argument("--events", required=True, help="folder for the per-rank step and event logs")
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step, to mimic compute")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="rank 0 writes the final digest (JSON) here")
    args = ap.parse_args()
    if (args.steps is None) == (args.stop_file is None):
        ap.error("give exactly one of --steps and --stop-file")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = WorkerEnv.from_env().generation
    os.makedirs(args.events, exist_ok=True)
    logging.getLogger("trainguard").addHandler(_EventLog(os.path.join(args.events, f"rank{rank}.events")))

    torch.manual_seed(args.seed)
    x, y = (torch.from_numpy(a) for a in load_digits())
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))
    x = (x.float()[perm] / 16.0)[:TRAIN_SAMPLES]
    y = y[perm][:TRAIN_SAMPLES]
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    session = trainguard.init(save_every=args.save_every)
    state = {"model": model, "optim": optim}
    t_restore = time.perf_counter()
    start = session.restore(state)
    restore_s = time.perf_counter() - t_restore
    if start > 0:  # where this rank's checkpoint came from, and how long the restore took (the drill reports it)
        with open(os.path.join(args.events, f"rank{rank}.restores"), "a") as f:
            f.write(json.dumps({"t": time.time(), "generation": gen, "step": start - 1, "restore_s": restore_s,
                                "tier": getattr(session.checkpointer, "last_restore_tier", None)}) + "\n")
    pid = os.getpid()
    steps = args.steps
    step = start
    with open(os.path.join(args.events, f"rank{rank}.steps"), "a", buffering=1) as log:
        while True:
            if steps is None and os.path.exists(args.stop_file):
                # The drill writes the count far enough ahead that every rank reads it before reaching it.
                with open(args.stop_file) as f:
                    steps = int(f.read().strip())
            if steps is not None and step >= steps:
                break
            idx = _batch(step, args.global_batch, args.seed)[rank::world]
            optim.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            optim.step()
            if args.step_delay:
                time.sleep(args.step_delay)
            saved_before = session.last_saved_step
            t0 = time.perf_counter()
            session.step_done(step, state)
            took = time.perf_counter() - t0
            saved = int(session.last_saved_step != saved_before)
            log.write(f"{time.time():.6f} {gen} {step} {pid} {took:.6f} {saved}\n")
            if session.should_stop:
                break
            step += 1
    phases = [("trained", time.time())]
    if rank == 0 and args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"steps": steps, "params_sha256": _digest(model.module), "world_size": world}, f)
        os.replace(tmp, args.out)
    session.wait()
    phases.append(("checkpoints durable", time.time()))
    session.close()
    phases.append(("session closed", time.time()))
    dist.destroy_process_group()
    phases.append(("process group destroyed", time.time()))
    # How long finishing takes matters: the agent sees no step heartbeat meanwhile.
    with open(os.path.join(args.events, f"rank{rank}.finish"), "a") as f:
        f.write(json.dumps({"generation": gen, "phases": phases}) + "\n")
    # Everything is written and closed. DDP's constructor imported torch._dynamo (some 800 modules), and the
    # interpreter's finalization then spends seconds in the garbage collector (3-5 s on 2 loaded cores) before
    # the process exits, which every drill waited out twice (the faulted job and the reference). Nothing is
    # left to finalize; leaving at once also takes gloo's exit-time abort (trainguard.gloo_exit) off the table.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
