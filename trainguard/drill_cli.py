"""``trainguard ettr`` (the trace-driven ETTR model) and ``trainguard drill`` (the soak drill).

Heavy imports (numpy, matplotlib, torch) stay inside the handlers so ``trainguard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import sys

from trainguard.errors import UsageError

#: Longest span of Llama-3-rate faults ``--llama-days`` may ask for, days.
MAX_LLAMA_DAYS = 36500.0

#: Extra kinds of a cluster drill when --extra is not given: each injectable kind once.
CLUSTER_DEFAULT_EXTRA = ("kill", "stop", "hwfault", "agentkill", "linkdown", "precursor", "coordinator", "enospc")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``ettr`` and ``drill`` subcommands."""
    p = sub.add_parser("ettr", help="simulate effective training time (ETTR) on a fault trace",
                       description="Replay the StepFun fault trace and a Llama-3-like fault rate against a job, "
                                   "for trainguard and a torchrun-like baseline, and report ETTR with the "
                                   "ETTR-optimal checkpoint interval next to Young/Daly's.")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="StepFun trace folder (default $TRAINGUARD_FAULT_TRACE_DIR, else the copy in the wheel, else ../shared/data/"
                        "stepfun-fault-trace next to the repository)")
    p.add_argument("--traces", default="stepfun,llama3", help="comma list of stepfun, llama3 (default both)")
    p.add_argument("--gpus", type=int, default=16_384, help="GPUs in the job (default 16384)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--components", default=None, metavar="FILE", action="append",
                   help="JSON of measured component times overriding the defaults: "
                        '{"trainguard": {...}, "baseline": {...}}; repeat to merge several (a later file wins)')
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
    _register_drill(sub)


def _handle_ettr(args: argparse.Namespace) -> int:
    from trainguard.drill.components import DEFAULT_COLLECTIVE_TIMEOUT_S, baseline_defaults, load_components
    from trainguard.drill.ettr import JobSize
    from trainguard.drill.report import check_output_file, compare, load_traces, plot_comparison, write_json

    kinds = [k.strip() for k in args.traces.split(",") if k.strip()]
    bad = set(kinds) - {"stepfun", "llama3"}
    if not kinds or bad:
        raise UsageError(f"--traces {args.traces!r}: use a comma list of stepfun, llama3")
    # Faults are drawn one by one: an unbounded span (inf, or a typo of many digits) would never finish.
    if not 0 < args.llama_days <= MAX_LLAMA_DAYS:
        raise UsageError(f"--llama-days must be > 0 and at most {MAX_LLAMA_DAYS:.0f} (100 years), got {args.llama_days}")
    job = JobSize(gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    _check_outputs(check_output_file, {"--plot": args.plot, "--json": args.json})
    timeout = args.collective_timeout if args.collective_timeout is not None else DEFAULT_COLLECTIVE_TIMEOUT_S
    if not (math.isfinite(timeout) and timeout >= 0):
        raise UsageError(f"--collective-timeout must be a finite number of seconds >= 0, got {timeout}")
    if args.interval is not None and not args.interval > 0:
        # Checked by the components model, the message named the model, not the flag: "trainguard: error:
        # trainguard: checkpoint_interval_s must be ..." (the first "trainguard" the system, not the program).
        raise UsageError(f"--interval {args.interval}: expected compute seconds > 0 between checkpoints (leave it "
                         "out to use the ETTR-optimal interval)")
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


def _check_outputs(check, paths: dict[str, str | None]) -> None:
    # Before the work: a folder given as an output path used to fail only once the figures were computed (or
    # the drill had run for minutes), with a traceback, and a plot path without .png was written as PATH.png.
    for flag, path in paths.items():
        if path:
            check(path, flag)


def _register_drill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drill", help="soak drill: real training under trainguard with faults from the StepFun trace",
                       description="Run a 2-worker training job under `trainguard run` (or, with --nodes, on a "
                                   "small cluster of node agents in network namespaces) for a fixed wall time with "
                                   "faults injected on a schedule drawn from the StepFun trace (time compressed), "
                                   "report ETTR, detection and recovery per fault, verify the final model against "
                                   "a fault-free run, and feed the measured figures into the ETTR model.")
    p.add_argument("--minutes", type=float, default=3.0, help="training wall time before finishing (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="workers (default 2)")
    p.add_argument("--step-delay", type=float, default=0.1, help="extra seconds per step (default 0.1)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument("--trace-faults", type=float, default=8.0,
                   help="mean number of trace faults in the window; sets the time compression (default 8)")
    p.add_argument("--represent-gpus", type=int, default=16_384,
                   help="GPUs of the job whose StepFun fault stream is replayed (default 16384)")
    p.add_argument("--extra", default=None,
                   help="kinds injected once each on top of the trace's: kill, stop, enospc; with --nodes also "
                        "hwfault, agentkill, linkdown, precursor, coordinator (default stop,enospc; with --nodes "
                        "every kind; '' for none)")
    p.add_argument("--hang-bound", type=float, default=15.0,
                   help="the agent's hang floor (trainguard run --hang-floor-s), seconds (default 15)")
    p.add_argument("--enospc-window", type=float, default=10.0, help="seconds the checkpoint disk stays full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, metavar="DIR", help="StepFun trace folder")
    p.add_argument("--workdir", default=None, help="keep logs and checkpoints here (default: temp, removed)")
    p.add_argument("--baseline-restart", type=float, default=None, metavar="S",
                   help="the baseline's job restart time on this machine, seconds (e.g. torchrun's recovery from "
                        "bench/bench_restart.py; default: trainguard's measured restart, which flatters the baseline)")
    p.add_argument("--nodes", type=int, default=0,
                   help="run on a cluster of this many node agents (>= 2, one worker each) with a standalone "
                        "coordinator and spares, each node in its own network namespace with a fake hardware tree: "
                        "every fault class is then injected (default 0: one node, --nproc workers)")
    p.add_argument("--spares", type=int, default=1, help="spare node agents kept ready (cluster drill; default 1)")
    p.add_argument("--no-netns", action="store_true",
                   help="cluster drill on loopback without network namespaces (no root needed; no link faults)")
    p.add_argument("--lease-timeout", type=float, default=3.0,
                   help="the coordinator's lease timeout, seconds (cluster drill; default 3)")
    p.add_argument("--drain-grace", type=float, default=2.0,
                   help="predictor alarm to drain request, seconds (cluster drill; default 2)")
    p.add_argument("--precursor-lead", type=float, default=10.0,
                   help="seconds between a precursor and the fault it announces (cluster drill; default 10)")
    p.add_argument("--memory-tier", choices=("job", "host"), default="job",
                   help="cluster drill: job restores from every node's memory and buddies' replicas (default); "
                        "host limits the memory tier to one host (the behaviour before: disk after node faults)")
    p.add_argument("--no-verify", action="store_true", help="skip the fault-free reference run")
    p.add_argument("--plot", default=None, metavar="PNG", help="write ETTR over time + fault timeline here")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--components-out", default=None, metavar="FILE",
                   help="write the measured component times as a --components file for `trainguard ettr`")
    p.set_defaults(handler=_handle_drill)


def _handle_drill(args: argparse.Namespace) -> int:
    from trainguard.drill.report import check_output_file, write_json_file
    from trainguard.drill.soak import SoakConfig, run_soak
    from trainguard.drill.soak_report import (
        at_scale,
        format_soak,
        measure_torch_save_stall,
        measured_components,
        plot_soak,
    )

    if args.extra is None:
        extra = CLUSTER_DEFAULT_EXTRA if args.nodes else ("stop", "enospc")
        if args.nodes and args.no_netns:
            extra = tuple(k for k in extra if k != "linkdown")
    else:
        extra = tuple(k.strip() for k in args.extra.split(",") if k.strip())
    if args.baseline_restart is not None and args.baseline_restart < 0:
        raise UsageError(f"--baseline-restart must be >= 0, got {args.baseline_restart}")
    cfg = SoakConfig(wall_s=args.minutes * 60.0, nproc=args.nproc, step_delay_s=args.step_delay,
                     save_every=args.save_every, trace_faults=args.trace_faults, represent_gpus=args.represent_gpus,
                     extra=extra, hang_bound_s=args.hang_bound,
                     enospc_window_s=args.enospc_window, seed=args.seed, trace_dir=args.trace, workdir=args.workdir,
                     verify=not args.no_verify, nodes=args.nodes, spares=args.spares, netns=not args.no_netns,
                     lease_timeout_s=args.lease_timeout, drain_grace_s=args.drain_grace,
                     precursor_lead_s=args.precursor_lead, memory_tier=args.memory_tier)
    _check_outputs(check_output_file, {"--plot": args.plot, "--json": args.json,
                                       "--components-out": args.components_out})
    if cfg.nodes and cfg.netns:
        from trainguard.drill.netns import netns_unavailable_reason

        why = netns_unavailable_reason()
        if why:
            raise UsageError(f"the cluster drill puts nodes in network namespaces, but {why}; run as root or add "
                             "--no-netns")
    import signal

    def _terminate(signum, _frame):
        raise KeyboardInterrupt  # so the drill's cleanup (kill the job, unmount the tmpfs) runs

    signal.signal(signal.SIGTERM, _terminate)
    rep = run_soak(cfg, progress=lambda line: print(line, flush=True))
    torch_save_s = measure_torch_save_stall()
    print(format_soak(rep, torch_save_s, args.trace, args.baseline_restart))
    if args.plot:
        print(f"plot: {plot_soak(args.plot, rep, torch_save_s, args.baseline_restart)}")
    if args.json:
        write_json_file(args.json, {**rep.as_dict(), "torch_save_s": torch_save_s}, "--json")
    if args.components_out:
        m = measured_components(rep)
        lease = cfg.lease_timeout_s if cfg.nodes else None
        write_json_file(args.components_out,
                        {"_source": f"trainguard drill {'--nodes ' + str(cfg.nodes) if cfg.nodes else ''} on this "
                                    "machine, carried to scale by trainguard.drill.soak_report.at_scale",
                         "_measured": m, "trainguard": at_scale(m, lease)}, "--components-out")
    return 0 if rep.equal_to_reference is not False else 1
