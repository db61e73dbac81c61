"""Trace-driven ETTR benchmark: trainguard vs a torchrun-like baseline on the StepFun trace and a Llama-3 rate.

For a job of ``--gpus`` GPUs it replays the whole StepFun trace (348 days on 400 nodes, time scaled to the job's
node count) and a Llama-3-like fault rate (419 interruptions / 54 days / 16,384 GPUs), for trainguard and the
baseline, each at its own ETTR-optimal checkpoint interval (printed next to Young/Daly), with the baseline's
collective timeout at 30 min (torch's default_pg_timeout) and at 10 min (NCCL's default in CUDA builds of
torch >= 2.2). Then it shows how trainguard's ETTR moves with each component time (one at a time), which says
what to measure first.

Usage::

    python bench/bench_ettr.py [--components measured.json] [--gpus 16384] [--plot docs/ettr.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.drill.components import baseline_defaults, load_components  # noqa: E402
from trainguard.drill.ettr import JobSize, simulate  # noqa: E402
from trainguard.drill.report import (  # noqa: E402
    check_output_file,
    compare,
    load_traces,
    plot_comparison,
    write_json,
)
from trainguard.errors import TrainguardError  # noqa: E402

SWEEPS = {
    "recovery_node_s": (30.0, 60.0, 120.0, 300.0),
    "recovery_process_s": (10.0, 30.0, 60.0, 180.0),
    "persist_s": (5.0, 30.0, 60.0, 300.0),
    "detect_node_down_s": (2.0, 10.0, 60.0),
    "predicted_share": (0.0, 0.25, 0.5, 0.8),
    "checkpoint_stall_s": (0.1, 1.0, 5.0),
}


def main() -> int:
    """Prints the comparison tables and the sensitivity sweep."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=16_384)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--trace", default=None, help="StepFun trace folder")
    ap.add_argument("--components", default=None, action="append",
                    help="JSON of measured component times (repeat to merge several; a later file wins)")
    ap.add_argument("--plot", default=None, help="write the StepFun ETTR plot here")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    try:
        return _run(args)
    except TrainguardError as exc:  # a missing trace or a bad components file: one line, as `trainguard ettr`
        print(f"bench_ettr: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    for flag, path in (("--plot", args.plot), ("--json", args.json)):
        if path:
            check_output_file(path, flag)  # before the sweeps, not after them
    job = JobSize(args.gpus, args.gpus_per_node)
    traces = load_traces(["stepfun", "llama3"], args.trace, 348.0, 0)
    comparisons = []
    for timeout in (1800.0, 600.0):
        tg, bl = load_components(args.components, baseline=baseline_defaults(timeout))
        bl = bl.with_overrides({"name": f"baseline/{timeout / 60:.0f}m"})
        for tr in traces:
            c = compare(tr, job, [tg, bl])
            if timeout == 1800.0:
                comparisons.append(c)
            print(c.table())
            print()
    tg, _ = load_components(args.components)
    print(f"trainguard ETTR sensitivity ({job.gpus} GPUs; one component varied, the rest as above):")
    for field, values in SWEEPS.items():
        cells = []
        for v in values:
            comp = tg.with_overrides({field: v})
            cells.append(" / ".join(f"{100 * simulate(tr, job, comp).result.ettr:.2f}%" for tr in traces))
        print(f"  {field:<20} " + "   ".join(f"{v:g}: {c}" for v, c in zip(values, cells)))
    print("  (each cell: StepFun / Llama-3 rate)")
    if args.plot:
        print(f"plot: {plot_comparison(args.plot, comparisons[0])}")
    if args.json:
        write_json(args.json, comparisons)
    return 0


if __name__ == "__main__":
    sys.exit(main())
