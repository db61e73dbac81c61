"""Event-level evaluation: labels, alarm events, recall at a false-alarm budget, lead times, calibration.

An *alarm event* is when the agent would send its checkpoint-now advisory: the score reaching the threshold
at least ``cooldown_s`` after the node's previous event, and again every ``cooldown_s`` while the score stays
at or above it (see :func:`alarm_events`). With ``cooldown_s`` below ``H - L`` a persistent alarm therefore
lands an event in every warning window, and a persistent false alarm counts once per ``cooldown_s``. Each alarm
event at time ``t`` is classed by the node's next failure ``f`` (the first failure at or after ``t``):

- **hit**: ``L <= f - t <= H`` (early enough to checkpoint, late enough to be about this failure);
- **late**: ``0 <= f - t < L`` (too late to checkpoint; neither hit nor false alarm);
- **early**: ``H < f - t <= early_s`` (the node did fail, but too early to count as a hit);
- **false**: anything else. The false-alarm rate is false alarms per 100 observed node-days.

A failure is *caught* when at least one hit precedes it; its lead time is ``f - t`` of the first such hit.
Event recall = caught / failures (failures of nodes with no samples in the covered range are not counted).
Precision = hits / all alarm events. Never point-adjusted, never on balanced samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trainguard.predictor.errors import InsufficientDataError


@dataclass(frozen=True)
class EvalConfig:
    """Parameters of the event-level evaluation.

    Attributes:
        horizon_s: H, the earliest useful warning before a failure, seconds (default 1800).
        min_lead_s: L, the checkpoint time: a warning later than this is useless, seconds (default 120).
        cooldown_s: least time between two alarm events of one node, and their repeat interval while the
            score stays above threshold, seconds (default 1200; keep it below ``H - L``).
        early_s: an alarm at most this long before a failure is "early", not false, seconds (default 14400).
        budget_per_100_node_days: false-alarm budget the threshold is calibrated to (default 1.0).
    """

    horizon_s: float = 1800.0
    min_lead_s: float = 120.0
    cooldown_s: float = 1200.0
    early_s: float = 14400.0
    budget_per_100_node_days: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def labels_for(
    ts: np.ndarray, node: np.ndarray, failures: dict[str, np.ndarray], cfg: EvalConfig, exclude_early: bool = False,
) -> np.ndarray:
    """Per-row training labels for "hard failure within the horizon".

    Args:
        ts: row timestamps, seconds.
        node: row nodes.
        failures: node -> sorted failure times, seconds.
        cfg: horizon and checkpoint time.
        exclude_early: also mark rows ``H..early_s`` before a failure as -1 (a precursor's early part is
            neither a clean negative nor a positive).

    Returns:
        int8 array: 1 if a failure of the row's node comes ``L..H`` seconds later, -1 if one comes less than
        ``L`` seconds later (ambiguous: excluded from training), else 0.
    """
    y = np.zeros(len(ts), dtype=np.int8)
    node_s = node.astype(str)
    for n, f in failures.items():
        if len(f) == 0:
            continue
        rows = np.flatnonzero(node_s == n)
        t = ts[rows]
        nxt = np.searchsorted(f, t, side="left")
        has = nxt < len(f)
        dt = np.full(len(t), np.inf)
        dt[has] = f[nxt[has]] - t[has]
        y[rows[(dt >= cfg.min_lead_s) & (dt <= cfg.horizon_s)]] = 1
        y[rows[dt < cfg.min_lead_s]] = -1
        if exclude_early:
            y[rows[(dt > cfg.horizon_s) & (dt <= cfg.early_s)]] = -1
    return y


def alarm_events(ts: np.ndarray, score: np.ndarray, threshold: float, cooldown_s: float) -> np.ndarray:
    """Alarm event times of one node: when the agent would (re)send its advisory.

    An event fires when the score first reaches the threshold, at least ``cooldown_s`` after the previous
    event, and again every ``cooldown_s`` while the score stays at or above it (the agent repeats its
    checkpoint-now advisory while the risk persists, like an alert manager's repeat interval).

    Args:
        ts: timestamps, seconds, increasing.
        score: scores at those times.
        threshold: alarm when ``score >= threshold``.
        cooldown_s: least time between two events, seconds (also the repeat interval).

    Returns:
        Event times, seconds.
    """
    above = score >= threshold
    if not above.any():
        return np.zeros(0)
    starts = np.flatnonzero(above & ~np.r_[False, above[:-1]])
    ends = np.flatnonzero(above & ~np.r_[above[1:], False]) + 1  # exclusive
    keep: list[float] = []
    last = -np.inf
    for s, e in zip(starts, ends):
        t_run = ts[s:e]
        nxt = max(float(t_run[0]), last + cooldown_s)
        first = 0  # the next event is a later row than the last one: with a cooldown of 0 (an event on every row
        # above the threshold) the search found the last event's own row again, forever, filling the memory
        while True:
            i = max(int(np.searchsorted(t_run, nxt, side="left")), first)
            if i >= len(t_run):
                break
            last = float(t_run[i])
            keep.append(last)
            nxt, first = last + cooldown_s, i + 1
    return np.array(keep)


@dataclass
class EventReport:
    """Event-level figures of one scorer on one data set.

    Attributes:
        threshold: alarm threshold used.
        failures: failures counted (of nodes with samples, after the first sample + H).
        caught: failures with a hit.
        hits, late, early, false_alarms: alarm events by class.
        node_days: observed node-days.
        lead_times_s: lead time of each caught failure, seconds.
        caught_mask: per counted failure (in ``failure_index`` order), whether it was caught.
        failure_index: (node, time) of each counted failure.
    """

    threshold: float
    failures: int
    caught: int
    hits: int
    late: int
    early: int
    false_alarms: int
    node_days: float
    lead_times_s: list[float] = field(default_factory=list)
    caught_mask: list[bool] = field(default_factory=list)
    failure_index: list[tuple[str, float]] = field(default_factory=list)

    @property
    def recall(self) -> float:
        """Caught / failures (NaN when there is no failure)."""
        return self.caught / self.failures if self.failures else float("nan")

    @property
    def precision(self) -> float:
        """Hits / all alarm events (NaN when there is no alarm)."""
        total = self.hits + self.late + self.early + self.false_alarms
        return self.hits / total if total else float("nan")

    @property
    def false_alarms_per_100_node_days(self) -> float:
        """False alarms per 100 observed node-days."""
        return 100.0 * self.false_alarms / self.node_days if self.node_days else float("nan")

    def lead_percentile(self, q: float) -> float:
        """Percentile ``q`` (0-100) of lead times, seconds (NaN when nothing was caught)."""
        return float(np.percentile(self.lead_times_s, q)) if self.lead_times_s else float("nan")

    def recall_of(self, keys: set[tuple[str, float]]) -> tuple[int, int]:
        """(caught, total) restricted to the failures in ``keys`` ((node, time) pairs)."""
        sel = [c for k, c in zip(self.failure_index, self.caught_mask) if k in keys]
        return sum(sel), len(sel)

    def summary(self) -> dict[str, Any]:
        """JSON-ready headline figures."""
        return {
            "threshold": self.threshold, "failures": self.failures, "caught": self.caught,
            "recall": self.recall, "precision": self.precision, "hits": self.hits, "late": self.late,
            "early": self.early, "false_alarms": self.false_alarms, "node_days": self.node_days,
            "false_alarms_per_100_node_days": self.false_alarms_per_100_node_days,
            "lead_median_s": self.lead_percentile(50), "lead_p10_s": self.lead_percentile(10),
        }


def _node_groups(node: np.ndarray) -> list[tuple[str, np.ndarray]]:
    keys = node.astype(str)
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]]) if len(ks) else np.zeros(0, dtype=int)
    ends = np.r_[starts[1:], len(ks)]
    return [(str(ks[s]), order[s:e]) for s, e in zip(starts, ends)]


def node_days(ts: np.ndarray, node: np.ndarray, interval_s: float) -> float:
    """Observed node-days: per node, the sum of sample intervals (a gap longer than 10 intervals is not counted).

    Args:
        ts: row timestamps, seconds.
        node: row nodes.
        interval_s: nominal sampling interval, seconds.

    Returns:
        Node-days.
    """
    total = 0.0
    for _, rows in _node_groups(node):
        t = np.sort(ts[rows])
        d = np.diff(t)
        total += float(d[d <= 10 * interval_s].sum()) + interval_s
    return total / 86400.0


def evaluate_events(
    ts: np.ndarray, node: np.ndarray, score: np.ndarray, threshold: float, failures: dict[str, np.ndarray],
    cfg: EvalConfig, interval_s: float, stop_after_false: int | None = None,
) -> EventReport:
    """Scores alarm events against failures (see the module docstring for the classes).

    Args:
        ts: row timestamps, seconds.
        node: row nodes.
        score: row scores.
        threshold: alarm threshold.
        failures: node -> sorted failure times, seconds.
        cfg: evaluation parameters.
        interval_s: nominal sampling interval, seconds (for node-days).
        stop_after_false: stop early once this many false alarms are seen (calibration speed-up); the
            report is then partial.

    Returns:
        The report.
    """
    rep = EventReport(threshold, 0, 0, 0, 0, 0, 0, node_days(ts, node, interval_s))
    for n, rows in _node_groups(node):
        order = rows[np.argsort(ts[rows], kind="stable")]
        t, s = ts[order], score[order]
        ev = alarm_events(t, s, threshold, cfg.cooldown_s)
        f = failures.get(n, np.zeros(0))
        # failures count when the node was observed during their whole warning window
        counted = f[(f - cfg.horizon_s >= t[0]) & (f - cfg.min_lead_s <= t[-1] + interval_s)] if len(t) else f[:0]
        if len(ev):
            nxt = np.searchsorted(f, ev, side="left")
            dt = np.where(nxt < len(f), f[np.minimum(nxt, len(f) - 1)] - ev if len(f) else np.inf, np.inf)
            hit = (dt >= cfg.min_lead_s) & (dt <= cfg.horizon_s)
            late = dt < cfg.min_lead_s
            early = (dt > cfg.horizon_s) & (dt <= cfg.early_s)
            rep.hits += int(hit.sum())
            rep.late += int(late.sum())
            rep.early += int(early.sum())
            rep.false_alarms += int((~(hit | late | early)).sum())
        else:
            hit = np.zeros(0, dtype=bool)
            dt = np.zeros(0)
        for fi in counted:
            lo, hi = fi - cfg.horizon_s, fi - cfg.min_lead_s
            in_win = (ev >= lo) & (ev <= hi) if len(ev) else np.zeros(0, dtype=bool)
            caught = bool(in_win.any())
            rep.failures += 1
            rep.caught += int(caught)
            rep.caught_mask.append(caught)
            rep.failure_index.append((n, float(fi)))
            if caught:
                rep.lead_times_s.append(float(fi - ev[in_win].min()))
        if stop_after_false is not None and rep.false_alarms > stop_after_false:
            break
    return rep


def uncounted_events(
    ev_node: np.ndarray, ev_ts: np.ndarray, ts: np.ndarray, node: np.ndarray, cfg: EvalConfig, interval_s: float,
) -> dict[str, list[tuple[str, float]]]:
    """The events :func:`evaluate_events` does not count as failures, by reason (the same rule as there).

    Args:
        ev_node, ev_ts: events.
        ts, node: the scored rows.
        cfg: evaluation parameters (``horizon_s``).
        interval_s: nominal sampling interval, seconds.

    Returns:
        ``node_not_in_metrics``, ``outside_node_data`` (before the node's first row or after its last) and
        ``warning_window_not_observed`` (the node's data starts less than H before the event): (node, time) of
        each such event.
    """
    span = {n: (float(ts[rows].min()), float(ts[rows].max())) for n, rows in _node_groups(node)}
    out: dict[str, list[tuple[str, float]]] = {
        "node_not_in_metrics": [], "outside_node_data": [], "warning_window_not_observed": []}
    for n, f in zip(ev_node.astype(str).tolist(), ev_ts.astype(float).tolist()):
        if n not in span:
            out["node_not_in_metrics"].append((n, f))
        elif f < span[n][0] or f - cfg.min_lead_s > span[n][1] + interval_s:
            out["outside_node_data"].append((n, f))
        elif f - cfg.horizon_s < span[n][0]:
            out["warning_window_not_observed"].append((n, f))
    return out


def calibrate_threshold(
    ts: np.ndarray, node: np.ndarray, score: np.ndarray, failures: dict[str, np.ndarray], cfg: EvalConfig,
    interval_s: float,
) -> tuple[float, EventReport]:
    """Lowest threshold whose false alarms stay within the budget on the given (calibration) data.

    Binary search over the distinct high scores (false alarms fall as the threshold rises, up to the
    cooldown's small non-monotonicity, so the result is checked once more at the end).

    Args:
        ts, node, score: calibration rows.
        failures: node -> sorted failure times (rows near them are not false alarms).
        cfg: evaluation parameters (``budget_per_100_node_days``).
        interval_s: nominal sampling interval, seconds.

    Returns:
        ``(threshold, report at that threshold)``.

    Raises:
        InsufficientDataError: no rows.
    """
    if len(ts) == 0:
        raise InsufficientDataError("no calibration rows; give more history (at least a few node-days)")
    nd = node_days(ts, node, interval_s)
    allowed = int(np.floor(cfg.budget_per_100_node_days * nd / 100.0 + 1e-9))
    finite = score[np.isfinite(score)]
    # only the top scores can be thresholds: a threshold below them alarms far too often anyway
    k = min(len(finite), max(2000, int(0.02 * len(finite))))
    cand = np.unique(np.partition(finite, len(finite) - k)[len(finite) - k :])
    top = float(np.nextafter(finite.max(), np.inf)) if len(finite) else 1.0

    def ok(thr: float) -> bool:
        r = evaluate_events(ts, node, score, thr, failures, cfg, interval_s, stop_after_false=allowed)
        return r.false_alarms <= allowed

    if len(cand) == 0:  # no score known in the calibration period (baselines still warming up there)
        return top, evaluate_events(ts, node, score, top, failures, cfg, interval_s)
    lo, hi = 0, len(cand)  # invariant: cand[hi] (or top) is ok
    if ok(float(cand[0])):
        hi = 0
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(float(cand[mid])):
                hi = mid
            else:
                lo = mid
    thr = float(cand[hi]) if hi < len(cand) else top
    while hi < len(cand) and not ok(thr):
        hi += 1
        thr = float(cand[hi]) if hi < len(cand) else top
    return thr, evaluate_events(ts, node, score, thr, failures, cfg, interval_s)


def failures_by_node(node: np.ndarray, ts: np.ndarray) -> dict[str, np.ndarray]:
    """Groups event times by node, sorted.

    Args:
        node: event nodes.
        ts: event times, seconds.

    Returns:
        node -> sorted times.
    """
    out: dict[str, list[float]] = {}
    for n, t in zip(node.astype(str), ts):
        out.setdefault(n, []).append(float(t))
    return {n: np.sort(np.array(v)) for n, v in out.items()}


@dataclass
class WindowReport:
    """Alarm events against labelled incident windows (data sets labelled with windows, not failure times).

    Attributes:
        windows: windows counted.
        caught: windows with at least one alarm event inside.
        false_alarms: alarm events inside no window.
        days: observed days.
    """

    windows: int
    caught: int
    false_alarms: int
    days: float

    @property
    def recall(self) -> float:
        """Caught / windows (NaN without windows)."""
        return self.caught / self.windows if self.windows else float("nan")

    @property
    def false_alarms_per_day(self) -> float:
        """False alarms per observed day."""
        return self.false_alarms / self.days if self.days else float("nan")


def evaluate_windows(
    series: list[tuple[np.ndarray, np.ndarray, list[tuple[float, float]]]], threshold: float, cooldown_s: float,
) -> WindowReport:
    """Event recall inside labelled windows and false alarms outside them, pooled over series.

    An alarm event is as in :func:`alarm_events`. A window is caught when an event falls inside it (alarms
    before or after a window do not count for it); an event outside every window is a false alarm.

    Args:
        series: per series ``(ts, score, windows)``, windows as ``(start, end)`` seconds.
        threshold: alarm when ``score >= threshold``.
        cooldown_s: least time between two events of a series.

    Returns:
        The pooled report.
    """
    rep = WindowReport(0, 0, 0, 0.0)
    for ts, score, windows in series:
        ev = alarm_events(ts, score, threshold, cooldown_s)
        inside = np.zeros(len(ev), dtype=bool)
        for lo, hi in windows:
            hit = (ev >= lo) & (ev <= hi)
            rep.windows += 1
            rep.caught += int(hit.any())
            inside |= hit
        rep.false_alarms += int((~inside).sum())
        if len(ts) > 1:
            d = np.diff(ts)
            step = float(np.median(d))
            rep.days += float(d[d <= 10 * step].sum() + step) / 86400.0
    return rep


def threshold_at_budget(
    series: list[tuple[np.ndarray, np.ndarray, list[tuple[float, float]]]], budget_per_day: float, cooldown_s: float,
) -> tuple[float, WindowReport]:
    """Lowest single threshold whose pooled false alarms per day stay within a budget (hindsight: the best
    any fixed threshold could do on this data; used to compare scorers at equal false-alarm rates).

    Returns:
        ``(threshold, report at it)``.
    """
    scores = np.concatenate([s[np.isfinite(s)] for _, s, _ in series])
    days = evaluate_windows(series, np.inf, cooldown_s).days
    allowed = int(np.floor(budget_per_day * days + 1e-9))
    k = min(len(scores), 5000)
    cand = np.unique(np.partition(scores, len(scores) - k)[len(scores) - k:]) if len(scores) else np.zeros(0)
    lo, hi = 0, len(cand)  # cand[hi] (or +inf past the end) keeps the budget
    while lo < hi:
        mid = (lo + hi) // 2
        if evaluate_windows(series, float(cand[mid]), cooldown_s).false_alarms <= allowed:
            hi = mid
        else:
            lo = mid + 1
    # the cooldown makes false alarms not quite monotone in the threshold: step up until the budget holds
    while hi < len(cand) and evaluate_windows(series, float(cand[hi]), cooldown_s).false_alarms > allowed:
        hi += 1
    thr = float(cand[hi]) if hi < len(cand) else float("inf")
    return thr, evaluate_windows(series, thr, cooldown_s)
