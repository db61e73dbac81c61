"""Worker of the fail-slow drills: data-parallel training with every part of a step in a ``session.section``.

Each step: ``data`` (pick the batch), ``forward``, ``backward``, ``comm`` (one all-reduce of the flattened
gradients over gloo: the time this rank waits for the others is in it), ``optim``. An MLP on random data, big
enough (``--width``) that a step is mostly computation, so a CPU-throttled rank is a real straggler. Rank R
appends to ``<events>/rank<R>.steps`` one line per step::

    unix_time generation step step_seconds comm_seconds

and writes its pid to ``<events>/rank<R>.pid`` and the agent's socket to ``<events>/agent.sock`` (rank 0 of
each node), so the drill can throttle it and ask ``trainguard status``. ``--hang-rank R --hang-step S`` makes
rank R hang in its data loader at step S (in the generations of ``--hang-generations``), so the other ranks wait
for it in the all-reduce: the hang the localisation drill must pin on R.

Run as ``trainguard run --nproc-per-node 2 -m trainguard.drill.failslow_worker --events DIR --stop-file F``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import trainguard
from trainguard.worker_env import WorkerEnv


def stuck_in_data_loader() -> None:
    """A data loader that never returns (what the hang drill injects)."""
    while True:
        time.sleep(0.5)


def main() -> None:
    """Trains until the stop file names a step count; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", required=True, help="folder for the per-rank step logs and pid files")
    ap.add_argument("--stop-file", required=True, help="train until the step count written in this file")
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (compute per step)")
    ap.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    ap.add_argument("--hang-rank", type=int, default=-1, help="rank that hangs in its data loader")
    ap.add_argument("--hang-step", type=int, default=-1, help="step at which it hangs")
    ap.add_argument("--hang-generations", default="1", help="comma-separated generations in which it hangs")
    ap.add_argument("--no-sections", action="store_true", help="time nothing but the step (the hook's baseline)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wenv = WorkerEnv.from_env()
    gen = wenv.generation
    hang_gens = {int(g) for g in args.hang_generations.split(",") if g.strip()}
    os.makedirs(args.events, exist_ok=True)
    with open(os.path.join(args.events, f"rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()} {gen}\n")
    sock = wenv.agent_socket
    if sock and wenv.local_rank == 0:
        node = wenv.node_id or "node"
        with open(os.path.join(args.events, f"agent-{node}.sock"), "w") as f:
            f.write(sock)

    torch.manual_seed(rank)
    w = args.width
    model = nn.Sequential(nn.Linear(256, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    data = torch.randn(args.batch * 8, 256)
    labels = torch.randint(0, 10, (args.batch * 8,))
    params = list(model.parameters())
    session = trainguard.init()
    sec = (lambda name: _NULL) if args.no_sections else session.section
    steps = None
    step = 0
    with open(os.path.join(args.events, f"rank{rank}.steps"), "a", buffering=1) as log:
        while True:
            if steps is None and step % 10 == 0 and os.path.exists(args.stop_file):
                with open(args.stop_file) as f:
                    text = f.read().strip()
                steps = int(text) if text else None
            if steps is not None and step >= steps:
                break
            with sec("data"):
                if rank == args.hang_rank and step == args.hang_step and gen in hang_gens:
                    stuck_in_data_loader()
                i = (step * args.batch) % len(data)
                x, y = data[i:i + args.batch], labels[i:i + args.batch]
            with sec("forward"):
                loss = loss_fn(model(x), y)
            with sec("backward"):
                optim.zero_grad()
                loss.backward()
            t0 = time.perf_counter()
            with sec("comm"):
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat)
            comm = time.perf_counter() - t0
            with sec("optim"):
                off = 0
                for p in params:
                    n = p.numel()
                    p.grad.copy_(flat[off:off + n].view_as(p.grad)).div_(world)
                    off += n
                optim.step()
            session.step_done(step)
            log.write(f"{time.time():.6f} {gen} {step} {session.last_step_time_s:.6f} {comm:.6f}\n")
            step += 1
    session.close()
    dist.destroy_process_group()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()


if __name__ == "__main__":
    main()
