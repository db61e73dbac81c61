"""Recall at a false-alarm budget on public, labelled server telemetry, next to two baselines in the same run.

Data (``--data``, each folder has a SOURCE.md): ``bench/data/nab_aws/`` (default): series of NAB's
realAWSCloudwatch folder (EC2/RDS CPU; 5-minute CloudWatch samples, two weeks each) with NAB's labelled incident
windows (``windows.json``); ``bench/data/ms_cloud_latency/``: hourly outbound API latency series of the
Microsoft Cloud Monitoring Dataset with a per-row expert label (runs of labelled rows become windows). NAB's
realKnownCause folder is deliberately NOT used: issue 19's own held-out evaluation very likely drew on it, so
nothing here is tuned on it. Window lengths (a day, an hour) are converted to rows from the measured interval.

Protocol (issue 19's): an alarm event is the score reaching the threshold, repeated at most every cooldown
(20 min); a window is caught when an event falls inside it; every event outside all windows is a false alarm.
The first day of each series is left out of the scoring for every method (each needs a day of history: the
baseline's window, our node's own threshold). Methods, all scored on the same rows:

- ``rolling robust z (1 day)``: ``|x - median| / (1.4826 MAD)`` over the preceding day of the series;
- ``IsolationForest``: scikit-learn's, fitted per series on (value, change, deviation from the last hour's
  mean), transductively on the whole series (it sees the incidents it scores: an advantage);
- ``trainguard (fleet rank)``: the robust-z tier trained on the *other* series (leave one series out), on the
  node's own-baseline ``_z`` features, windows derived from the interval; one pooled threshold;
- ``trainguard (self-calibrated)``: the same scores through each node's online threshold (:mod:`calibration`);
  ranked by the margin over the node's own threshold for the hindsight table.

"Recall at B/day" uses, per method, the single pooled threshold that gives at most B false alarms per day on
this data (hindsight: the best a fixed threshold could do). "Self-calibrated at B" runs each node's online
threshold with budget B and reports what happened: realised false alarms per day and recall, no hindsight.

Usage: ``python bench/bench_predictor_real.py [--data bench/data/nab_aws|bench/data/ms_cloud_latency] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from trainguard.predictor.calibration import calibrate_table
from trainguard.predictor.evaluation import EvalConfig, evaluate_windows, threshold_at_budget
from trainguard.predictor.features import FeatureConfig
from trainguard.predictor.table import MetricTable, concat_tables
from trainguard.predictor.training import TrainConfig, calibration_scores, score_table, train

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "nab_aws"
COOLDOWN_S = 1200.0
BUDGETS = (0.05, 0.2)


def _ts(text: str) -> float:
    """NAB's ``2014-02-14 14:30:00`` or ISO 8601 ``2018-06-17T00:00:00Z`` (both UTC) as Unix seconds."""
    text = text.strip().strip('"').replace("T", " ").rstrip("Z")
    return datetime.strptime(text[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


def _label_windows(ts: np.ndarray, label: np.ndarray) -> list[tuple[float, float]]:
    """Runs of consecutive labelled rows as ``(first, last)`` timestamps (point labels -> incident windows)."""
    out = []
    start = None
    for i, lab in enumerate(label):
        if lab and start is None:
            start = i
        if start is not None and (not lab or i == len(label) - 1):
            end = i if lab else i - 1
            out.append((float(ts[start]), float(ts[end])))
            start = None
    return out


def load_series(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray, list[tuple[float, float]]]]:
    """Reads every ``*.csv`` of a folder: ``timestamp,value`` with the windows in ``windows.json`` (NAB), or
    ``timestamp,value,label`` with a 0/1 label per row (labelled runs become windows).

    Returns:
        series name -> (timestamps, values, labelled windows).
    """
    wfile = folder / "windows.json"
    windows = json.loads(wfile.read_text()) if wfile.exists() else None
    out = {}
    for f in sorted(folder.glob("*.csv")):
        lines = [ln for ln in f.read_text().splitlines() if ln.strip()]
        header = [h.strip().strip('"').lower() for h in lines[0].split(",")]
        rows = [[c.strip().strip('"') for c in ln.split(",")] for ln in lines[1:]]  # upstream quotes its times
        ts = np.array([_ts(r[0]) for r in rows])
        x = np.array([float(r[1]) for r in rows])
        if windows is not None:
            win = [(_ts(a), _ts(b)) for a, b in windows[f.stem]]
        elif "label" in header:
            win = _label_windows(ts, np.array([int(r[header.index("label")]) for r in rows]))
        else:
            raise ValueError(f"{f}: no windows.json next to it and no label column; give one or the other")
        out[f.stem] = (ts, x, win)
    return out


def interval_of(data: dict) -> float:
    """The sampling interval of the data: the median step over all series, seconds."""
    return float(np.median(np.concatenate([np.diff(ts) for ts, _, _ in data.values()])))


def rolling_robust_z(x: np.ndarray, window: int, min_rows: int = 12, std_floor: bool = False) -> np.ndarray:
    """``|x_t - median| / (1.4826 MAD)`` over the ``window`` values before ``t`` (NaN with fewer than
    ``min_rows``). With ``std_floor`` the scale is at least the window's standard deviation: quantised
    series (MAD 0) no longer give huge z for ordinary steps, which makes the baseline much stronger here."""
    from numpy.lib.stride_tricks import sliding_window_view

    z = np.full(len(x), np.nan)
    pad = np.r_[np.full(window, np.nan), x]
    win = sliding_window_view(pad[:-1], window)  # win[t] = the window values before t
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(win, axis=1)
        mad = np.nanmedian(np.abs(win - med[:, None]), axis=1)
        std = np.nanstd(win, axis=1) if std_floor else np.zeros(len(x))
    n = np.sum(~np.isnan(win), axis=1)
    scale = np.maximum(np.maximum(1.4826 * mad, 1e-9 + 1e-6 * np.abs(med)), std)
    ok = n >= min_rows
    z[ok] = np.abs(x[ok] - med[ok]) / scale[ok]
    return z


def isolation_forest(x: np.ndarray, seed: int = 0, hour_rows: int = 12) -> np.ndarray:
    """Anomaly scores of an IsolationForest fitted on the series itself (features: value, change, deviation
    from the mean of the last ``hour_rows`` samples, i.e. the last hour)."""
    from sklearn.ensemble import IsolationForest

    d = np.r_[0.0, np.diff(x)]
    c = np.cumsum(np.r_[0.0, x])
    k = np.minimum(np.arange(len(x)), max(1, hour_rows))
    mean_hour = np.where(k > 0, (c[np.arange(len(x))] - c[np.arange(len(x)) - k]) / np.maximum(k, 1), x)
    feats = np.column_stack([x, d, x - mean_hour])
    clf = IsolationForest(n_estimators=200, random_state=seed).fit(feats)
    return -clf.score_samples(feats)


def _table(name: str, ts: np.ndarray, x: np.ndarray) -> MetricTable:
    return MetricTable(["value"], ts, np.array([name] * len(ts), dtype=object), x.reshape(-1, 1))


def ours(data: dict, budget: float | tuple[float, ...]) -> dict:
    """Leave-one-series-out robust-z scores and self-calibrated margins, per series.

    Returns:
        series -> (scores, margins) for one budget; for a tuple of budgets, budget -> that mapping (one model
        per held-out series, calibrated once per budget).
    """
    budgets = budget if isinstance(budget, tuple) else (budget,)
    out: dict = {b: {} for b in budgets}
    interval = interval_of(data)
    names = list(data)
    for name in names:
        others = concat_tables([_table(n, *data[n][:2]) for n in names if n != name])
        span = max(float(data[n][0][-1] - data[n][0][0]) for n in names)
        cfg = TrainConfig(method="robust-z", features=FeatureConfig.for_data(interval, span, peer=False),
                          evaluation=EvalConfig(cooldown_s=COOLDOWN_S, budget_per_100_node_days=100 * budgets[0]),
                          gauges=("value",))
        model = train(others, None, cfg)
        frame, score = score_table(model, _table(name, *data[name][:2]))
        order = np.argsort(frame.ts)
        cal_in = calibration_scores(model, frame, score)
        for b in budgets:
            margin, _ = calibrate_table(frame.ts, frame.node, cal_in, replace(model.calibration, budget_per_day=b))
            out[b][name] = (score[order], margin[order])
    return out if isinstance(budget, tuple) else out[budgets[0]]


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison and prints the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--name", help="data set name for the printout (default: the folder's name)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    data = load_series(Path(args.data))
    if not data:
        print(f"no series under {args.data}", file=sys.stderr)
        return 2
    methods: dict[str, dict[str, np.ndarray]] = {"rolling robust z (1 day)": {},
                                                 "rolling robust z (1 day), scale >= std": {}, "IsolationForest": {},
                                                 "trainguard (fleet rank)": {}, "trainguard (self-calibrated)": {}}
    per_budget = ours(data, BUDGETS)
    interval = interval_of(data)
    day_rows, hour_rows = int(round(86400.0 / interval)), int(round(3600.0 / interval))
    for name, (ts, x, _) in data.items():
        methods["rolling robust z (1 day)"][name] = rolling_robust_z(x, day_rows)
        methods["rolling robust z (1 day), scale >= std"][name] = rolling_robust_z(x, day_rows, std_floor=True)
        methods["IsolationForest"][name] = isolation_forest(x, hour_rows=hour_rows)
        methods["trainguard (fleet rank)"][name] = per_budget[BUDGETS[0]][name][0]
        methods["trainguard (self-calibrated)"][name] = per_budget[BUDGETS[0]][name][1]

    def scored(scores: dict[str, np.ndarray]) -> list:
        out = []
        for name, (ts, _, win) in data.items():
            keep = ts >= ts[0] + 86400.0  # every method gets a day of history first
            s = np.where(np.isnan(scores[name]), -np.inf, scores[name])
            out.append((ts[keep], s[keep], win))
        return out

    n_win = sum(len(w) for _, _, w in data.values())
    days = evaluate_windows(scored(methods["IsolationForest"]), np.inf, COOLDOWN_S).days
    print(f"{len(data)} series, {n_win} labelled windows, {days:.1f} days scored, interval {interval:g} s "
          f"({args.name or Path(args.data).name})")
    figures: dict = {"series": list(data), "windows": n_win, "days": days, "methods": {}, "self_calibrated": {}}
    print("| method | " + " | ".join(f"recall at {b:g} false alarms/day" for b in BUDGETS) + " |")
    print("|---|" + "---|" * len(BUDGETS))
    for m, scores in methods.items():
        cells = []
        figures["methods"][m] = {}
        for b in BUDGETS:
            _, rep = threshold_at_budget(scored(scores), b, COOLDOWN_S)
            cells.append(f"{rep.recall:.2f} ({rep.caught}/{rep.windows}; {rep.false_alarms_per_day:.3f} FA/day)")
            figures["methods"][m][str(b)] = {"recall": rep.recall, "caught": rep.caught,
                                             "false_alarms_per_day": rep.false_alarms_per_day}
        print(f"| {m} | " + " | ".join(cells) + " |")
    print()
    print("| budget (false alarms/day) | realised false alarms/day at the self-calibrated thresholds | recall |")
    print("|---|---|---|")
    for b in BUDGETS:
        margins = {n: per_budget[b][n][1] for n in data}
        rep = evaluate_windows(scored(margins), 0.0, COOLDOWN_S)
        figures["self_calibrated"][str(b)] = {"false_alarms_per_day": rep.false_alarms_per_day,
                                              "false_alarms": rep.false_alarms, "recall": rep.recall,
                                              "caught": rep.caught}
        print(f"| {b:g} | {rep.false_alarms_per_day:.3f} ({rep.false_alarms} in {rep.days:.1f} days) | "
              f"{rep.recall:.2f} ({rep.caught}/{rep.windows}) |")
    print(f"\n(whole run {time.monotonic() - t0:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
