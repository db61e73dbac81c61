"""``trainguard predictor ...``: train, evaluate and run the anomaly predictor on CSV files.

Subcommands: ``train`` (fit a model on a history and save it), ``eval`` (event recall, lead times and false
alarms of a model on other data, at the self-calibrated thresholds), ``score`` (stream a metrics file through
the online runtime, rules tier included, and write one score per input row), ``metrics`` (the catalog, and
what each column of a file is taken as), ``export`` (agent history store -> CSV) and ``gen-trace`` (a
synthetic trace following StepFun's fault mix, for trials). Every import beyond argparse happens inside the handlers,
so ``trainguard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

#: ``score`` prints a line per node up to this many nodes; beyond, a fleet summary and the nodes to look at.
MAX_NODE_LINES = 20


def printable(text: str) -> str:
    """A column or node name of the user's file, escaped to print (see :mod:`trainguard.detectors.text`): a name
    holding ESC or U+202E rewrote the terminal. Imported on use, to keep ``--help`` fast."""
    from trainguard.detectors.text import printable as escape

    return escape(text)


def _add_eval_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    """Horizon, lead, cooldown and budget; at ``eval`` they default to the model's own (None)."""
    d = (lambda v: v) if defaults else (lambda v: None)
    own = (lambda v: f"default {v}") if defaults else (lambda v: "default: the model's")
    p.add_argument("--horizon", type=float, default=d(1800.0),
                   help=f"H: earliest useful warning, seconds ({own('1800')})")
    p.add_argument("--min-lead", "--lead", dest="min_lead", type=float, default=d(120.0),
                   help=f"L: checkpoint time, the least useful lead, seconds ({own('120')})")
    p.add_argument("--cooldown", type=float, default=d(1200.0),
                   help=f"least time between two alarms of a node (and repeat interval), seconds ({own('1200')})")
    p.add_argument("--budget", type=float, default=d(1.0),
                   help=f"false alarms allowed per 100 node-days ({own('1, i.e. 0.01 per node-day')})")


def _eval_config(args: argparse.Namespace, base: Any = None) -> Any:
    from dataclasses import replace

    from trainguard.predictor.evaluation import EvalConfig

    given = {"horizon_s": args.horizon, "min_lead_s": args.min_lead, "cooldown_s": args.cooldown,
             "budget_per_100_node_days": args.budget}
    for flag, v in (("--horizon", args.horizon), ("--min-lead", args.min_lead), ("--cooldown", args.cooldown),
                    ("--budget", args.budget)):
        # finite too: an infinite budget crashed calibration with a traceback, an infinite horizon or cooldown
        # was written into the model file as a value no JSON reader takes
        if v is not None and not (math.isfinite(v) and (v > 0 if flag in ("--horizon", "--budget") else v >= 0)):
            kind = "positive" if flag in ("--horizon", "--budget") else ">= 0"
            raise _usage(f"{flag} {v:g}: must be a finite number, {kind}")
    cfg = replace(base if base is not None else EvalConfig(), **{k: v for k, v in given.items() if v is not None})
    if cfg.min_lead_s >= cfg.horizon_s:
        raise _usage(f"--min-lead {cfg.min_lead_s:g} must be below --horizon {cfg.horizon_s:g}")
    return cfg


def _local(path: str) -> str:
    """argparse type of every file argument: a URL would otherwise be read as the local path ``https:/...``, and
    ``-`` (a pipe, by the usual convention) as a file named ``-``: "no such file" for an input, a stray file for
    an output."""
    if "://" in path:
        raise argparse.ArgumentTypeError(f"{path}: only local files are read, not URLs; download it first")
    if path == "-":
        raise argparse.ArgumentTypeError("-: this file is not read from or written to a pipe (a file may be read "
                                         "twice, or checked before the work); give the path of a file, e.g. "
                                         "save the pipe's output to one first")
    return path


def _local_or_stdout(path: str) -> str:
    """:func:`_local`, except that ``-`` is standard output (``score --out``)."""
    return path if path == "-" else _local(path)


#: A --since above this (the year 5138 in seconds) is a time in milliseconds or finer: 2026 is 1.8e12 in ms.
_SINCE_MAX_S = 1e11


def _usage(msg: str) -> Exception:
    from trainguard.predictor.errors import PredictorError

    return PredictorError(msg)


def _check_out_folder(path: str, flag: str, name: str) -> None:
    """Refuses an output path whose folder does not exist, or that is a folder, before any work is done (training
    can take minutes); ``name`` is a file name to suggest inside a folder."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _usage(f"{flag} {path}: folder {folder} does not exist; create it or write somewhere else")
    if os.path.isdir(path):
        # found only when the file was written, after the minutes of training, and named no flag
        raise _usage(f"{flag} {path} is a folder; give the path of the file to write, e.g. {os.path.join(path, name)}")


def _check_not_an_input(path: str | None, flag: str, inputs: dict[str, str | None]) -> None:
    """Refuses an output path that names a file the command reads or also writes (by the file, links included):
    it was overwritten, e.g. ``score --metrics m.csv --out m.csv`` replaced the user's telemetry with its scores."""
    import os

    if path is None or path == "-":
        return
    for in_flag, src in inputs.items():
        if src is None:
            continue
        try:
            same = os.path.samefile(path, src)
        except OSError:  # either does not exist (yet): then only the same spelled path is the same file
            same = os.path.realpath(path) == os.path.realpath(src)
        if same:
            raise _usage(f"{flag} {path} is the same file as {in_flag} {src}: writing one would destroy the other; "
                         f"give {flag} a path of its own")


def _load_metrics(path: str, check_order: bool = True, used: Any = None) -> Any:
    """The metrics file, without the non-numeric columns the command does not read (``used``: name -> bool;
    None: columns without any number), which are named on stderr."""
    from trainguard.predictor.table import MetricTable

    table = MetricTable.from_csv(path, check_order, ignore_text=True, used=used)
    if table.text_columns:
        why = "not read by the model or the rules" if used is not None else "text, not metrics"
        print(f"{path}: ignored non-numeric column(s): {', '.join(map(printable, table.text_columns))} ({why})",
              file=sys.stderr)
    return table


def _read_metrics(path: str, resample: float | None, counters: set[str] | frozenset[str] = frozenset(),
                  used: Any = None, rules: Any = None, model_metrics: Any = ()) -> Any:
    if resample is None:
        return _load_metrics(path, used=used)
    # resampling sorts each node and merges the samples of a bin, so rows out of order or sharing a
    # timestamp are data to merge, not an error
    return _resampled(_load_metrics(path, False, used), path, resample, counters, rules, model_metrics)


def _resampled(table: Any, path: str, resample: float, counters: set[str] | frozenset[str],
               rules: Any = None, model_metrics: Any = ()) -> Any:
    """``table`` (read without the order check) on a ``resample`` s grid, saying how many rows were merged."""
    if not resample > 0:
        raise _usage(f"--resample {resample:g}: give the new interval in seconds (> 0)")
    import numpy as np

    # the spacing of each node's distinct times (repeats merge into one bin whatever the interval)
    gaps = [g[g > 0] for g in (np.diff(s.ts) for s in table.per_node())]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    step = float(np.median(gaps)) if len(gaps) else None
    if step is not None and resample < 0.75 * step:  # the tolerance of the interval checks (check_sampling)
        # bins finer than the data leave most of them empty: the spacing then measured (63 s for 60 s data in 7 s
        # bins) was named as the --interval to train with
        raise _usage(f"--resample {resample:g} is finer than the data's {step:g} s sampling ({path}): resampling "
                     f"merges samples, it cannot add any; give --resample {step:g} or more, or leave it out")
    dup = table.duplicate_rows()
    if dup:
        print(f"{path}: merged {dup} row(s) that repeat a node's timestamp into their {resample:g} s bin "
              "(gauges averaged, counters' last value)", file=sys.stderr)
    # the columns a value rule reads keep what the rule looks for (a 2-minute nic_up == 0 averaged into a 5-minute
    # bin read 0.6, and the fatal rule never fired)
    # (only columns the model does not read: a model metric is merged as train merged it, or its features
    # would shift between training and scoring)
    keep = None
    if rules is not None:
        keep = {c: how for c, how in rules.bin_aggregates(table.columns).items() if c not in set(model_metrics)}
        counters = set(counters) | {c for c, (how, _) in keep.items() if how == "last"}
    out = table.resample(resample, counters, keep)
    other = len(table.ts) - len(out.ts) - dup  # every bin is one row: the rest went into a bin with another
    if other:
        print(f"{path}: merged {other} row(s) sampled at other times into the {resample:g} s bin of another sample "
              "of their node (gauges averaged, counters' last value)", file=sys.stderr)
    return out


def _without_empty_model_columns(table: Any, path: str, model_metrics: Any, missing: str) -> Any:
    """``table`` without the model's metric columns that hold no value in any row, which are then missing metrics
    like an absent column: refused under ``--missing error``, named in the degraded scores under ``nan``.

    A column left empty (an exporter's series with no data in the range) was scored as if the model had never
    read it, with nothing saying so, even under ``--missing error``.

    Raises:
        FeatureMismatchError: such a column, and ``missing`` is ``"error"``.
    """
    import numpy as np

    from trainguard.predictor.errors import FeatureMismatchError
    from trainguard.predictor.table import MetricTable

    wanted = set(model_metrics)
    empty = [k for k, c in enumerate(table.columns) if c in wanted and np.isnan(table.values[:, k]).all()]
    if not empty:
        return table
    names = [table.columns[k] for k in empty]
    if missing == "error":
        raise FeatureMismatchError(
            f"{path}: column(s) {names}, which the model was trained on, hold no value in any row; supply their "
            "values, or accept degraded scores without them with --missing nan")
    print(f"{path}: column(s) {names} hold no value in any row; scored as missing metrics (--missing nan)",
          file=sys.stderr)
    keep = [k for k in range(len(table.columns)) if k not in empty]
    return MetricTable([table.columns[k] for k in keep], table.ts, table.node, table.values[:, keep], table.job,
                       list(table.text_columns), table.ts_text)


def _train(args: argparse.Namespace) -> int:
    import numpy as np

    from trainguard.predictor.features import MIN_PEERS, FeatureConfig
    from trainguard.predictor.table import EventTable
    from trainguard.predictor.training import TrainConfig, column_kinds, train

    for flag, v in (("--interval", args.interval), ("--short-window", args.short_window),
                    ("--long-window", args.long_window), ("--resample", args.resample)):
        if v is not None and not 0 < v < float("inf"):
            raise _usage(f"{flag} {v:g}: must be a positive number of seconds (or leave it out)")
    if not 0.05 <= args.calib_fraction <= 0.8:
        raise _usage(f"--calib-fraction {args.calib_fraction:g}: must be within [0.05, 0.8] (the trailing share of "
                     "the history that calibrates the threshold; default 0.25)")
    _check_out_folder(args.out, "--out", "model.json")
    _check_not_an_input(args.out, "--out", {"--metrics": args.metrics, "--events": args.events})
    notes: list[str] = []  # printed after the summary
    if args.resample is None:
        metrics = _read_metrics(args.metrics, None)
    else:
        # the columns are classified on the raw rows (counters keep their last value in a bin), which need
        # no order for that: --resample accepts rows out of order here as in eval and score
        raw = _load_metrics(args.metrics, check_order=False)
        kinds = column_kinds(raw, tuple(args.counter), tuple(args.gauge))
        counters = {c.name for c in kinds if c.kind is not None and c.kind.value == "counter"}
        metrics = _resampled(raw, args.metrics, args.resample, counters)
    events = EventTable.from_csv(args.events) if args.events else None
    interval = args.interval if args.interval is not None else (args.resample or metrics.median_interval() or 60.0)
    if events is not None:
        from trainguard.predictor.evaluation import uncounted_events

        # Counted as eval counts them: a failure logged twice, or an event of a node or time the metrics lack,
        # was a failure to train's count, and five such rows of one failure switched `auto` to the supervised
        # model ("trained hgb ... 5 failures").
        events, repeated = events.unique()
        if repeated:
            print(f"{args.events}: {repeated} event(s) repeat the node and time of an earlier one; each failure "
                  "counted once", file=sys.stderr)
        # as eval does: an event on a node or at a time the metrics do not have labels no row, and was dropped
        # in silence (an events file of other nodes or another period trained a model with no failure at all)
        unusable = uncounted_events(events.node, events.ts, metrics.ts, metrics.node, _eval_config(args), interval)
        unusable["warning_window_not_observed"] = []  # still labels the rows of its window the data has
        _report_uncounted(args.events, args.metrics, len(events), unusable)
        gone = {(str(n), float(t)) for k in ("node_not_in_metrics", "outside_node_data") for n, t in unusable[k]}
        if gone:
            keep = np.array([(str(n), float(t)) not in gone for n, t in zip(events.node, events.ts)], dtype=bool)
            events = EventTable(events.ts[keep], events.node[keep], events.kind[keep])
    span = float(metrics.ts.max() - metrics.ts.min()) if len(metrics.ts) else 0.0
    peer = not args.no_peer
    if peer:
        per_job: dict[str, set[str]] = {}
        for j, n in zip(metrics.job if metrics.job is not None else [""] * len(metrics.ts), metrics.node):
            per_job.setdefault(str(j), set()).add(str(n))
        most = max((len(v) for v in per_job.values()), default=0)
        if most < MIN_PEERS:
            # peers would be missing in every row, here and when scoring: every score flagged degraded
            peer = False
            notes.append(f"peer features off (as --no-peer): the largest job has {most} node(s), peer z-scores "
                         f"need {MIN_PEERS} of one job; train on {MIN_PEERS} or more nodes for a fleet model")
    features = FeatureConfig.for_data(interval, span, peer=peer, short_window_s=args.short_window,
                                      long_window_s=args.long_window)
    cfg = TrainConfig(
        method=args.method, evaluation=_eval_config(args), calib_fraction=args.calib_fraction, seed=args.seed,
        features=features, counters=tuple(args.counter), gauges=tuple(args.gauge),
        online_calibration=args.calibration != "fixed", per_family=args.calibration == "online-family",
    )
    model = train(metrics, events, cfg)
    size = model.save(args.out)
    s = model.training_summary
    fc = model.spec.config
    print(f"trained {s['method']} on {s['rows']} rows, {s['nodes']} nodes, {s['node_days']:.1f} node-days, "
          f"{s['failures_total']} failures; interval {fc.interval_s:g} s, windows {fc.short_window_s:g}/"
          f"{fc.long_window_s:g} s, own baseline {fc.self_window_s:g} s; fleet threshold {model.threshold:.4f}; "
          f"thresholds {_threshold_mode(model)}"
          f"{model.eval_config.budget_per_100_node_days / 100:g} alarms/node-day; saved {args.out} ({size} bytes)")
    if s["ignored_columns"]:
        print("ignored columns (left to the rules tier or without values): "
              f"{', '.join(map(printable, s['ignored_columns']))}")
    for note in notes:
        print(note)
    return 0


def _threshold_mode(model: Any) -> str:
    if model.calibration is None:
        return "fixed, "
    return "per node and metric family, online, to " if model.calibration.per_family else "per node, online, to "


def _eval(args: argparse.Namespace) -> int:
    import math

    import numpy as np

    from trainguard.predictor.calibration import calibrate_table
    from trainguard.predictor.evaluation import (
        calibrate_threshold, evaluate_events, failures_by_node, uncounted_events,
    )
    from trainguard.predictor.model import PredictorModel, json_safe
    from trainguard.predictor.table import EventTable
    from trainguard.predictor.training import calibration_scores, score_table

    model = PredictorModel.load(args.model)
    ev = _eval_config(args, model.eval_config)
    truth = _read_faults(args.faults) if args.faults else None
    used = set(model.spec.metrics)
    metrics = _read_metrics(args.metrics, args.resample, _model_counters(model), used.__contains__)
    metrics = _without_empty_model_columns(metrics, args.metrics, model.spec.metrics, args.missing)
    events, repeated = EventTable.from_csv(args.events).unique()
    if repeated:
        # one failure logged twice counted as two, each caught or missed by the same alarm: recall and the
        # failure counts were off
        print(f"{args.events}: {repeated} event(s) repeat the node and time of an earlier one; each failure counted "
              "once", file=sys.stderr)
    frame, score = score_table(model, metrics, args.missing)
    failures = failures_by_node(events.node, events.ts)
    interval = model.spec.config.interval_s
    uncounted = uncounted_events(events.node, events.ts, frame.ts, frame.node, ev, interval)
    _report_uncounted(args.events, args.metrics, len(events), uncounted)
    cold = False  # online thresholds: no node warmed up, so nothing could alarm
    if args.threshold is not None or model.calibration is None:
        thr = model.threshold if args.threshold is None else args.threshold
        mode = "fixed"
        rep = evaluate_events(frame.ts, frame.node, score, thr, failures, ev, interval)
    else:
        from dataclasses import replace

        cal = replace(model.calibration, budget_per_day=ev.budget_per_100_node_days / 100.0)
        # as the agent does: each failure takes the hours before it out of the node's calibration history
        # once it happened (PredictorMonitor.record_failure)
        incidents = {n: [(t - ev.early_s, t, t) for t in f.tolist()] for n, f in failures.items()}
        margin, _ = calibrate_table(frame.ts, frame.node, calibration_scores(model, frame, score), cal, incidents)
        mode = "online per node and metric family" if cal.per_family else "online per node"
        rep = evaluate_events(frame.ts, frame.node, margin, 0.0, failures, ev, interval)
        if len(margin) and not np.isfinite(margin).any():
            # Every row still warms its node's threshold up: no alarm was possible, so "0 false alarms, within
            # budget" said nothing about the model (score prints "still warming up" for the same data).
            cold = True
            print(f"{args.metrics}: no node finished warming up its threshold (a day of its own scores): no alarm "
                  "was possible, so the false-alarm budget is not judged; evaluate on longer data", file=sys.stderr)
    out = rep.summary()
    out["events_total"] = len(events) + repeated
    out["events_repeated"] = repeated
    out["events_not_counted"] = {k: len(v) for k, v in uncounted.items()}
    if mode != "fixed":
        out["threshold"] = None  # one per node, changing over time
    out["threshold_mode"] = mode
    out["budget_per_100_node_days"] = ev.budget_per_100_node_days
    out["within_budget"] = bool(rep.false_alarms_per_100_node_days <= ev.budget_per_100_node_days) \
        if rep.node_days and not cold else None
    out["eval_config"] = ev.to_dict()
    # the best any single threshold could do on this very data at the budget (hindsight, for comparison)
    best_thr, best = calibrate_threshold(frame.ts, frame.node, score, failures, ev, interval)
    out["hindsight_threshold"], out["hindsight_recall"] = best_thr, best.recall
    if frame.missing_metrics:
        out["degraded_missing_metrics"] = frame.missing_metrics
    if truth is not None:
        keys = {(f["node"], float(f["ts"])) for f in truth if f.get("predictable")}
        c, t = rep.recall_of(keys)
        out["predictable_failures"], out["predictable_caught"] = t, c
        out["predictable_recall"] = c / t if t else float("nan")
    if args.json:
        print(json.dumps(json_safe(out), indent=1, allow_nan=False))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v:.4f}" if isinstance(v, float) and not math.isnan(v) else f"{k:32s} {v}")
    return 0


def _report_uncounted(events_path: str, metrics_path: str, total: int,
                      uncounted: dict[str, list[tuple[str, float]]]) -> None:
    """One warning line for events eval cannot count as failures; refuses an events file none of whose events
    falls on a node and time of the metrics (the wrong file, or another unit of time)."""
    from trainguard.predictor.table import format_timestamp

    why = {"node_not_in_metrics": "on nodes absent from the metrics",
           "outside_node_data": "outside their node's data",
           "warning_window_not_observed": "within the first --horizon of their node's data (no warning window)"}
    n = sum(len(v) for v in uncounted.values())
    if not n:
        return
    key = next(k for k, v in uncounted.items() if v)
    node, t = uncounted[key][0]
    example = f"e.g. node {node!r} at {format_timestamp(t)}"
    unmatched = len(uncounted["node_not_in_metrics"]) + len(uncounted["outside_node_data"])
    if unmatched == total:
        raise _usage(f"{events_path}: none of its {total} events falls on a node and time of {metrics_path} "
                     f"({example}, {why[key]}); give the events of the same nodes and period (timestamps in Unix "
                     "seconds or ISO 8601; a time without an offset is read as UTC)")
    parts = ", ".join(f"{len(v)} {why[k]}" for k, v in uncounted.items() if v)
    print(f"{events_path}: {n} of {total} events not counted as failures: {parts}; {example}", file=sys.stderr)


def _read_faults(path: str) -> list[dict[str, Any]]:
    """The ``faults`` list of a gen-trace ``faults.json`` (each with ``node``, ``ts``, ``predictable``)."""
    what = "pass the faults.json that `trainguard predictor gen-trace` wrote beside the metrics"
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise _usage(f"--faults {path}: cannot read it ({exc.strerror}); {what}") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise _usage(f"--faults {path}: not JSON (truncated?); {what}") from exc
    faults = doc.get("faults") if isinstance(doc, dict) else None
    if not (isinstance(faults, list) and all(isinstance(f, dict) and isinstance(f.get("ts"), (int, float))
                                             and "node" in f for f in faults)):
        raise _usage(f"--faults {path}: not a faults file (no 'faults' list of node, ts, predictable); {what}")
    return faults


def _model_counters(model: Any) -> set[str]:
    return {m for m, k in zip(model.spec.metrics, model.spec.kinds) if k == "counter"}


def _score(args: argparse.Namespace) -> int:
    import csv

    import numpy as np

    from trainguard.predictor.runtime import PredictorRuntime

    _check_not_an_input(args.out, "--out", {"--metrics": args.metrics, "--model": args.model, "--rules": args.rules})
    rt = PredictorRuntime.load(args.model, rules_path=args.rules, missing=args.missing)
    counters = _model_counters(rt.model) if rt.model is not None else set()
    metrics = _read_metrics(args.metrics, args.resample, counters, _score_reads(rt), rt.rules,
                            rt.model.spec.metrics if rt.model is not None else ())
    if rt.model is not None:
        metrics = _without_empty_model_columns(metrics, args.metrics, rt.model.spec.metrics, args.missing)
    interval = rt.model.spec.config.interval_s if rt.model is not None else 1.0
    if rt.model is not None:
        from trainguard.predictor.features import align_metrics
        from trainguard.predictor.training import check_sampling

        align_metrics(metrics.columns, rt.model.spec, args.missing)  # eval's check, naming --missing nan
        check_sampling(metrics, interval)
    jobs = metrics.job.astype(str) if metrics.job is not None else np.full(len(metrics.ts), "")
    nodes = metrics.node.astype(str)
    peer = rt.model is not None and rt.model.spec.config.peer
    rounds = _score_rounds(metrics.ts, nodes, jobs, interval if peer else None)
    alarms = written = 0
    rule_alarms: dict[str, int] = {}  # the runtime's status counts the budgeted (learned) tier only
    try:
        out = open(args.out, "w", newline="") if args.out != "-" else sys.stdout
    except OSError as exc:
        raise _usage(f"--out {args.out}: cannot write it ({exc.strerror}); check that its folder exists and is "
                     "writable") from exc
    try:
        w = csv.writer(out)
        w.writerow(["timestamp", "node", "score", "threshold", "alarm", "source", "top_features", "degraded",
                    "surprise", "family"])
        for group in rounds:
            samples = {nodes[r]: dict(zip(metrics.columns, metrics.values[r].tolist())) for r in group}
            ts_of = {nodes[r]: float(metrics.ts[r]) for r in group}
            # the input's own timestamp text (ISO, offsets, integers), so a score row joins back to its input row
            # on (timestamp, node); resampled bins have no input text and are written as Unix seconds
            stamp = {nodes[r]: metrics.ts_text[r] if metrics.ts_text is not None else repr(ts_of[nodes[r]])
                     for r in group}
            if peer:
                # each row at its own time, as the offline features (eval) see it; the slot only groups peers
                scores = rt.observe_many(min(ts_of.values()), samples, ts_of)
            else:
                scores = {n: rt.observe(ts_of[n], n, m) for n, m in samples.items()}
            for n, s in scores.items():
                alarms += int(s.alarm)
                if s.alarm and s.source == "rules":
                    rule_alarms[n] = rule_alarms.get(n, 0) + 1
                written += 1
                w.writerow([stamp[n], n, f"{s.score:.6f}", f"{s.threshold:.6f}", int(s.alarm), s.source,
                            ";".join(f"{k}={v:g}" for k, v in s.top_features), "|".join(s.degraded),
                            "" if s.surprise != s.surprise else f"{s.surprise:.3f}", s.family])
        if out is not sys.stdout:
            out.flush()
    except OSError as exc:
        # a write error carries no file name: a full --out was called "the output (standard output)"
        if exc.filename is None and out is not sys.stdout:
            exc.filename = args.out
        raise
    finally:
        if out is not sys.stdout:
            try:
                out.close()
            except OSError:
                pass  # the flush above raised already, or the error is told by it
    if written != len(metrics.ts):  # a bug, never a silent loss
        raise _usage(f"scored {written} of {len(metrics.ts)} rows; please report this with the input file")
    src = f" (resampled to {args.resample:g} s)" if args.resample is not None else ""
    n_rules = sum(rule_alarms.values())
    print(f"scored {written} rows{src}, {alarms} above threshold ({alarms - n_rules} learned tier, {n_rules} "
          "rules-tier)", file=sys.stderr)
    shown = [st for st in rt.status() if st.observed_days > 0 or rule_alarms.get(st.node, 0)]
    if len(shown) > MAX_NODE_LINES:
        # one line per node drowned the summary for a fleet (2000 nodes, 2000 lines): the nodes over their
        # budget or with rules-tier alarms are the ones to look at, the rest is counted
        over = sorted((st for st in shown if st.alarms_per_day > st.budget_per_day or rule_alarms.get(st.node, 0)),
                      key=lambda st: (-st.alarms_per_day, st.node))
        days = sum(st.observed_days for st in shown)
        print(f"{len(shown)} nodes, {sum(st.alarms for st in shown)} learned-tier alarms in {days:.1f} node-days "
              f"= {sum(st.alarms for st in shown) / days if days else 0.0:.3g}/node-day; {len(over)} over their "
              f"budget or with rules-tier alarms" + (f" (the first {MAX_NODE_LINES} below)" if len(over) >
                                                      MAX_NODE_LINES else ""), file=sys.stderr)
        shown = over[:MAX_NODE_LINES]
    for st in shown:
        rules = rule_alarms.get(st.node, 0)
        if st.observed_days > 0 or rules:
            print(f"node {printable(st.node)}: {st.alarms} learned-tier alarms in {st.observed_days:.2f} days = "
                  f"{st.alarms_per_day:.3g}/day (budget {st.budget_per_day:g}/day"
                  f"{'' if st.calibrated else ', still warming up'})"
                  + (f"; {rules} rules-tier alarm(s) (fatal faults, outside the budget)" if rules else ""),
                  file=sys.stderr)
    return 0


def _score_reads(rt: Any) -> Any:
    """Whether ``score`` reads a column: a metric of the model or one the rules tier watches."""
    import fnmatch

    metrics = set(rt.model.spec.metrics) if rt.model is not None else set()
    patterns = rt.rules.watched_patterns
    return lambda c: c in metrics or any(fnmatch.fnmatchcase(c, p) for p in patterns)


def _score_rounds(ts: Any, nodes: Any, jobs: Any, interval: float | None) -> list[Any]:
    """Row groups in the order they are scored; every row exactly once.

    Without peers, each row alone, in time order. With peers, the rows of one job in one interval slot form a
    group scored together; a node with two samples in one slot gets its second one in a following group (in
    time order), never dropped.
    """
    import numpy as np

    if interval is None:
        return [np.array([i]) for i in np.argsort(ts, kind="stable")]
    bucket = np.round(ts / interval).astype(np.int64)
    order = np.lexsort((ts, nodes, jobs, bucket))
    groups: list[Any] = []
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and bucket[order[j]] == bucket[order[i]] and jobs[order[j]] == jobs[order[i]]:
            j += 1
        seen: dict[str, int] = {}
        rounds: list[list[int]] = []
        for r in order[i:j]:  # sorted by node then time: the k-th sample of a node goes to round k
            k = seen.get(nodes[r], 0)
            seen[nodes[r]] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(int(r))
        groups += [np.array(g) for g in rounds]
        i = j
    return groups


def _metrics(args: argparse.Namespace) -> int:
    from trainguard.predictor.catalog import CATALOG

    # every file is read before anything is printed: an error is then the only output
    table = kinds = model = None
    if args.metrics:
        from trainguard.predictor.training import column_kinds

        table = _load_metrics(args.metrics, check_order=False)  # only its columns are classified
        kinds = column_kinds(table, tuple(args.counter), tuple(args.gauge))
    if args.model:
        from trainguard.predictor.model import PredictorModel

        model = PredictorModel.load(args.model)
    print("catalog (the detectors' names; any other numeric column is accepted too):")
    for m in CATALOG:
        print(f"  {m.name:28s} {m.kind.value:8s} {m.unit:9s} {m.description}")  # the catalog: our own text
    if table is not None and kinds is not None:
        print(f"columns of {args.metrics}, as training would take them:")
        for c in kinds:
            print(f"  {printable(c.name):28s} {c.kind.value if c.kind else 'unused':8s} ({c.reason})")
        for name in table.text_columns:
            print(f"  {printable(name):28s} {'unused':8s} (not numeric)")
    if model is not None:
        print(f"metrics of {args.model}:")
        for m, k in zip(model.spec.metrics, model.spec.kinds):
            print(f"  {printable(m):28s} {k}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from trainguard.predictor.history import MetricHistory

    _check_not_an_input(args.metrics, "--metrics", {"--history": args.history})
    _check_not_an_input(args.events, "--events", {"--history": args.history, "--metrics": args.metrics})
    for flag, path in (("--metrics", args.metrics), ("--events", args.events)):
        _check_out_folder(path, flag, flag[2:] + ".csv")  # before the first file is written, not a traceback after it
    if args.since is not None and not (math.isfinite(args.since) and args.since < _SINCE_MAX_S):
        # A time in milliseconds (what most dashboards and JavaScript give) wrote two empty files and exit 0.
        hint = (f"; it looks like milliseconds or finer: in seconds that is {args.since / 1000:.0f} (ms) or "
                f"{args.since / 1e6:.0f} (us)" if math.isfinite(args.since) else "")
        raise _usage(f"--since {args.since:g} is no Unix time in seconds{hint}")
    with MetricHistory(args.history, readonly=True) as h:
        try:
            n, e = h.export(args.metrics, args.events, since=args.since)
        except OSError as exc:  # a read-only folder, a full disk, a folder where the file goes
            flag = "--events" if exc.filename == args.events else "--metrics"
            raise _usage(f"{flag} {exc.filename}: cannot write it ({exc.strerror}); give a writable path") from exc
        span = h.span() if n == 0 and args.since is not None else None
    print(f"exported {n} samples and {e} events")
    if span is not None:
        # Empty files with exit 0 looked like an empty store; the span says the --since was past the data.
        print(f"no sample at or after --since {args.since:.0f}: the history holds samples from {span[0]:.0f} to "
              f"{span[1]:.0f} (Unix seconds); give an earlier --since", file=sys.stderr)
    return 0


def _gen_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainguard.predictor.tracegen import TraceConfig, generate

    for flag, v, ok, need in (("--nodes", args.nodes, args.nodes >= 1, "at least 1"),
                              ("--days", args.days, args.days > 0, "positive"),
                              ("--interval", args.interval, args.interval > 0, "positive (seconds)"),
                              ("--rate-scale", args.rate_scale, args.rate_scale >= 0, ">= 0"),
                              ("--repair-scale", args.repair_scale, args.repair_scale > 0, "positive")):
        if not ok:  # also NaN, which compares false
            raise _usage(f"{flag} {v:g}: must be {need}")
    if args.days * 86400 < args.interval:
        raise _usage(f"--days {args.days:g} is shorter than one --interval {args.interval:g} s; give more days or a "
                     "shorter interval")
    try:  # before minutes of generation, not after
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _usage(f"--out {args.out}: cannot create the folder ({exc.strerror}); give a writable folder") from exc
    cfg = TraceConfig(n_nodes=args.nodes, days=args.days, interval_s=args.interval, rate_scale=args.rate_scale,
                      repair_scale=args.repair_scale, seed=args.seed, trace_dir=args.trace_dir)
    tr = generate(cfg)
    tr.save(args.out)
    print(f"wrote {len(tr.metrics.ts)} samples of {args.nodes} nodes and {len(tr.faults)} failures "
          f"({sum(f.predictable for f in tr.faults)} with precursors) to {args.out}")
    return 0


def _add_column_args(p: argparse.ArgumentParser, resample: bool = True) -> None:
    p.add_argument("--counter", action="append", default=[], metavar="NAME",
                   help="treat this column as a cumulative counter (repeatable; default: detected)")
    p.add_argument("--gauge", action="append", default=[], metavar="NAME",
                   help="treat this column as a gauge (repeatable; default: detected)")
    if resample:
        p.add_argument("--resample", type=float, metavar="SECONDS",
                       help="bring the data to a regular interval first (gauges: mean, counters: last value)")


def register(subparsers: Any) -> None:
    """Adds ``predictor`` and its subcommands to the ``trainguard`` parser.

    Args:
        subparsers: the top-level subparsers action.
    """
    top = subparsers.add_parser("predictor", help="anomaly predictor: train, eval, score")
    sub = top.add_subparsers(dest="predictor_command", metavar="SUBCOMMAND", parser_class=type(top))
    top.set_defaults(handler=lambda a: (top.print_help(), 2)[1])

    p = sub.add_parser("train", help="fit a model on a metrics history (CSV) and save it")
    p.add_argument("--metrics", required=True, type=_local, help="metrics CSV: timestamp,node[,job],<metrics...>")
    p.add_argument("--events", type=_local, help="failures CSV: timestamp,node,kind (without: unsupervised)")
    p.add_argument("--out", required=True, type=_local, help="model file to write (JSON)")
    p.add_argument("--method", default="auto", choices=["auto", "hgb", "robust-z", "threshold"])
    p.add_argument("--interval", type=float, help="sampling interval of the data, seconds (default: measured)")
    p.add_argument("--short-window", type=float, help="short feature window, seconds (default: from the interval)")
    p.add_argument("--long-window", type=float, help="long feature window, seconds (default: from the interval)")
    _add_column_args(p)
    p.add_argument("--no-peer", action="store_true", help="no peer z-scores (for a model run on one node alone)")
    p.add_argument("--calib-fraction", type=float, default=0.25, help="trailing share of time to calibrate on")
    p.add_argument("--calibration", default="online", choices=["online", "online-family", "fixed"],
                   help="online: each node fits its own threshold to the budget (default); online-family: per node "
                        "and metric family (unsupervised tier; see the predictor README); fixed: the fleet's")
    p.add_argument("--seed", type=int, default=0)
    _add_eval_args(p, defaults=True)
    p.set_defaults(handler=_train)

    p = sub.add_parser("eval", help="event recall, lead times and false alarms of a model on data")
    p.add_argument("--model", required=True, type=_local, help="model file written by `train`")
    p.add_argument("--metrics", required=True, type=_local,
                   help="metrics CSV to evaluate on: timestamp,node[,job],<metrics...> (other nodes or a later period)")
    p.add_argument("--events", required=True, type=_local,
                   help="failures CSV of the same nodes and period: timestamp,node,kind")
    p.add_argument("--faults", type=_local,
                   help="faults.json of gen-trace: also report recall on predictable faults")
    p.add_argument("--threshold", type=float, help="one fixed threshold for every node instead of the model's")
    p.add_argument("--missing", default="error", choices=["error", "nan"], help="model metrics absent from the data")
    p.add_argument("--resample", type=float, help="bring the data to this interval, seconds, first")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (no NaN: null)")
    _add_eval_args(p, defaults=False)
    p.set_defaults(handler=_eval)

    p = sub.add_parser("score", help="stream a metrics CSV through the online runtime (rules + model)")
    p.add_argument("--model", required=True, type=_local, help="model file written by `train`")
    p.add_argument("--metrics", required=True, type=_local,
                   help="metrics CSV to score: timestamp,node[,job],<metrics...>")
    p.add_argument("--out", default="-", type=_local_or_stdout, help="scores CSV ('-' for stdout)")
    p.add_argument("--rules", type=_local, help="rules file (default: the shipped rules.json)")
    p.add_argument("--missing", default="error", choices=["error", "nan"])
    p.add_argument("--resample", type=float, help="bring the data to this interval, seconds, first")
    p.set_defaults(handler=_score)

    p = sub.add_parser("metrics", help="list the metric catalog and how each column of a file is taken")
    p.add_argument("--metrics", type=_local,
                   help="metrics CSV: show what each column is taken as (counter, gauge, unused)")
    p.add_argument("--model", type=_local, help="model file: show its metrics and their kinds")
    _add_column_args(p, resample=False)
    p.set_defaults(handler=_metrics)

    p = sub.add_parser("export", help="export the agent's history store to CSV")
    p.add_argument("--history", required=True, type=_local, help="history SQLite file")
    p.add_argument("--metrics", required=True, type=_local, help="metrics CSV to write")
    p.add_argument("--events", required=True, type=_local, help="events CSV to write")
    p.add_argument("--since", type=float, help="only data at or after this time, Unix seconds")
    p.set_defaults(handler=_export)

    p = sub.add_parser("gen-trace", help="write a synthetic trace following StepFun's fault mix")
    p.add_argument("--out", required=True, type=_local, help="folder for metrics.csv, events.csv, faults.json")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--days", type=float, default=2.0)
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiplier of StepFun's fault rate")
    p.add_argument("--repair-scale", type=float, default=1.0, help="multiplier of the trace's repair times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", "--trace-dir", dest="trace_dir", metavar="DIR", type=_local,
                   help="StepFun trace folder (default: $TRAINGUARD_FAULT_TRACE_DIR, the wheel's copy, "
                        "shared/data/stepfun-fault-trace beside the checkout)")
    p.set_defaults(handler=_gen_trace)
