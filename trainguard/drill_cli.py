"""``trainguard ettr`` (the trace-driven ETTR model) and ``trainguard drill`` (the soak drill).

Heavy imports (numpy, matplotlib, torch) stay inside the handlers so ``trainguard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from trainguard.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``ettr`` and ``drill`` subcommands."""
    p = sub.add_parser("ettr", help="simulate effective training time (ETTR) on a fault trace",
                       description="Replay the StepFun fault trace and a Llama-3-like fault rate against a job, "
                                   "for trainguard and a torchrun-like baseline, and report ETTR with the "
                                   "ETTR-optimal checkpoint interval next to Young/Daly's.")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="StepFun trace folder (default $TRAINGUARD_FAULT_TRACE_DIR or ../shared/data/"
                        "stepfun-fault-trace next to the repository)")
    p.add_argument("--traces", default="stepfun,llama3", help="comma list of stepfun, llama3 (default both)")
    p.add_argument("--gpus", type=int, default=16_384, help="GPUs in the job (default 16384)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--components", default=None, metavar="FILE",
                   help="JSON of measured component times overriding the defaults: "
                        '{"trainguard": {...}, "baseline": {...}}')
    p.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                   help="baseline's collective timeout, seconds (default 1800, torch's default_pg_timeout)")
    p.add_argument("--interval", type=float, default=None, metavar="S",
                   help="fix both systems' checkpoint interval (compute seconds) instead of optimising it")
    p.add_argument("--llama-days", type=float, default=348.0, help="days of Llama-3-rate faults to draw")
    p.add_argument("--seed", type=int, default=0, help="seed of the Llama-3-rate draw")
    p.add_argument("--plot", default=None, metavar="PNG", help="write ETTR over time + fault timeline here "
                                                             "(first trace)")
    p.add_argument("--json", default=None, metavar="FILE", help="write all figures as JSON")
    p.set_defaults(handler=_handle_ettr)


def _handle_ettr(args: argparse.Namespace) -> int:
    from trainguard.drill.components import DEFAULT_COLLECTIVE_TIMEOUT_S, baseline_defaults, load_components
    from trainguard.drill.ettr import JobSize
    from trainguard.drill.report import compare, load_traces, plot_comparison, write_json

    kinds = [k.strip() for k in args.traces.split(",") if k.strip()]
    bad = set(kinds) - {"stepfun", "llama3"}
    if not kinds or bad:
        raise UsageError(f"--traces {args.traces!r}: use a comma list of stepfun, llama3")
    if args.llama_days <= 0:
        raise UsageError(f"--llama-days must be > 0, got {args.llama_days}")
    job = JobSize(gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    timeout = args.collective_timeout if args.collective_timeout is not None else DEFAULT_COLLECTIVE_TIMEOUT_S
    if timeout < 0:
        raise UsageError(f"--collective-timeout must be >= 0, got {timeout}")
    tg, bl = load_components(args.components, baseline=baseline_defaults(timeout))
    if args.interval is not None:
        tg = tg.with_overrides({"checkpoint_interval_s": args.interval}, where="--interval")
        bl = bl.with_overrides({"checkpoint_interval_s": args.interval}, where="--interval")
    comparisons = [compare(t, job, [tg, bl]) for t in load_traces(kinds, args.trace, args.llama_days, args.seed)]
    for c in comparisons:
        print(c.table())
        print()
    if args.plot:
        print(f"plot: {plot_comparison(args.plot, comparisons[0])}")
    if args.json:
        write_json(args.json, comparisons)
        print(f"figures: {args.json}")
    sys.stdout.flush()
    return 0
