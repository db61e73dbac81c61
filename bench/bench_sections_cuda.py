"""CUDA section timing (trainguard/step_timer.py) on a GPU: what it reports and what it costs.

    python bench/bench_sections_cuda.py [--steps 200] [--out FILE]

A small MLP trains on the GPU. Per step, in interleaved blocks: (a) bare, (b) five sections timed with CUDA
events (the hook's GPU path). Each step ends with ``torch.cuda.synchronize()`` so its wall time is the GPU's.
It prints the overhead of the sections on the step time, and for the sectioned steps the sum of the sections'
GPU times against the step's wall time (they must account for most of it), next to what host timestamps
(``perf_counter`` around the same code without synchronising) would have reported: the launch time only.
Needs torch with CUDA; exits 2 with a one-line reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    """Runs the measurement (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("no torch here", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("torch has no CUDA device here", file=sys.stderr)
        return 2
    from trainguard.step_timer import StepTimer

    dev = torch.device("cuda")
    nn = torch.nn
    w = args.width
    model = nn.Sequential(nn.Linear(1024, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 1024, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    timer = StepTimer()
    host = StepTimer(use_cuda=False)

    def step(sections: bool) -> tuple[float, dict, dict]:
        t0 = time.perf_counter()
        sec = timer.section if sections else None
        if sec:
            with sec("data"), host.section("data"):
                xb, yb = x, y
            with sec("forward"), host.section("forward"):
                loss = nn.functional.cross_entropy(model(xb), yb)
            with sec("backward"), host.section("backward"):
                opt.zero_grad()
                loss.backward()
            with sec("comm"), host.section("comm"):
                pass
            with sec("optim"), host.section("optim"):
                opt.step()
        else:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return wall, (timer.collect() if sections else {}), (host.collect() if sections else {})

    for _ in range(20):
        step(True)
        step(False)
    bare, hooked, gpu_sums, host_sums = [], [], [], []
    for b in range(args.steps // 10):
        for kind in ((False, True) if b % 2 == 0 else (True, False)):
            for _ in range(10):
                wall, gpu, hst = step(kind)
                (hooked if kind else bare).append(wall)
                if kind:
                    gpu_sums.append(sum(gpu.values()))
                    host_sums.append(sum(hst.values()))
    assert timer.cuda is not None, "CUDA events were not used"
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "bare_step_ms": 1000 * statistics.median(bare), "sectioned_step_ms": 1000 * statistics.median(hooked),
           "sections_gpu_sum_ms": 1000 * statistics.median(gpu_sums),
           "sections_host_sum_ms": 1000 * statistics.median(host_sums), "steps": len(bare)}
    doc["overhead_pct"] = 100 * (doc["sectioned_step_ms"] / doc["bare_step_ms"] - 1)
    doc["gpu_sections_share_of_step"] = doc["sections_gpu_sum_ms"] / doc["sectioned_step_ms"]
    print(json.dumps(doc, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
