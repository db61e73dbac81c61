"""Windowed features of a node's metric stream, computed identically offline (whole series) and online (tail).

Per counter (cumulative) metric, over a short and a long window ending at the current sample:
``rate_s`` and ``rate_l`` (increase per minute; a drop is read as a counter reset) and ``accel``
(``rate_s - rate_l``: a rate that is rising now). Per gauge metric: ``level`` (last value), ``drift`` (short
mean minus long mean) and ``slope_l`` (change per minute between the two halves of the long window). Per
metric, ``peer_z``: the node's robust z-score against the other nodes of its job at the same interval (on
``rate_s`` for counters, ``level`` for gauges; missing when fewer than :data:`MIN_PEERS` nodes report). And
telemetry health: ``gap_s`` (seconds since the previous sample), ``coverage_l`` (samples present over samples
expected in the long window) and ``nan_frac_l`` (fraction of missing cells in the long window). These three
are missing-data features: a gap is reported as a gap, and the unsupervised scorers leave them out of the
anomaly score (a long gap must not pin the score at its maximum).

Metrics are the catalog's or any numeric column (:func:`~.catalog.classify_columns`), each a counter or a
gauge. Window sizes default to values derived from the sampling interval and the history length
(:meth:`FeatureConfig.for_data`: minutes to a day), not fixed minutes.

Missing cells are forward-filled per metric (a value never seen stays NaN, which the models treat as
missing). Windows look back in time (seconds), not in rows, so gaps shorten them instead of stretching them.
The online path keeps, per node, only the samples of the last long window (plus the one before), and calls
the same :func:`node_features` on that tail, so the two paths agree to floating-point rounding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from trainguard.predictor.catalog import BY_NAME, MetricKind, metric_family
from trainguard.predictor.errors import DataFormatError, FeatureMismatchError
from trainguard.predictor.long_baseline import LongBaselineConfig, long_baseline_z
from trainguard.predictor.table import MetricTable

#: Fewest reporting nodes at an interval for peer z-scores to be computed (else they are missing).
MIN_PEERS = 3
#: Peer z-scores are clipped to +-this, so one silent peer cannot produce an unbounded feature.
PEER_Z_CLIP = 20.0
#: Smallest peer scale (same unit as the feature), so identical peers do not divide by zero.
PEER_SCALE_FLOOR = 1e-3

#: Window of the robust long baseline of models trained with derived windows (a week: the incidents of a
#: day or two stay a small share of it; the daily profile sees seven days per hour slot).
ROBUST_WINDOW_S = 7 * 86400.0

#: The robust baseline's recent window for models trained with derived windows: a day (see
#: :class:`FeatureConfig`; at hourly sampling, the fewest rows a scale is taken from).
RECENT_WINDOW_S = 86400.0

TELEMETRY_FEATURES = ("telemetry.gap_s", "telemetry.coverage_l", "telemetry.nan_frac_l")


@dataclass(frozen=True)
class FeatureConfig:
    """Window sizes of the features.

    Attributes:
        interval_s: nominal sampling interval, seconds (default 5). Used for coverage and peer bucketing.
        short_window_s: short window, seconds (default 300).
        long_window_s: long window, seconds (default 1800); the online runtime keeps this much history.
        peer: compute peer z-scores (default True).
        self_window_s: time constant of the node's own exponentially weighted baseline, seconds; each
            counter rate and gauge level (and their short-window changes) also gets a ``_z`` feature: its
            deviation from that baseline in units of the node's own typical deviation (0: off, the default of
            models trained before it existed). Scale-free, so it transfers between nodes and fleets.
        robust_window_s: window of the node's robust long baseline with its daily profile, seconds
            (:mod:`.long_baseline`): the same columns also get an ``_rz`` feature, their deviation from it,
            which incidents do not inflate and a daily pattern does not trigger (0: off, the default of models
            trained before it existed).
        robust_recent_window_s: the robust baseline's second, recent window, seconds (a day for derived
            windows): a deviation counts as far as both the week and the last day show it, so a lasting level
            shift stops scoring within hours (0: off, the default of models trained before it existed).
    """

    interval_s: float = 5.0
    short_window_s: float = 300.0
    long_window_s: float = 1800.0
    peer: bool = True
    self_window_s: float = 0.0
    robust_window_s: float = 0.0
    robust_recent_window_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.interval_s <= self.short_window_s < self.long_window_s):
            raise DataFormatError(
                f"feature windows must satisfy 0 < --interval <= --short-window < --long-window; got "
                f"{self.interval_s:g}, {self.short_window_s:g}, {self.long_window_s:g} s: pass --short-window "
                f"{max(self.interval_s, 300.0) * 5:g} --long-window {max(self.interval_s, 300.0) * 30:g} or leave "
                "both out to derive them from the interval"
            )
        if min(self.self_window_s, self.robust_window_s, self.robust_recent_window_s) < 0 or (
                0 < self.robust_window_s <= self.robust_recent_window_s):
            raise DataFormatError(
                f"baseline windows must satisfy self_window_s >= 0 and 0 <= robust_recent_window_s < "
                f"robust_window_s (0: off); got {self.self_window_s:g}, {self.robust_recent_window_s:g}, "
                f"{self.robust_window_s:g} s: retrain with derived windows or fix the model file's feature_spec"
            )

    @classmethod
    def for_data(
        cls, interval_s: float, history_s: float, peer: bool = True, short_window_s: float | None = None,
        long_window_s: float | None = None,
    ) -> "FeatureConfig":
        """Windows derived from the sampling interval and the history length (each may be given instead).

        The short window spans at least 5 samples and 5 minutes; the long one 6 short windows and at least
        30 minutes, up to a day, and at most a quarter of the history (so the fit sees many long windows).

        Args:
            interval_s: sampling interval, seconds.
            history_s: time span of the history, seconds.
            peer: compute peer z-scores.
            short_window_s: short window, seconds (None: derived).
            long_window_s: long window, seconds (None: derived).

        Raises:
            DataFormatError: the windows do not fit the interval (the message names the flags).
        """
        for flag, given in (("--short-window", short_window_s), ("--long-window", long_window_s)):
            # the online runtime keeps a buffer of the long window per node: a window of 1e12 s trained, then
            # every score asked for tens of GiB (a MemoryError traceback); no window longer than the history
            # can be fitted anyway
            if given is not None and history_s > 0 and given > history_s:
                raise DataFormatError(
                    f"{flag} {given:g} s is longer than the data's {history_s:g} s; give at most a quarter of it "
                    f"({history_s / 4:g}) or leave the window flags out to derive them")
        short = short_window_s if short_window_s is not None else max(5.0 * interval_s, 300.0)
        if long_window_s is not None:
            long = long_window_s
        else:
            long = min(max(6.0 * short, 1800.0), 86400.0)
            if history_s > 0:
                long = max(min(long, history_s / 4.0), 2.0 * short)
        self_w = min(86400.0, max(2.0 * long, history_s / 8.0))
        return cls(interval_s=interval_s, short_window_s=short, long_window_s=long, peer=peer, self_window_s=self_w,
                   robust_window_s=max(ROBUST_WINDOW_S, 2.0 * long),
                   robust_recent_window_s=RECENT_WINDOW_S)

    @property
    def self_min_rows(self) -> int:
        """Rows a node's own baseline needs before its ``_z`` features are reported (else missing)."""
        return int(max(10, round(self.short_window_s / self.interval_s), round(self.self_window_s / self.interval_s / 3)))

    @property
    def long_baseline(self) -> "LongBaselineConfig | None":
        """Parameters of the robust long baseline (None when off)."""
        if self.robust_window_s <= 0:
            return None
        return LongBaselineConfig(window_s=self.robust_window_s, interval_s=self.interval_s,
                                  min_span_s=max(self.long_window_s, 6 * 3600.0), paired=True,
                                  recent_window_s=self.robust_recent_window_s)

    @property
    def self_alpha(self) -> float:
        """Weight of a new sample in the node's own baseline (one interval of ``self_window_s``)."""
        return float(1.0 - np.exp(-self.interval_s / self.self_window_s)) if self.self_window_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass(frozen=True)
class FeatureSpec:
    """Which metrics feed the model and how: the exact feature list is derived from it.

    Attributes:
        metrics: metric names.
        config: window sizes.
        kinds: ``"counter"`` or ``"gauge"`` per metric; empty: the catalog's kinds (every metric must then
            be a catalog name).
    """

    metrics: tuple[str, ...]
    config: FeatureConfig = field(default_factory=FeatureConfig)
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.metrics:
            raise FeatureMismatchError(
                "no metric to compute features from; give numeric metric columns (`trainguard predictor metrics` "
                "lists the catalog)"
            )
        if not self.kinds:
            unknown = [m for m in self.metrics if m not in BY_NAME]
            if unknown:
                raise FeatureMismatchError(
                    f"metrics {unknown} are not in the predictor's catalog; declare each a counter or a gauge"
                )
            object.__setattr__(self, "kinds", tuple(BY_NAME[m].kind.value for m in self.metrics))
        if len(self.kinds) != len(self.metrics) or any(k not in ("counter", "gauge") for k in self.kinds):
            raise FeatureMismatchError(f"feature spec kinds {self.kinds!r} must be 'counter' or 'gauge', one per metric")

    @cached_property
    def counters(self) -> list[int]:
        """Indexes (into ``metrics``) of counter metrics."""
        return [i for i, k in enumerate(self.kinds) if k == MetricKind.COUNTER.value]

    @cached_property
    def gauges(self) -> list[int]:
        """Indexes (into ``metrics``) of gauge metrics."""
        return [i for i, k in enumerate(self.kinds) if k == MetricKind.GAUGE.value]

    @cached_property
    def window_feature_names(self) -> list[str]:
        """Names of the windowed per-node features, in :func:`node_features` column order."""
        names: list[str] = []
        for i in self.counters:
            m = self.metrics[i]
            names += [f"{m}.rate_s", f"{m}.rate_l", f"{m}.accel"]
        for i in self.gauges:
            m = self.metrics[i]
            names += [f"{m}.level", f"{m}.drift", f"{m}.slope_l"]
        return names + list(TELEMETRY_FEATURES)

    @cached_property
    def self_source_columns(self) -> list[int]:
        """Window features that get a ``_z`` against the node's own baseline (rate_s/accel, level/drift)."""
        if self.config.self_window_s <= 0:
            return []
        n_c = len(self.counters)
        return ([c for k in range(n_c) for c in (3 * k, 3 * k + 2)]
                + [3 * n_c + c for k in range(len(self.gauges)) for c in (3 * k, 3 * k + 1)])

    @cached_property
    def node_feature_names(self) -> list[str]:
        """Names of all per-node features: windowed ones, then the ``_z`` against the node's own baseline,
        then the ``_rz`` against its robust long baseline (when on)."""
        w = self.window_feature_names
        names = w + [w[c] + "_z" for c in self.self_source_columns]
        if self.config.robust_window_s > 0:
            names += [w[c] + "_rz" for c in self.self_source_columns]
        return names

    @cached_property
    def peer_base_columns(self) -> list[int]:
        """Columns of the node features that get a peer z-score (``rate_s`` of counters, ``level`` of gauges)."""
        n_c = len(self.counters)
        return [3 * k for k in range(n_c)] + [3 * n_c + 3 * k for k in range(len(self.gauges))]

    @cached_property
    def feature_names(self) -> list[str]:
        """All feature names, in model column order."""
        names = self.node_feature_names
        if self.config.peer:
            names = names + [names[c].rsplit(".", 1)[0] + ".peer_z" for c in self.peer_base_columns]
        return names

    @cached_property
    def families(self) -> list[tuple[str, list[int]]]:
        """Metric families (:func:`~.catalog.metric_family`) and the columns of each family's features, in
        order of first appearance (telemetry health features belong to none)."""
        fam_of = {m: metric_family(m) for m in self.metrics}
        out: dict[str, list[int]] = {}
        for i, name in enumerate(self.feature_names):
            metric = name.rsplit(".", 1)[0]
            if metric in fam_of:
                out.setdefault(fam_of[metric], []).append(i)
        return list(out.items())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"metrics": list(self.metrics), "config": self.config.to_dict(), "kinds": list(self.kinds)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FeatureSpec":
        """Inverse of :meth:`to_dict` (files without ``kinds`` take the catalog's)."""
        return cls(tuple(d["metrics"]), FeatureConfig(**d["config"]), tuple(d.get("kinds", ())))


def forward_fill(values: np.ndarray) -> np.ndarray:
    """Forward-fills NaNs down each column (leading NaNs stay NaN).

    Args:
        values: shape (n, m).

    Returns:
        A filled copy.
    """
    n = values.shape[0]
    if n == 0:
        return values.copy()
    valid = ~np.isnan(values)
    idx = np.where(valid, np.arange(n)[:, None], 0)
    np.maximum.accumulate(idx, axis=0, out=idx)
    return np.take_along_axis(values, idx, axis=0)


#: A counter whose cell has been empty this long reads as no increase (its rate is not carried longer); the agent's
#: history keeps this much beyond the long window while a cell is empty, so online and offline scores agree. An
#: hour: a day kept 48x the rows per node (5x the CPU per sample) while an exporter's series was gone.
STALE_COUNTER_S = 3600.0


def _counter_rates(prefix: np.ndarray, ts: np.ndarray, seen_t: np.ndarray, out_rows: np.ndarray, window_s: float,
                   interval_s: float) -> np.ndarray:
    """Per-minute increase of each counter over the ``window_s`` before its last reading at each of ``out_rows``.

    A cell left empty is filled forward: its value is the last reading's, as of that reading's time (``seen_t``),
    not as of its row. Timed by rows, the first reading after hours of empty cells put their whole increase
    into the short window's few minutes, a burst (and the node's own threshold, learning it, stuck at its
    maximum: a node with no learned-tier alarm for good), and the rows of the outage read "no increase", a
    fall to 0. Timed by readings, the rows of the outage repeat the rate as last read (for up to
    :data:`STALE_COUNTER_S`), and the first reading after spreads the increase over the time since the reading
    before, as after missing rows; a later window reaching into the outage counts that part at the outage's mean
    rate (the counter taken as growing evenly between the readings around it). A window holding no reading before
    its end (after a gap longer than it) starts at the reading before.

    Args:
        prefix: prefix sums of the counters' increments, shape (n + 1, k).
        ts: every row's time, shape (n,).
        seen_t: time of the reading each cell's value comes from (NaN: none yet), shape (n, k).
        out_rows: the rows to compute rates for.
        window_s: the window, seconds.
        interval_s: the sampling interval (the least time a rate is taken over).

    Returns:
        Rates per minute, shape (len(out_rows), k).
    """
    n, k = seen_t.shape
    if seen_t is ts or not (seen_t != ts[:, None]).any():
        # Every cell read in its own row (the usual case): the rules above reduce to windows by row time. The
        # general form below costs ~0.2 ms more per online sample (its index arithmetic over the whole history).
        t1 = ts[out_rows]
        j1 = np.searchsorted(ts, t1 - window_s, side="left")
        s1 = np.where(j1 >= out_rows, np.maximum(out_rows - 1, 0), j1)
        el = np.maximum(t1 - ts[s1], interval_s)[:, None]
        return (prefix[out_rows + 1] - prefix[s1 + 1]) / el * 60.0
    cols = np.arange(k)[None, :]
    t = ts[out_rows][:, None]
    t_end = seen_t[out_rows]
    t_end = np.where(np.isnan(t_end), t, t_end)
    end = np.searchsorted(ts, t_end.ravel(), side="right").reshape(t_end.shape) - 1  # the last reading's row
    end = np.clip(end, 0, None)
    j = np.searchsorted(ts, (t_end - window_s).ravel(), side="left").reshape(t_end.shape)
    # A window starting inside an outage of the cells starts at the first reading after it, when that is before
    # its end: timed from the reading before the outage, a burst right after one was spread over the whole
    # outage (10-20x diluted for a window's length; found by a review). Only the first reading after the outage
    # itself, with no reading before it in its window, takes the reading before, as after missing rows.
    read_row = np.where(seen_t == ts[:, None], np.arange(n)[:, None], n)
    next_read = np.minimum.accumulate(read_row[::-1], axis=0)[::-1]
    j_read = next_read[np.minimum(j, n - 1), cols]
    # (a counter first read after the node's first rows has no outage behind it: its window starts at its first
    # reading, over the time since)
    moved = (j_read < end) & (j_read != j) & ~np.isnan(seen_t[np.maximum(j_read - 1, 0), cols])
    start = np.where(j_read < end, j_read, np.where(j >= end, np.maximum(end - 1, 0), j))
    t_start = seen_t[start, cols]
    t_start = np.where(np.isnan(t_start), ts[start], t_start)
    elapsed = np.maximum(t_end - t_start, interval_s)
    rate = (prefix[end + 1, cols] - prefix[start + 1, cols]) / elapsed * 60.0
    # A moved window is still a window: the increase over its whole length, the part of it inside the outage at
    # the outage's mean rate (the counter taken as growing evenly between the readings around the outage), as the
    # same rows read without the outage before them. Over the few minutes since the first reading alone, a
    # count of a few errors read as a burst (a fleet's supervised model alarmed 5x as often after dropouts);
    # with the outage's part left out, a steady counter read as falling.
    r = start
    before = np.maximum(r - 1, 0)
    t_prev = seen_t[before, cols]
    gap_inc = prefix[r + 1, cols] - prefix[r, cols]  # the first reading's increment: the whole outage's increase
    gap_s = np.where(np.isnan(t_prev), np.inf, ts[r] - t_prev)
    overlap = np.clip(ts[r] - (t_end - window_s), 0.0, gap_s)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(gap_s > 0, overlap / gap_s, 0.0)
    whole = (prefix[end + 1, cols] - prefix[r + 1, cols] + gap_inc * np.nan_to_num(share)) / window_s * 60.0
    rate = np.where(moved, whole, rate)
    return np.where(t - t_end > STALE_COUNTER_S, 0.0, rate)


def seen_times(ts: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Time of the reading each cell's forward-filled value comes from (NaN before a column's first reading).

    Args:
        ts: row times, shape (n,).
        raw: samples with NaN for cells not read, shape (n, m).

    Returns:
        Shape (n, m).
    """
    return forward_fill(np.where(np.isnan(raw), np.nan, ts[:, None] + np.zeros_like(raw)))


def _window_sum(prefix: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Sums rows start..stop-1 given prefix sums with a leading zero row."""
    return prefix[stop] - prefix[start]


def node_features(
    spec: FeatureSpec, ts: np.ndarray, filled: np.ndarray, nan_frac: np.ndarray, t_first: float,
    rows: slice | None = None, seen_t: np.ndarray | None = None,
) -> np.ndarray:
    """Per-node features of a (forward-filled) series.

    Args:
        spec: feature spec; ``filled`` columns are ``spec.metrics`` in order.
        ts: timestamps, seconds, strictly increasing, shape (n,).
        filled: forward-filled samples, shape (n, len(spec.metrics)).
        nan_frac: fraction of cells missing in each raw sample, shape (n,).
        t_first: time of the node's first sample ever, seconds (for coverage at the start of a history).
        rows: which rows to return features for (default all); earlier rows still serve as history.
        seen_t: time of the reading each cell of ``filled`` comes from (:func:`seen_times`); default each
            row's own time (no cell filled).

    Returns:
        float64 array, shape (rows, len(spec.window_feature_names)) (the ``_z`` features come from
        :func:`self_z` on these).
    """
    cfg = spec.config
    n = len(ts)
    out_rows = np.arange(n)[rows] if rows is not None else np.arange(n)
    t = ts[out_rows]
    j_s = np.searchsorted(ts, t - cfg.short_window_s, side="left")
    j_l = np.searchsorted(ts, t - cfg.long_window_s, side="left")
    j_h = np.searchsorted(ts, t - cfg.long_window_s / 2.0, side="left")
    i1 = out_rows + 1
    cols: list[np.ndarray] = []
    ci = spec.counters
    if ci:
        c = filled[:, ci]
        d = np.diff(c, axis=0, prepend=c[:1])
        # A drop to at most half the previous value is a reset: the counter restarted from zero and counted c
        # since. A smaller drop is part of a sum restarting (one GPU's volatile ECC count of a node's eight):
        # counted as the whole remaining value it read as a burst of errors and alarmed; its increase is
        # unknown, taken as none.
        inc = np.where(d >= 0, d, np.where(c <= -d, c, 0.0))
        inc = np.nan_to_num(inc, nan=0.0)
        # prefix[k] = sum of increments of rows 1..k-1 (row 0's increment is unknown and never used)
        prefix = np.vstack([np.zeros((1, len(ci))), np.cumsum(inc, axis=0)])
        seen = np.repeat(ts[:, None], len(ci), axis=1) if seen_t is None else seen_t[:, ci]
        rate_s = _counter_rates(prefix, ts, seen, out_rows, cfg.short_window_s, cfg.interval_s)
        rate_l = _counter_rates(prefix, ts, seen, out_rows, cfg.long_window_s, cfg.interval_s)
        block = np.empty((len(out_rows), 3 * len(ci)))
        block[:, 0::3], block[:, 1::3], block[:, 2::3] = rate_s, rate_l, rate_s - rate_l
        cols.append(block)
    gi = spec.gauges
    if gi:
        g = filled[:, gi]
        valid = ~np.isnan(g)
        s = np.vstack([np.zeros((1, len(gi))), np.cumsum(np.where(valid, g, 0.0), axis=0)])
        k = np.vstack([np.zeros((1, len(gi))), np.cumsum(valid, axis=0)])
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_s = _window_sum(s, j_s, i1) / _window_sum(k, j_s, i1)
            mean_l = _window_sum(s, j_l, i1) / _window_sum(k, j_l, i1)
            recent = _window_sum(s, j_h, i1) / _window_sum(k, j_h, i1)
            old = _window_sum(s, j_l, j_h) / _window_sum(k, j_l, j_h)
        slope = (recent - old) / (cfg.long_window_s / 2.0) * 60.0
        block = np.empty((len(out_rows), 3 * len(gi)))
        block[:, 0::3], block[:, 1::3], block[:, 2::3] = g[out_rows], mean_s - mean_l, slope
        cols.append(block)
    prev = np.maximum(out_rows - 1, 0)
    gap = np.where(out_rows > 0, t - ts[prev], cfg.interval_s)
    n_rows = (i1 - j_l).astype(np.float64)
    expected = np.floor(np.minimum(cfg.long_window_s, t - t_first) / cfg.interval_s + 1e-9) + 1.0
    coverage = np.minimum(n_rows / np.maximum(expected, 1.0), 1.0)
    nf = np.concatenate([[0.0], np.cumsum(nan_frac)])
    nan_l = (nf[i1] - nf[j_l]) / n_rows
    cols.append(np.column_stack([gap, coverage, nan_l]))
    return np.hstack(cols)


#: Self z-scores are clipped to +-this (a counter at rest that fires once would otherwise be 1e6). Far above
#: any real deviation, so large anomalies stay ordered (a tail of tied maxima could never be calibrated).
SELF_Z_CLIP = 1e4
#: Mean absolute deviation -> standard deviation for a normal distribution.
_MAD_TO_SD = 1.2533


def _self_floor(m: np.ndarray) -> np.ndarray:
    return np.maximum(1e-3 * np.abs(m), 1e-6)


def ewma(v: np.ndarray, alpha: float, y0: float) -> np.ndarray:
    """``y[t] = (1 - alpha) * y[t-1] + alpha * v[t]`` from ``y[-1] = y0``, the whole series at once.

    The same first-order filter as ``scipy.signal.lfilter([alpha], [1, alpha - 1], v, zi=[(1 - alpha) * y0])``,
    to rounding (relative ~1e-13), without importing scipy.signal: its import alone cost ~2 s of CPU, most
    of a ``trainguard predictor`` run on a small file. Closed form per chunk, ``y[j] = c^j (y0 + alpha *
    sum_{i<=j} v[i] c^-i)`` with ``c = 1 - alpha``, in chunks short enough that ``c^-i`` stays below ~1e8 (the
    cumulative sum keeps its precision); the state carries from chunk to chunk.

    Args:
        v: inputs, shape (n,), no NaN.
        alpha: weight of a new value, in [0, 1].
        y0: the state before ``v[0]``.

    Returns:
        shape (n,).
    """
    n = len(v)
    c = 1.0 - alpha
    if n == 0 or c >= 1.0:
        return np.full(n, float(y0))
    if c <= 0.0:
        return np.array(v, dtype=np.float64)
    if c < math.exp(-18.0):  # a baseline of under 1/18 interval: c^-1 alone would overflow; step by step
        out = np.empty(n)
        y = float(y0)
        for i, x in enumerate(np.asarray(v, dtype=np.float64).tolist()):
            y = c * y + alpha * x
            out[i] = y
        return out
    size = int(min(n, max(1, math.floor(18.0 / -math.log(c)))))
    grow = c ** -np.arange(1.0, size + 1.0)
    decay = c ** np.arange(1.0, size + 1.0)
    out = np.empty(n)
    y = float(y0)
    for s in range(0, n, size):
        chunk = v[s : s + size]
        m = len(chunk)
        seg = decay[:m] * (y + alpha * np.cumsum(chunk * grow[:m]))
        out[s : s + m] = seg
        y = float(seg[-1])
    return out


def self_z(x: np.ndarray, alpha: float, min_rows: int) -> np.ndarray:
    """Deviation of each row from the node's own exponentially weighted baseline (whole series at once).

    Per column, with ``m`` the weighted mean and ``d`` the weighted mean absolute deviation of the rows
    before: ``z = (x - m) / max(1.2533 d, floor)``, clipped to +-:data:`SELF_Z_CLIP`; missing for the first
    ``min_rows`` valid rows of the column. Leading NaNs are skipped. :class:`SelfBaseline` does the same one
    row at a time (online); the two agree to rounding.

    Args:
        x: features of one node in time order, shape (n, k).
        alpha: weight of a new row.
        min_rows: rows needed before a z is reported.

    Returns:
        shape (n, k).
    """
    n, k = x.shape
    out = np.full((n, k), np.nan)
    for j in range(k):
        col = x[:, j]
        valid = np.flatnonzero(~np.isnan(col))
        if len(valid) < 2:
            continue
        s = int(valid[0])
        v = np.nan_to_num(col[s:], nan=0.0)  # forward-filled inputs: NaN only before the first value
        m = np.empty(len(v))
        m[0] = v[0]
        m[1:] = ewma(v[1:], alpha, v[0])
        e = v[1:] - m[:-1]
        d = np.zeros(len(v))
        d[1:] = ewma(np.abs(e), alpha, 0.0)
        z = e / np.maximum(_MAD_TO_SD * d[:-1], _self_floor(m[:-1]))
        z = np.clip(z, -SELF_Z_CLIP, SELF_Z_CLIP)
        z[: max(0, min_rows - 1)] = np.nan
        out[s + 1 :, j] = z
    return out


class SelfBaseline:
    """One node's exponentially weighted baseline, updated a row at a time (the online :func:`self_z`)."""

    def __init__(self, k: int, alpha: float, min_rows: int) -> None:
        self.alpha, self.min_rows = alpha, min_rows
        self.m = np.full(k, np.nan)
        self.d = np.zeros(k)
        self.n = np.zeros(k, dtype=np.int64)

    def step(self, x: np.ndarray) -> np.ndarray:
        """z of one row (see :func:`self_z`), then folds the row into the baseline."""
        a = self.alpha
        z = np.full(len(x), np.nan)
        new = np.isnan(self.m) & ~np.isnan(x)
        self.m[new], self.n[new] = x[new], 1
        upd = ~new & ~np.isnan(self.m) & ~np.isnan(x)
        e = x[upd] - self.m[upd]
        zz = np.clip(e / np.maximum(_MAD_TO_SD * self.d[upd], _self_floor(self.m[upd])), -SELF_Z_CLIP, SELF_Z_CLIP)
        zz[self.n[upd] < self.min_rows] = np.nan
        z[upd] = zz
        self.d[upd] = (1.0 - a) * self.d[upd] + a * np.abs(e)
        self.m[upd] = (1.0 - a) * self.m[upd] + a * x[upd]
        self.n[upd] += 1
        return z


def peer_z(base: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Robust z-scores of each row against the other rows of its group (same job, same interval).

    Args:
        base: shape (n, k), the per-node features to compare.
        groups: shape (n,), integer group id of each row.

    Returns:
        shape (n, k): ``(x - median) / max(1.4826 * MAD, 0.05 * |median|, floor)`` clipped to
        +-:data:`PEER_Z_CLIP`; NaN where the group has fewer than :data:`MIN_PEERS` rows.
    """
    n, k = base.shape
    out = np.full((n, k), np.nan)
    if n == 0:
        return out
    order = np.argsort(groups, kind="stable")
    g_sorted = groups[order]
    starts = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
    sizes = np.diff(np.r_[starts, n])
    # groups of equal size are stacked into one (n_groups, size, k) array: one vectorised median per size
    for size in np.unique(sizes):
        if size < MIN_PEERS:
            continue
        sel = starts[sizes == size]
        idx = order[sel[:, None] + np.arange(size)[None, :]]
        x = base[idx]  # (g, size, k)
        with np.errstate(invalid="ignore"), _quiet_nan():
            med = np.nanmedian(x, axis=1, keepdims=True)
            mad = np.nanmedian(np.abs(x - med), axis=1, keepdims=True)
        scale = np.maximum(np.maximum(1.4826 * mad, 0.05 * np.abs(med)), PEER_SCALE_FLOOR)
        z = np.clip((x - med) / scale, -PEER_Z_CLIP, PEER_Z_CLIP)
        out[idx.reshape(-1)] = z.reshape(-1, k)
    return out


class _quiet_nan:
    """Silences numpy's 'All-NaN slice' warnings inside a block (a column may be missing for a whole group)."""

    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


@dataclass
class FeatureFrame:
    """Features of a whole table, rows grouped by node and in time order within a node.

    Attributes:
        names: feature names (column order of ``x``).
        x: features, float32, shape (n, len(names)).
        ts: timestamps of the rows, seconds.
        node: node of each row.
        missing_metrics: model metrics absent from the table (their features are NaN).
    """

    names: list[str]
    x: np.ndarray
    ts: np.ndarray
    node: np.ndarray
    missing_metrics: list[str] = field(default_factory=list)


def align_metrics(table_columns: list[str], spec: FeatureSpec, missing: str = "error") -> tuple[list[int | None], list[str]]:
    """Maps the spec's metrics to table columns.

    Args:
        table_columns: columns available.
        spec: the model's feature spec.
        missing: ``"error"`` to refuse when a metric is absent, ``"nan"`` to treat it as always missing.

    Returns:
        ``(index of each spec metric in table_columns or None, names of the missing metrics)``.

    Raises:
        FeatureMismatchError: a metric is absent and ``missing == "error"``.
    """
    if missing not in ("error", "nan"):
        raise FeatureMismatchError(f"missing-metric policy {missing!r} is not 'error' or 'nan'")
    pos = {c: i for i, c in enumerate(table_columns)}
    idx = [pos.get(m) for m in spec.metrics]
    absent = [m for m, i in zip(spec.metrics, idx) if i is None]
    if absent and missing == "error":
        raise FeatureMismatchError(
            f"the data lacks metric(s) {absent} that the model was trained on; supply them, retrain on the "
            "metrics you have, or accept degraded scores with --missing nan"
        )
    return idx, absent


def check_interval(table: MetricTable, interval_s: float, tolerance: float = 0.25) -> float:
    """Checks that a table is sampled at the interval the features assume.

    Coverage and peer bucketing depend on the nominal interval, so data sampled at another rate would give
    quietly wrong features; this refuses it instead.

    Args:
        table: metrics.
        interval_s: nominal interval, seconds.
        tolerance: accepted relative difference of the median sample spacing (default 0.25).

    Returns:
        The median spacing between consecutive samples of a node, seconds (``interval_s`` when unknown).

    Raises:
        DataFormatError: the median spacing differs from ``interval_s`` by more than ``tolerance``.
    """
    gaps = [np.diff(s.ts) for s in table.per_node() if len(s.ts) > 1]
    if not gaps:
        return interval_s
    median = float(np.median(np.concatenate(gaps)))
    if abs(median - interval_s) > tolerance * interval_s:
        raise DataFormatError(
            f"the data is sampled every {median:g} s but the features assume {interval_s:g} s; pass "
            f"--resample {interval_s:g} to bring it to the model's interval, or train with --interval {median:g} "
            "(a model keeps the interval it was trained with)"
        )
    return median


def table_features(table: MetricTable, spec: FeatureSpec, missing: str = "error") -> FeatureFrame:
    """Computes every feature of every row of a table.

    Args:
        table: metrics of one or more nodes.
        spec: features to compute.
        missing: policy for model metrics absent from the table (see :func:`align_metrics`).

    Returns:
        The feature frame (rows grouped per node, sorted node names, time order).

    Raises:
        FeatureMismatchError: a metric is absent and ``missing == "error"``.
    """
    idx, absent = align_metrics(table.columns, spec, missing)
    names = spec.feature_names
    n_node_f = len(spec.node_feature_names)
    x = np.empty((len(table.ts), len(names)), dtype=np.float32)
    ts_out = np.empty(len(table.ts))
    node_out = np.empty(len(table.ts), dtype=object)
    job_out = np.empty(len(table.ts), dtype=object)
    r = 0
    for s in table.per_node():
        raw = np.full((len(s.ts), len(spec.metrics)), np.nan)
        for k, i in enumerate(idx):
            if i is not None:
                raw[:, k] = s.values[:, i]
        nan_frac = np.isnan(raw).mean(axis=1) if raw.shape[1] else np.zeros(len(s.ts))
        feats = node_features(spec, s.ts, forward_fill(raw), nan_frac, float(s.ts[0]), seen_t=seen_times(s.ts, raw))
        m = len(s.ts)
        n_w = feats.shape[1]
        x[r : r + m, :n_w] = feats
        if spec.self_source_columns:
            cfg = spec.config
            src = feats[:, spec.self_source_columns]
            k = len(spec.self_source_columns)
            x[r : r + m, n_w : n_w + k] = self_z(src, cfg.self_alpha, cfg.self_min_rows)
            lb = cfg.long_baseline
            if lb is not None:
                x[r : r + m, n_w + k : n_w + 2 * k] = long_baseline_z(lb, s.ts, src)
        ts_out[r : r + m], node_out[r : r + m], job_out[r : r + m] = s.ts, s.node, s.job
        r += m
    if spec.config.peer:
        base = x[:, spec.peer_base_columns].astype(np.float64)
        bucket = np.round(ts_out / spec.config.interval_s).astype(np.int64)
        _, job_id = np.unique(job_out.astype(str), return_inverse=True)
        groups = bucket * (int(job_id.max()) + 1 if len(job_id) else 1) + job_id
        x[:, n_node_f:] = peer_z(base, groups)
    return FeatureFrame(names, x, ts_out, node_out, absent)
