"""Saving a state of many small tensors: what each save costs the training loop, against ``torch.save``.

Usage: python bench/bench_many_tensors.py [--params 10000] [--saves 5] [--dir /var/tmp/tg-bench-many]

State: ``--params`` parameters of 4 float32 each and their Adam state (4 tensors per parameter: a mixture of
experts' many small norms and biases is the real case). Measured in this run, per save (medians):

* trainguard ``save(overlap_with=optimizer)``: the time ``save()`` blocks, plus the next training step
  (forward/backward and ``opt.step()``) less the step without a save just before it (the optimizer step waits
  for the overlapped copy, and the background work holds the GIL meanwhile): the whole cost the loop sees;
* ``torch.save`` of the model's and the optimizer's state dicts (the loop blocks for all of it);
* bytes written per copy (trainguard's data file and manifest, ``torch.save``'s file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer

warnings.simplefilter("ignore")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    """Runs the benchmark and prints its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=10000, help="small parameters (4 tensors each with Adam)")
    ap.add_argument("--saves", type=int, default=5, help="saves measured")
    ap.add_argument("--dir", default="/var/tmp/tg-bench-many", help="scratch directory")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    torch.manual_seed(0)
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(args.params)])
    opt = torch.optim.Adam(params.parameters())

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        sum(p.sum() for p in params).backward()
        opt.step()
        return time.perf_counter() - t

    step()
    state = {"model": params, "optim": opt}
    ckpt = Checkpointer(CheckpointConfig(directory=os.path.join(args.dir, "ckpt"),
                                         memory={"directory": os.path.join(args.dir, "shm")}), job="many")
    ckpt.prepare(state)
    ckpt.save(state, 0, overlap_with=opt)  # the first save of each slot builds what later saves reuse
    step()
    ckpt.wait()
    blocked, extra, plain = [], [], []
    for s in range(1, args.saves + 1):
        plain.append(step())
        t = time.perf_counter()
        ckpt.save(state, s, overlap_with=opt)
        blocked.append(time.perf_counter() - t)
        extra.append(step() - plain[-1])
        ckpt.wait()
    step_dir = os.path.join(args.dir, "ckpt", "many", f"step_{args.saves:012d}")
    ours_bytes = _dir_bytes(step_dir)
    ckpt.close()
    saved = []
    path = os.path.join(args.dir, "torch.pt")
    for _ in range(args.saves):
        t = time.perf_counter()
        torch.save({"model": params.state_dict(), "optim": opt.state_dict()}, path)
        saved.append(time.perf_counter() - t)
    torch_bytes = os.path.getsize(path)
    shutil.rmtree(args.dir, ignore_errors=True)

    tensors = args.params * 4
    ours = statistics.median(blocked) + statistics.median(extra)
    base = statistics.median(saved)
    print(f"{args.params} parameters + Adam ({tensors} tensors, {tensors * 16 / 1e6:.2f} MB of values), "
          f"{args.saves} saves, medians")
    print(f"  training step without a save     {statistics.median(plain):7.3f} s")
    print(f"  trainguard save() blocks         {statistics.median(blocked):7.3f} s")
    print(f"  trainguard next step waits more  {statistics.median(extra):7.3f} s")
    print(f"  trainguard cost per save         {ours:7.3f} s  = {ours / base:.2f}x torch.save")
    print(f"  torch.save (baseline)            {base:7.3f} s")
    print(f"  bytes per copy: trainguard {ours_bytes / 1e6:.1f} MB (data + manifest), torch.save "
          f"{torch_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
