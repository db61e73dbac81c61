"""A node's robust long-window baseline, with a daily profile: deviations that incidents do not inflate.

The node's own exponentially weighted baseline (:func:`~.features.self_z`) follows the node within hours, but
its scale is a mean absolute deviation: one incident of a few samples inflates it for about a day, and the
next incident then scores low (measured on hourly service latency, issue 19). This baseline is robust
instead: per feature, the median and a robust scale of the node's own values over a trailing window (a week
by default), which an incident shorter than a tenth of the window barely moves, and, once the window holds
``season_min_days`` days, a daily profile (the median per hour of the day, and the spread of the history
around it: a slot alone holds too few days for a spread of its own) so that a daily
pattern (a nightly batch job, diurnal load) is expected, not anomalous.

Per row and feature the result is ``rz``: the deviation ``(x - median) / scale`` or, when the daily profile
is known, the one of ``(x - median) / scale`` and ``(x - profile[hour]) / profile_scale`` closer to
zero (a value is anomalous only when neither the node's usual range nor its usual value at this hour of the
day explains it). With ``recent_window_s`` (a day for models trained with derived windows) the same is
asked of the last day alone: the deviation is the one closer to zero of the week's and the day's. A lasting
level shift (a dependency that starts being called, a new job's load) is then news for its first few
samples, not for the ~10% of the week (17 hours) before the week's own quantiles absorb it (measured on
hourly service latency: a tenfold rise that no one labelled took most of a tight budget; on NAB's AWS
series, 4/9 incidents caught at 0.2 false alarms/day without the recent window, 7/9 with it), while a spike
still deviates from both.
``scale = max(1.4826 MAD, (q90 - q10) / 2.563, floor)``: the interdecile term keeps a quantised or
mostly-zero series (MAD 0) from dividing by almost nothing; where nine rows in ten are alike (q90 = q10: a
dependency called a few times a day, a counter at rest) both robust terms are 0 and the standard deviation
takes their place, so a usual call is ~1/sqrt(share of rows with calls) deviations away, not at the 10^4
clip. Measured on the 23 hourly latency series: with every call of the two idle ones at the clip, the best
pooled threshold at 0.05 false alarms/day caught 6 of 74 incidents. Only there: elsewhere a standard
deviation is what an incident inflates (one 20x spike in a week raises it ~30-fold). Clipped to +-:data:`RZ_CLIP`.

Cheap and identical offline and online: the history keeps the first sample of every ``stride_s`` (at most
about 2000 rows per window), and the statistics are recomputed once per ``refresh_s`` block (an hour by
default) from the rows kept *before* that block; within a block they are fixed. :func:`long_baseline_z`
computes a whole series at once, :class:`LongBaseline` one row at a time; the two agree exactly.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

#: Robust z-scores against the long baseline are clipped to +-this (far above real deviations, so large
#: anomalies stay ordered).
RZ_CLIP = 1e4
#: Most history rows a window keeps (the stride is set so a window holds about this many).
MAX_ROWS = 2016
#: Slots of the daily profile (hours of the day).
SLOTS = 24
#: Normal quantiles: 1.4826 MAD and (q90 - q10) / 2.563 estimate the standard deviation of a normal sample.
_MAD_SD, _IDR_SD = 1.4826, 2.5631
#: The daily profile's scale is at least this share of the overall scale (a slot with identical values on
#: every day must not turn a tiny wobble into a huge deviation).
PROFILE_SCALE_SHARE = 0.1


@dataclass(frozen=True)
class LongBaselineConfig:
    """How the long baseline is kept.

    Attributes:
        window_s: trailing window, seconds.
        interval_s: sampling interval, seconds (sets the stride).
        refresh_s: statistics are recomputed at the first row of each block this long, seconds.
        min_span_s: history span needed before a deviation is reported (else NaN), seconds.
        season_min_days: days of history needed for the daily profile (0: no profile).
        paired: columns are (level, change) pairs whose change is scored only as far as the level confirms
            it (see :func:`_confirm`; the features' layout).
        recent_window_s: a second, shorter trailing window without a daily profile (0: off); the deviation
            is the one closer to zero of the two (see the module docstring).
    """

    window_s: float
    interval_s: float
    refresh_s: float = 3600.0
    min_span_s: float = 6 * 3600.0
    season_min_days: int = 1
    paired: bool = False
    recent_window_s: float = 0.0

    @property
    def stride_s(self) -> float:
        """Spacing of the kept history rows: the interval, or coarser so a window keeps ~:data:`MAX_ROWS`."""
        return max(self.interval_s, self.window_s / MAX_ROWS)

    @property
    def seasonal(self) -> bool:
        """Whether a daily profile is fitted (a day holds at least one row per hour slot)."""
        return self.season_min_days > 0 and self.interval_s <= 86400.0 / SLOTS


def _scale(v: np.ndarray, med: np.ndarray) -> np.ndarray:
    # nearest rank, not interpolated: between a run of zeros and the first call, an interpolated q90 is a
    # sliver of the call (z ~ 12 for a usual call) instead of 0 (idle) or the call (busy)
    q10, q90 = np.percentile(v, [10.0, 90.0], axis=0, method="nearest")
    mad = np.median(np.abs(v - med), axis=0)
    robust = np.maximum(_MAD_SD * mad, (q90 - q10) / _IDR_SD)
    # nine rows in ten alike (an idle dependency, a counter at rest): the robust terms measure nothing
    robust = np.where(robust > 0, robust, np.std(v, axis=0))
    return np.maximum(robust, np.maximum(1e-3 * np.abs(med), 1e-6))


def _slot_medians(slot: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Per column, the median of the rows of each hour slot, shape (SLOTS, k); NaN for an empty slot.

    One sort of all slots at once (rows padded with +inf to the fullest slot's count) instead of a median per
    slot: the profile is refitted every hour, and 24 small medians were most of the offline scoring time. The
    two middle values are averaged as :func:`numpy.median` does, so the result is the same to the bit."""
    counts = np.bincount(slot, minlength=SLOTS)
    order = np.argsort(slot, kind="stable")
    pos = np.arange(len(slot)) - np.repeat(np.cumsum(counts) - counts, counts)
    pad = np.full((SLOTS, max(1, int(counts.max())), v.shape[1]), np.inf)
    pad[slot[order], pos] = v[order]
    pad.sort(axis=1)
    lo = np.maximum((counts - 1) // 2, 0)[:, None, None]
    hi = np.maximum(counts // 2, 0)[:, None, None]
    k = v.shape[1]
    a = np.take_along_axis(pad, np.broadcast_to(lo, (SLOTS, 1, k)), axis=1)[:, 0]
    b = np.take_along_axis(pad, np.broadcast_to(hi, (SLOTS, 1, k)), axis=1)[:, 0]
    out = np.where(counts[:, None] % 2 == 1, a, (a + b) / 2.0)
    out[counts == 0] = np.nan
    return out


def _days_per_slot(slot: np.ndarray, day: np.ndarray) -> np.ndarray:
    """How many distinct days each hour slot holds rows of, shape (SLOTS,)."""
    pairs = np.unique(slot * (int(day.max()) - int(day.min()) + 1) + (day - day.min()))
    return np.bincount(pairs // (int(day.max()) - int(day.min()) + 1), minlength=SLOTS)


@dataclass
class _Stats:
    med: np.ndarray  # (k,)
    scale: np.ndarray  # (k,)
    prof: np.ndarray | None  # (SLOTS, k), NaN where a slot lacks days
    prof_scale: np.ndarray | None
    recent: tuple[np.ndarray, np.ndarray] | None = None  # median and scale of the recent window


def _stats(cfg: LongBaselineConfig, hts: np.ndarray, hx: np.ndarray) -> _Stats | None:
    """Statistics of history rows ``hts``/``hx`` (rows with NaN are skipped per column by forward-fill
    upstream: the features here are computed on forward-filled series, so NaN means 'not yet known')."""
    if len(hts) < 20 or hts[-1] - hts[0] < cfg.min_span_s:
        return None
    # a column never seen (a metric absent, NaN throughout) must not blank the others: rows count when every
    # column seen at all is known in them
    seen = ~np.isnan(hx).all(axis=0)
    ok = ~np.isnan(hx[:, seen]).any(axis=1)
    hts, hx = hts[ok], hx[ok]
    if len(hts) < 20:
        return None
    med = np.median(hx, axis=0)
    scale = _scale(hx, med)
    prof = prof_scale = None
    if cfg.seasonal and hts[-1] - hts[0] >= cfg.season_min_days * 86400.0 - cfg.interval_s:
        slot = (np.floor(np.mod(hts, 86400.0) / (86400.0 / SLOTS))).astype(np.int64)
        day = np.floor(hts / 86400.0).astype(np.int64)
        prof = _slot_medians(slot, hx)
        prof[_days_per_slot(slot, day) < cfg.season_min_days] = np.nan
        prof[:, ~seen] = np.nan
        known = ~np.isnan(prof[slot]).any(axis=1)
        if known.sum() >= 20:
            # one scale for the whole profile, from the residuals of every history row: a slot holds only a
            # few days, too few for a scale of its own (at hourly sampling, one value per day)
            res = hx[known] - prof[slot[known]]
            pooled = _scale(res, np.median(res, axis=0))
            prof_scale = np.broadcast_to(np.maximum(pooled, PROFILE_SCALE_SHARE * scale), prof.shape)
        else:
            prof = None
    recent = None
    if cfg.recent_window_s > 0:
        r = hts > hts[-1] - cfg.recent_window_s
        if r.sum() >= 20:
            rmed = np.median(hx[r], axis=0)
            recent = (rmed, _scale(hx[r], rmed))
    return _Stats(med, scale, prof, prof_scale, recent)


def _deviation(st: _Stats, ts: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Deviations of rows ``x`` (times ``ts``) under fixed statistics (see the module docstring)."""
    z = (x - st.med) / st.scale
    if st.prof is not None:
        slot = (np.floor(np.mod(ts, 86400.0) / (86400.0 / SLOTS))).astype(np.int64)
        zs = (x - st.prof[slot]) / st.prof_scale[slot]  # type: ignore[index]
        z = np.where(np.isnan(zs) | (np.abs(z) <= np.abs(zs)), z, zs)
    if st.recent is not None:
        zr = (x - st.recent[0]) / st.recent[1]
        z = np.where(np.abs(z) <= np.abs(zr), z, zr)
    return np.clip(z, -RZ_CLIP, RZ_CLIP)


def _confirm(cfg: LongBaselineConfig, z: np.ndarray) -> np.ndarray:
    """With ``cfg.paired``, columns come in pairs (level, change): a gauge's level and drift, a counter's
    short rate and its acceleration. The change counts only as far as the level confirms it (same sign, at
    most the level's deviation): after a one-sample spike the short and long windows keep an echo of it
    (drift up for a short window, then down for a long one) while the level is back to normal, and that echo
    is not an incident (measured: without this, hourly latency's echoes took most of a 0.05/day budget)."""
    if not cfg.paired or z.shape[-1] < 2:
        return z
    lvl, chg = z[..., 0::2], z[..., 1::2]
    with np.errstate(invalid="ignore"):
        same = np.sign(lvl) == np.sign(chg)
        conf = np.where(same, np.sign(chg) * np.minimum(np.abs(chg), np.abs(lvl)), 0.0)
    out = z.copy()
    out[..., 1::2] = np.where(np.isnan(lvl) | np.isnan(chg), np.nan, conf)
    return out


def _kept(cfg: LongBaselineConfig, ts: np.ndarray) -> np.ndarray:
    """Which rows enter the history: the first of each stride block."""
    b = np.floor(ts / cfg.stride_s)
    return np.r_[True, b[1:] != b[:-1]] if len(ts) else np.zeros(0, dtype=bool)


def long_baseline_z(cfg: LongBaselineConfig, ts: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Deviations of every row of one node's series from its long baseline (offline, whole series).

    Args:
        cfg: baseline parameters.
        ts: times, seconds, increasing, shape (n,).
        x: features (forward-filled), shape (n, k).

    Returns:
        shape (n, k); NaN until the history spans ``cfg.min_span_s``.
    """
    n, k = x.shape
    out = np.full((n, k), np.nan)
    if n == 0:
        return out
    kept = np.flatnonzero(_kept(cfg, ts))
    blk = np.floor(ts / cfg.refresh_s)
    starts = np.flatnonzero(np.r_[True, blk[1:] != blk[:-1]])
    ends = np.r_[starts[1:], n]
    for a, b in zip(starts, ends):
        lo = blk[a] * cfg.refresh_s - cfg.window_s
        h = kept[(kept < a)]
        h = h[ts[h] >= lo]
        st = _stats(cfg, ts[h], x[h])
        if st is not None:
            out[a:b] = _confirm(cfg, _deviation(st, ts[a:b], x[a:b]))
    return out


class LongBaseline:
    """One node's long baseline, a row at a time (the online :func:`long_baseline_z`)."""

    def __init__(self, cfg: LongBaselineConfig) -> None:
        self.cfg = cfg
        self._hist: deque[tuple[float, np.ndarray]] = deque()
        self._block: float | None = None
        self._stats: _Stats | None = None
        self._last_stride: float | None = None

    def step(self, ts: float, x: np.ndarray) -> np.ndarray:
        """Deviation of one row, then the row joins the history if it starts a stride block."""
        cfg = self.cfg
        blk = math.floor(ts / cfg.refresh_s)
        if blk != self._block:
            self._block = blk
            lo = blk * cfg.refresh_s - cfg.window_s
            while self._hist and self._hist[0][0] < lo:
                self._hist.popleft()
            if self._hist:
                hts = np.fromiter((t for t, _ in self._hist), dtype=np.float64, count=len(self._hist))
                self._stats = _stats(cfg, hts, np.vstack([v for _, v in self._hist]))
            else:
                self._stats = None
        out = (np.full(len(x), np.nan) if self._stats is None
               else _confirm(cfg, _deviation(self._stats, np.array([ts]), x.reshape(1, -1)))[0])
        sb = math.floor(ts / cfg.stride_s)
        if sb != self._last_stride:
            self._last_stride = sb
            self._hist.append((ts, np.array(x, dtype=np.float64)))
        return out
