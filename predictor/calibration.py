"""Online, per-node alarm thresholds that keep a false-alarm budget on nodes no one calibrated for.

A threshold calibrated once on the training fleet does not transfer: another fleet (or node) has other
levels, noise and quirks, and the same score means something else there. So the model only *ranks* samples;
each node decides its own threshold from its own recent scores, online, so that it alarms at most
``budget_per_day`` times a day by construction (as long as its recent past resembles its near future):

- Scores are kept as maxima of fixed time blocks (``block_s``, a minute by default; one sample when the
  interval is longer), over a trailing ``window_s`` (a week). A block "exceeds" when its maximum does.
- The threshold is the block-maximum quantile of level ``1 - alpha``, ``alpha = budget_per_day * block_s /
  86400``: then at most ``budget_per_day`` blocks a day exceed, and an alarm event (the score reaching the
  threshold, repeated at most every cooldown) needs an exceeding block, so events stay within the budget.
- ``alpha`` lies far beyond what a week of blocks shows (0.01/day at 1-minute blocks is 7e-6), so the tail
  is extrapolated with peaks over threshold (Pickands-Balkema-de Haan): excesses of the top
  ``tail_fraction`` of blocks over their base ``u`` follow a generalised Pareto distribution, fitted by
  probability-weighted moments (Hosking & Wallis 1987; closed form, robust for small samples), and
  ``z = u + sigma / gamma * ((alpha n / N_u) ** -gamma - 1)``. This is the SPOT idea (Siffer et al., KDD
  2017) with a sliding window. The fit is redone every ``refit_s``.
- Until a node has ``warmup_s`` of history it does not alarm from the learned tier (the rules tier still
  does): a budget cannot be promised from no data.
- A confirmed incident (the node failed; an operator labelled a window) leaves the history
  (:meth:`TailCalibrator.exclude`): the budget is one of *false* alarms, so the tail it is spent on is the
  node's normal operation. Without that, a node with an incident every few days fits its threshold above its
  own incidents, and spends its budget on true alarms: on MS application crash rates the thresholds used a
  tenth of the budget. An alarm nobody confirms stays in (SPOT's rule of leaving out every block that alarmed
  broke the budget three times over on the synthetic fleet: it also leaves out the false alarms).

:class:`TailCalibrator` is one node's state, used as is by the online runtime and, through
:func:`calibrate_series`, by offline evaluation, so the two agree exactly. Pure numpy; no scikit-learn.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from trainguard.predictor.errors import PredictorError

#: Fewest blocks above the base threshold for a tail fit.
MIN_TAIL = 10
#: Shape of the fitted tail is clipped to this range. Not below 0: a light or bounded tail is extrapolated as
#: exponential, which errs towards fewer alarms. A finite sample of a normal tail fits a negative shape and,
#: measured on i.i.d. scores, then alarmed 1.5-3x the budget; clipped at 0 it stays at 0.1-0.9x (Pareto tails:
#: up to 1.5x, which the runtime's log-odds transform of bounded scores turns into exponential ones).
GAMMA_RANGE = (0.0, 0.5)
#: Smallest tail probability reported (``surprise`` is at most 12).
P_FLOOR = 1e-12


@dataclass(frozen=True)
class CalibrationConfig:
    """How each node calibrates its own threshold.

    Attributes:
        budget_per_day: alarms per node per day the threshold allows (default 0.01: 1 per 100 node-days).
        window_s: trailing history of scores the threshold is fitted on, seconds (default a week).
        warmup_s: history a node needs before it may alarm, seconds (default a day).
        block_s: scores are kept as maxima of blocks this long, seconds (default 60; at least the interval).
        tail_fraction: share of blocks above the tail's base (default 0.05; at least :data:`MIN_TAIL`).
        refit_s: how often the tail is refitted, seconds (default an hour).
        safety: the threshold aims at ``budget_per_day / safety`` (default 2). Scores of real fleets are
            mixtures (noise, plus benign episodes that cluster), whose far tail a few days of data
            under-estimates: aiming at the budget itself, a synthetic fleet of other make than the training
            one (tests/predictor/test_predictor_transfer.py) got 0.35-1.4x the budget over six seeds; at
            half of it, 0.2-0.8x.
        per_family: calibrate per node and metric family (default False, the behaviour of models trained
            before it existed: one threshold per node over the model's score): each (node, family) fits its
            own threshold at the budget, the node's statistic is the largest margin of a family over its own
            threshold, and one more threshold per node on that statistic, at the budget, decides the alarm
            (:func:`calibrate_table`). Only scorers with per-family scores use it (robust-z, threshold); a
            tree ensemble keeps one threshold per node.
    """

    budget_per_day: float = 0.01
    window_s: float = 7 * 86400.0
    warmup_s: float = 86400.0
    block_s: float = 60.0
    tail_fraction: float = 0.05
    refit_s: float = 3600.0
    safety: float = 2.0
    per_family: bool = False

    def __post_init__(self) -> None:
        if not self.budget_per_day > 0:
            raise PredictorError(f"false-alarm budget {self.budget_per_day!r}/day must be positive (--budget)")
        if not (self.block_s > 0 and self.window_s >= 10 * self.block_s and self.warmup_s >= 0 and self.refit_s > 0):
            raise PredictorError(
                f"calibration windows {self.block_s}, {self.window_s}, {self.warmup_s}, {self.refit_s} s: need "
                "block_s > 0, window_s >= 10 blocks, warmup_s >= 0, refit_s > 0"
            )
        if not self.safety >= 1:
            raise PredictorError(f"calibration safety {self.safety} must be at least 1")
        if not 0 < self.tail_fraction < 0.5:
            raise PredictorError(f"tail_fraction {self.tail_fraction} outside (0, 0.5)")

    @classmethod
    def for_interval(cls, interval_s: float, budget_per_day: float, **kw: Any) -> "CalibrationConfig":
        """Defaults fitted to a sampling interval: blocks of one minute or one sample, whichever is longer."""
        kw.setdefault("block_s", max(60.0, float(interval_s)))
        return cls(budget_per_day=budget_per_day, **kw)

    @property
    def alpha(self) -> float:
        """Exceedance probability of one block that spends the budget."""
        return self.budget_per_day * self.block_s / 86400.0 / self.safety

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass(frozen=True)
class TailFit:
    """A fitted tail: base ``u``, GPD scale and shape, and the share of blocks above ``u``."""

    u: float
    sigma: float
    gamma: float
    p_u: float
    threshold: float

    def p_tail(self, s: float, sorted_blocks: np.ndarray) -> float:
        """Probability that a block maximum reaches ``s``."""
        if s <= self.u:
            n = len(sorted_blocks)
            return max((n - int(np.searchsorted(sorted_blocks, s, side="left"))) / n, P_FLOOR) if n else 1.0
        if self.sigma <= 0:
            return P_FLOOR
        y = (s - self.u) / self.sigma
        if abs(self.gamma) < 1e-6:
            p = self.p_u * math.exp(-y)
        else:
            base = 1.0 + self.gamma * y
            p = self.p_u * base ** (-1.0 / self.gamma) if base > 0 else 0.0
        return max(p, P_FLOOR)


def fit_tail(blocks: np.ndarray, alpha: float, tail_fraction: float) -> TailFit:
    """Peaks-over-threshold fit of block maxima and the threshold for exceedance probability ``alpha``.

    Args:
        blocks: block maxima (finite).
        alpha: target exceedance probability of one block.
        tail_fraction: share of blocks above the base.

    Returns:
        The fit. With too few distinct values above the base (e.g. a score saturated at its maximum), the
        threshold is just above the largest block seen: the node alarms only on a score it has never shown.
    """
    x = np.sort(blocks)
    n = len(x)
    top = float(np.nextafter(x[-1], np.inf))
    if alpha * n >= MIN_TAIL:  # enough data to read the quantile directly
        thr = float(x[int(math.floor((1.0 - alpha) * n))])
        return TailFit(thr, 0.0, 0.0, alpha, thr)
    k = min(max(MIN_TAIL, int(math.ceil(tail_fraction * n))), n - 1)
    u = float(x[n - k - 1])
    y = x[x > u] - u
    n_u = len(y)
    if n_u < 3 or float(y.max()) <= 0:
        return TailFit(u, 0.0, 0.0, n_u / n, top)
    # probability-weighted moments of the excesses (Hosking & Wallis 1987): a0 = E[Y], a1 = E[Y (1 - F(Y))]
    ys = np.sort(y)
    p = (np.arange(1, n_u + 1) - 0.35) / n_u
    a0 = float(ys.mean())
    a1 = float(np.mean((1.0 - p) * ys))
    denom = a0 - 2.0 * a1
    if denom <= 0:
        return TailFit(u, 0.0, 0.0, n_u / n, top)
    kappa = a0 / denom - 2.0  # Hosking's shape k = -gamma
    sigma = 2.0 * a0 * a1 / denom
    gamma = float(np.clip(-kappa, *GAMMA_RANGE))
    r = alpha * n / n_u
    if abs(gamma) < 1e-6:
        thr = u - sigma * math.log(r)
    else:
        thr = u + sigma / gamma * (r ** (-gamma) - 1.0)
    return TailFit(u, sigma, gamma, n_u / n, float(thr))


class TailCalibrator:
    """One node's self-calibrated threshold (see the module docstring)."""

    def __init__(self, cfg: CalibrationConfig, alpha: float | None = None) -> None:
        """Creates an empty calibrator.

        Args:
            cfg: calibration parameters.
            alpha: block exceedance probability (default ``cfg.alpha``; a share of it when a node's budget is
                split between several scores).
        """
        self.cfg = cfg
        self.alpha = cfg.alpha if alpha is None else alpha
        self._blocks: deque[tuple[int, float]] = deque()
        self._cur_block: int | None = None
        self._cur_max = -math.inf
        self._first_ts: float | None = None
        self._fit: TailFit | None = None
        self._sorted = np.zeros(0)
        self._fit_ts = -math.inf

    @property
    def threshold(self) -> float:
        """The threshold in force (inf while warming up)."""
        return self._fit.threshold if self._fit is not None else math.inf

    @property
    def warm(self) -> bool:
        """Whether the node has enough history to alarm."""
        return self._fit is not None

    def _close_block(self) -> None:
        if self._cur_block is not None and math.isfinite(self._cur_max):
            self._blocks.append((self._cur_block, self._cur_max))
        self._cur_max = -math.inf

    def _refit(self, ts: float) -> None:
        assert self._first_ts is not None
        if ts - self._first_ts < self.cfg.warmup_s or len(self._blocks) < 2 * MIN_TAIL:
            return
        self._sorted = np.sort(np.fromiter((v for _, v in self._blocks), dtype=np.float64, count=len(self._blocks)))
        self._fit = fit_tail(self._sorted, self.alpha, self.cfg.tail_fraction)
        self._fit_ts = ts

    def exclude(self, start: float, end: float) -> None:
        """Takes a confirmed incident's span out of the history the threshold is fitted on; the threshold is
        refitted at the next block.

        Args:
            start, end: the incident's span, seconds (blocks overlapping it leave, the current one too).
        """
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise PredictorError(f"incident span {start!r}..{end!r} must be finite and in time order")
        lo = int(math.floor(start / self.cfg.block_s))
        hi = int(math.floor(end / self.cfg.block_s))
        if any(lo <= b <= hi for b, _ in self._blocks):
            self._blocks = deque((b, v) for b, v in self._blocks if not lo <= b <= hi)
        if self._cur_block is not None and lo <= self._cur_block <= hi:
            self._cur_max = -math.inf
        self._fit_ts = -math.inf

    def observe(self, ts: float, score: float) -> tuple[float, float]:
        """Takes one score; returns the threshold in force for it and its tail probability.

        The threshold comes from blocks that ended before this sample's block (a score never judges itself).

        Args:
            ts: sample time, seconds (increasing).
            score: the model's score (NaN: skipped).

        Returns:
            ``(threshold, p_tail)``: threshold inf and p_tail NaN while warming up.
        """
        if self._first_ts is None and score == score:  # warm-up counts from the first informed score
            self._first_ts = ts
        if self._first_ts is None:
            return math.inf, math.nan
        block = int(math.floor(ts / self.cfg.block_s))
        if block != self._cur_block:
            self._close_block()
            self._cur_block = block
            oldest = block - int(self.cfg.window_s / self.cfg.block_s)
            while self._blocks and self._blocks[0][0] < oldest:
                self._blocks.popleft()
            if ts - self._fit_ts >= self.cfg.refit_s or self._fit is None:
                self._refit(ts)
        thr = self.threshold
        p = self._fit.p_tail(score, self._sorted) if self._fit is not None and score == score else math.nan
        if score == score:
            self._cur_max = max(self._cur_max, score)
        return thr, p


def log_odds(score: float) -> float:
    """Log-odds of a score in [0, 1] (clipped away from 0 and 1): the scale thresholds are fitted on, so a
    bounded score gets an unbounded tail."""
    s = min(max(score, 1e-12), 1.0 - 1e-12)
    return math.log(s / (1.0 - s))


Incident = tuple[float, float, float]
"""A confirmed incident: ``(start, end, known_at)``, seconds; its blocks leave the history at ``known_at``."""


def surprise(p: float) -> float:
    """``-log10`` of a tail probability: a score comparable between nodes (NaN stays NaN)."""
    return -math.log10(max(p, P_FLOOR)) if p == p else math.nan


def calibrate_series(
    ts: np.ndarray, score: np.ndarray, cfg: CalibrationConfig, alpha: float | None = None,
    incidents: Sequence[Incident] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """Runs one node's scores through a fresh :class:`TailCalibrator` (offline twin of the runtime).

    Args:
        ts: times, seconds, increasing.
        score: the model's scores (NaN: skipped).
        cfg: calibration parameters.
        alpha: block exceedance probability (default ``cfg.alpha``; ``cfg.alpha / F`` for one of F families).
        incidents: the node's confirmed incidents, each taken out of the history from its ``known_at`` on
            (:meth:`TailCalibrator.exclude`, what the runtime's ``record_incident`` does).

    Returns:
        ``(threshold, surprise)`` per row (inf / NaN while warming up).
    """
    cal = TailCalibrator(cfg, alpha)
    thr = np.empty(len(ts))
    sur = np.empty(len(ts))
    feed = _IncidentFeed(incidents)
    for i, (t, s) in enumerate(zip(ts.tolist(), score.tolist())):
        for a, b in feed.due(t):
            cal.exclude(a, b)
        thr[i], p = cal.observe(t, s)
        sur[i] = surprise(p)
    return thr, sur


class _IncidentFeed:
    """Hands out incidents in the order they become known."""

    def __init__(self, incidents: Sequence[Incident]) -> None:
        self._left = sorted(incidents, key=lambda inc: inc[2])
        self._k = 0

    def due(self, ts: float) -> list[tuple[float, float]]:
        """Incidents known by ``ts`` and not handed out yet."""
        out = []
        while self._k < len(self._left) and self._left[self._k][2] <= ts:
            a, b, _ = self._left[self._k]
            out.append((a, b))
            self._k += 1
        return out


def calibrate_table(
    ts: np.ndarray, node: np.ndarray, score: np.ndarray, cfg: CalibrationConfig,
    incidents: Mapping[str, Sequence[Incident]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`calibrate_series` for every node of a table (rows in any order), on the log-odds of the scores
    as the runtime does.

    Args:
        ts, node: time and node of each row.
        score: the model's score per row, shape (n,), or one score per metric family, shape (n, F)
            (:func:`~.scorers.family_scores`). Per family, each (node, family) fits its own threshold (the
            family's own tail: a quiet family is not judged by a noisy one's), the node's statistic is the
            largest family margin over its own threshold, and a last threshold per node on that statistic, at
            the node's budget, decides: so the node keeps its budget by the same construction as with one
            score (a union bound over F thresholds at ``budget / F`` was tried first and broke the budget on
            the synthetic fleet: sparse counter families put their threshold just above the few days seen).
        cfg: calibration parameters.
        incidents: node -> its confirmed incidents (see :func:`calibrate_series`; default none).

    Returns:
        ``(margin, surprise)`` per row, in the input row order: ``margin`` is the node's statistic minus its
        threshold in force (-inf while warming up: with families, a day for the families' thresholds and a
        day for the node's); the runtime alarms where it is >= 0. ``surprise`` is the node-level one.
    """
    s2 = np.asarray(score, dtype=np.float64)
    s2 = s2.reshape(len(ts), -1)
    n_fam = s2.shape[1]
    sc = np.clip(s2, 1e-12, 1.0 - 1e-12)
    lo = np.log(sc / (1.0 - sc))
    stat = lo[:, 0].copy() if n_fam == 1 else np.full(len(ts), np.nan)
    thr = np.full(len(ts), math.inf)
    sur = np.full(len(ts), math.nan)
    keys = node.astype(str)
    for n in np.unique(keys):
        rows = np.flatnonzero(keys == n)
        rows = rows[np.argsort(ts[rows], kind="stable")]
        inc = (incidents or {}).get(n, ())
        if n_fam > 1:
            stat[rows] = family_statistic(ts[rows], lo[rows], cfg, inc)
        thr[rows], sur[rows] = calibrate_series(ts[rows], stat[rows], cfg, incidents=inc)
    with np.errstate(invalid="ignore"):
        margin = np.where(np.isfinite(thr) & ~np.isnan(stat), stat - thr, -np.inf)
    return margin, sur


def family_statistic(ts: np.ndarray, lo: np.ndarray, cfg: CalibrationConfig,
                     incidents: Sequence[Incident] = ()) -> np.ndarray:
    """One node's per-family statistic: the largest margin of a family's log-odds over that family's own
    threshold (NaN while no family is warm); offline twin of :class:`FamilyCalibrator`."""
    fc = FamilyCalibrator(cfg, lo.shape[1])
    feed = _IncidentFeed(incidents)
    out = np.empty(len(ts))
    for i, (t, row) in enumerate(zip(ts.tolist(), lo.tolist())):
        for a, b in feed.due(t):
            fc.exclude(a, b)
        out[i] = fc.statistic(t, row)[0]
    return out


class FamilyCalibrator:
    """One node's thresholds per metric family and the statistic they give (see :func:`calibrate_table`)."""

    def __init__(self, cfg: CalibrationConfig, n_families: int) -> None:
        self.cals = [TailCalibrator(cfg) for _ in range(n_families)]

    def statistic(self, ts: float, lo: list[float]) -> tuple[float, int, float]:
        """Feeds one row of family log-odds (NaN: unknown); returns ``(statistic, deciding family, its
        threshold)``: the largest margin over the families' own thresholds (NaN while none is warm)."""
        best, arg, arg_thr = math.nan, 0, math.inf
        for f, (cal, v) in enumerate(zip(self.cals, lo)):
            thr, _ = cal.observe(ts, v)
            if v == v and math.isfinite(thr) and not (v - thr <= best):
                best, arg, arg_thr = v - thr, f, thr
        return best, arg, arg_thr

    def exclude(self, start: float, end: float) -> None:
        """Takes a confirmed incident out of every family's history (:meth:`TailCalibrator.exclude`)."""
        for c in self.cals:
            c.exclude(start, end)

    @property
    def thresholds(self) -> list[float]:
        """Each family's threshold in force (log-odds; inf while warming up)."""
        return [c.threshold for c in self.cals]


@dataclass
class AlarmLedger:
    """Counts one node's learned-tier alarm events (cooldown applied) and observed time, for the live
    realised false-alarm rate. Every alarm is counted: online there is no telling false from true yet, so
    the rate is an upper bound of the false-alarm rate."""

    cooldown_s: float
    max_gap_s: float
    events: int = 0
    observed_s: float = 0.0
    last_ts: float | None = None
    last_event_ts: float = -math.inf

    def add(self, ts: float, alarm: bool) -> bool:
        """Accounts one sample; returns whether it starts an alarm event (first, or a cooldown after the last)."""
        if self.last_ts is not None:
            self.observed_s += min(max(ts - self.last_ts, 0.0), self.max_gap_s)
        self.last_ts = ts
        if alarm and ts - self.last_event_ts >= self.cooldown_s:
            self.events += 1
            self.last_event_ts = ts
            return True
        return False

    @property
    def per_day(self) -> float:
        """Alarm events per observed day (NaN before any time was observed)."""
        return self.events / (self.observed_s / 86400.0) if self.observed_s > 0 else math.nan
