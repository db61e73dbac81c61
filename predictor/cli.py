"""``trainguard predictor ...``: train, evaluate and run the anomaly predictor on CSV files.

Subcommands: ``train`` (fit a model on a history and save it), ``eval`` (event recall, lead times and false
alarms of a model on other data), ``score`` (stream a metrics file through the online runtime, rules tier
included, and write one score per row), ``export`` (agent history store -> CSV) and ``gen-trace`` (a synthetic
trace following StepFun's fault mix, for trials). Every import beyond argparse happens inside the handlers,
so ``trainguard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--horizon", type=float, default=1800.0, help="H: earliest useful warning, seconds (default 1800)")
    p.add_argument("--min-lead", type=float, default=120.0, help="L: checkpoint time, seconds (default 120)")
    p.add_argument("--cooldown", type=float, default=1200.0,
                   help="least time between two alarms of a node (and repeat interval), seconds (default 1200)")
    p.add_argument("--budget", type=float, default=1.0, help="false alarms allowed per 100 node-days (default 1)")


def _eval_config(args: argparse.Namespace) -> Any:
    from trainguard.predictor.evaluation import EvalConfig

    return EvalConfig(horizon_s=args.horizon, min_lead_s=args.min_lead, cooldown_s=args.cooldown,
                      budget_per_100_node_days=args.budget)


def _train(args: argparse.Namespace) -> int:
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.table import EventTable, MetricTable
    from trainguard.predictor.training import TrainConfig, train

    metrics = MetricTable.from_csv(args.metrics)
    events = EventTable.from_csv(args.events) if args.events else None
    cfg = TrainConfig(
        method=args.method, evaluation=_eval_config(args), calib_fraction=args.calib_fraction, seed=args.seed,
        features=FeatureConfig(interval_s=args.interval, short_window_s=args.short_window,
                               long_window_s=args.long_window, peer=not args.no_peer),
    )
    model = train(metrics, events, cfg)
    size = model.save(args.out)
    s = model.training_summary
    print(f"trained {s['method']} on {s['rows']} rows, {s['nodes']} nodes, {s['node_days']:.1f} node-days, "
          f"{s['failures_total']} failures; threshold {model.threshold:.4f}; saved {args.out} ({size} bytes)")
    if s["ignored_columns"]:
        print(f"ignored columns (not in the catalog): {', '.join(s['ignored_columns'])}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import numpy as np

    from trainguard.predictor.evaluation import evaluate_events, failures_by_node
    from trainguard.predictor.model import PredictorModel
    from trainguard.predictor.table import EventTable, MetricTable
    from trainguard.predictor.training import score_table

    model = PredictorModel.load(args.model)
    metrics = MetricTable.from_csv(args.metrics)
    events = EventTable.from_csv(args.events)
    frame, score = score_table(model, metrics, args.missing)
    thr = model.threshold if args.threshold is None else args.threshold
    ev = model.eval_config
    rep = evaluate_events(frame.ts, frame.node, score, thr, failures_by_node(events.node, events.ts), ev,
                          model.spec.config.interval_s)
    out = rep.summary()
    if frame.missing_metrics:
        out["degraded_missing_metrics"] = frame.missing_metrics
    if args.faults:
        with open(args.faults) as fh:
            truth = json.load(fh)["faults"]
        keys = {(f["node"], float(f["ts"])) for f in truth if f.get("predictable")}
        c, t = rep.recall_of(keys)
        out["predictable_failures"], out["predictable_caught"] = t, c
        out["predictable_recall"] = c / t if t else float("nan")
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v:.4f}" if isinstance(v, float) and not np.isnan(v) else f"{k:32s} {v}")
    return 0


def _score(args: argparse.Namespace) -> int:
    import csv

    import numpy as np

    from trainguard.predictor.runtime import PredictorRuntime
    from trainguard.predictor.table import MetricTable

    rt = PredictorRuntime.load(args.model, rules_path=args.rules, missing=args.missing)
    metrics = MetricTable.from_csv(args.metrics)
    rt.check_metrics(metrics.columns)
    interval = rt.model.spec.config.interval_s if rt.model is not None else 1.0
    if rt.model is not None:
        from trainguard.predictor.features import check_interval

        check_interval(metrics, interval)
    jobs = metrics.job.astype(str) if metrics.job is not None else np.full(len(metrics.ts), "")
    bucket = np.round(metrics.ts / interval).astype(np.int64)
    order = np.lexsort((metrics.node.astype(str), jobs, bucket))
    peer = rt.model is not None and rt.model.spec.config.peer
    alarms = 0
    out = open(args.out, "w", newline="") if args.out != "-" else sys.stdout
    try:
        w = csv.writer(out)
        w.writerow(["timestamp", "node", "score", "threshold", "alarm", "source", "top_features", "degraded"])
        i = 0
        while i < len(order):
            j = i
            while j < len(order) and bucket[order[j]] == bucket[order[i]] and jobs[order[j]] == jobs[order[i]]:
                j += 1
            group = order[i:j]
            samples = {str(metrics.node[r]): dict(zip(metrics.columns, metrics.values[r].tolist())) for r in group}
            ts_of = {str(metrics.node[r]): float(metrics.ts[r]) for r in group}
            if peer:
                scores = rt.observe_many(float(metrics.ts[group[0]]), samples)
            else:
                scores = {n: rt.observe(ts_of[n], n, m) for n, m in samples.items()}
            for n, s in scores.items():
                alarms += int(s.alarm)
                w.writerow([repr(ts_of[n]), n, f"{s.score:.6f}", f"{s.threshold:.6f}", int(s.alarm), s.source,
                            ";".join(f"{k}={v:g}" for k, v in s.top_features), "|".join(s.degraded)])
            i = j
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"scored {len(order)} rows, {alarms} above threshold", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    from trainguard.predictor.history import MetricHistory

    with MetricHistory(args.history) as h:
        n, e = h.export(args.metrics, args.events, since=args.since)
    print(f"exported {n} samples and {e} events")
    return 0


def _gen_trace(args: argparse.Namespace) -> int:
    from trainguard.predictor.tracegen import TraceConfig, generate

    cfg = TraceConfig(n_nodes=args.nodes, days=args.days, interval_s=args.interval, rate_scale=args.rate_scale,
                      repair_scale=args.repair_scale, seed=args.seed, trace_dir=args.trace_dir)
    tr = generate(cfg)
    tr.save(args.out)
    print(f"wrote {len(tr.metrics.ts)} samples of {args.nodes} nodes and {len(tr.faults)} failures "
          f"({sum(f.predictable for f in tr.faults)} with precursors) to {args.out}")
    return 0


def register(subparsers: Any) -> None:
    """Adds ``predictor`` and its subcommands to the ``trainguard`` parser.

    Args:
        subparsers: the top-level subparsers action.
    """
    top = subparsers.add_parser("predictor", help="anomaly predictor: train, eval, score")
    sub = top.add_subparsers(dest="predictor_command", metavar="SUBCOMMAND", parser_class=type(top))
    top.set_defaults(handler=lambda a: (top.print_help(), 2)[1])

    p = sub.add_parser("train", help="fit a model on a metrics history (CSV) and save it")
    p.add_argument("--metrics", required=True, help="metrics CSV: timestamp,node[,job],<metrics...>")
    p.add_argument("--events", help="failures CSV: timestamp,node,kind (without: unsupervised)")
    p.add_argument("--out", required=True, help="model file to write (JSON)")
    p.add_argument("--method", default="auto", choices=["auto", "hgb", "robust-z", "threshold"])
    p.add_argument("--interval", type=float, default=5.0, help="sampling interval of the data, seconds")
    p.add_argument("--short-window", type=float, default=300.0, help="short feature window, seconds")
    p.add_argument("--long-window", type=float, default=1800.0, help="long feature window, seconds")
    p.add_argument("--no-peer", action="store_true", help="no peer z-scores (for a model run on one node alone)")
    p.add_argument("--calib-fraction", type=float, default=0.25, help="trailing share of time to calibrate on")
    p.add_argument("--seed", type=int, default=0)
    _add_eval_args(p)
    p.set_defaults(handler=_train)

    p = sub.add_parser("eval", help="event recall, lead times and false alarms of a model on data")
    p.add_argument("--model", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--faults", help="faults.json of gen-trace: also report recall on predictable faults")
    p.add_argument("--threshold", type=float, help="override the model's threshold")
    p.add_argument("--missing", default="error", choices=["error", "nan"], help="model metrics absent from the data")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_eval)

    p = sub.add_parser("score", help="stream a metrics CSV through the online runtime (rules + model)")
    p.add_argument("--model", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--out", default="-", help="scores CSV ('-' for stdout)")
    p.add_argument("--rules", help="rules file (default: the shipped rules.json)")
    p.add_argument("--missing", default="error", choices=["error", "nan"])
    p.set_defaults(handler=_score)

    p = sub.add_parser("export", help="export the agent's history store to CSV")
    p.add_argument("--history", required=True, help="history SQLite file")
    p.add_argument("--metrics", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--since", type=float, help="only data at or after this Unix time")
    p.set_defaults(handler=_export)

    p = sub.add_parser("gen-trace", help="write a synthetic trace following StepFun's fault mix")
    p.add_argument("--out", required=True, help="folder for metrics.csv, events.csv, faults.json")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--days", type=float, default=2.0)
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiplier of StepFun's fault rate")
    p.add_argument("--repair-scale", type=float, default=1.0, help="multiplier of the trace's repair times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", help="StepFun trace folder (default ../shared/data/stepfun-fault-trace)")
    p.set_defaults(handler=_gen_trace)
