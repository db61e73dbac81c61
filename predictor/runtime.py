"""Online scoring, embedded in the node agent: one sample of one node in, a :class:`Score` out.

The runtime keeps, per node, the samples of the last long window (about 30 rows at 60 s, 360 at 5 s) and
computes the same features as training (:func:`~.features.node_features` on that tail), so offline and online
scores agree. Cost is dominated by the model: a single-row pure-Python tree walk (about 0.1-0.3 ms for 100
small trees) instead of numpy calls whose fixed overhead would dominate one row.

Two tiers: every sample is first matched against the rules tier; a rule hit is an immediate alarm
(``score`` 1.0, ``source`` ``"rules"``, the rule names first in ``top_features`` as ``rule:<name>``).

Degradation, never a silent wrong score:

- a metric the model was trained on is absent from the sample dict: with ``missing="error"`` (default)
  :class:`~.errors.FeatureMismatchError`; with ``missing="nan"`` it is treated as missing (NaN, which the
  models handle as in training: trees follow their learned missing branch, robust-z ignores it) and
  ``Score.degraded`` names it. A metric present with value NaN is a normal missing sample (forward-filled).
- peer features need the other nodes of the job: :meth:`PredictorRuntime.observe_many` computes them;
  :meth:`PredictorRuntime.observe` of one node leaves them missing and says so in ``Score.degraded`` (train
  with ``peer=False`` for a model meant to run on one node alone).
- metrics the model does not know are ignored; timestamps that do not increase are refused.

Thresholds: a model with a ``calibration`` (every model trained since it exists) alarms on a node only when
the score reaches the node's *own* threshold, fitted online from its recent scores to the false-alarm budget
(:mod:`.calibration`; scores are calibrated as log-odds, so a bounded score gets an unbounded tail). Until a
node has a day of history it does not alarm from the learned tier. :meth:`PredictorRuntime.status` reports,
live, each node's threshold and its realised alarm rate against the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainguard.predictor.calibration import AlarmLedger, FamilyCalibrator, TailCalibrator, log_odds, surprise
from trainguard.predictor.errors import DataFormatError, FeatureMismatchError
from trainguard.predictor.features import STALE_COUNTER_S, SelfBaseline, node_features, peer_z
from trainguard.predictor.long_baseline import LongBaseline
from trainguard.predictor.model import PredictorModel
from trainguard.predictor.rules import RuleHit, RulesTier
from trainguard.predictor.scorers import TreeEnsembleScorer, family_scores

#: ``Score.degraded`` reason of a model score that is no score yet (NaN, read as 0): no threshold may alarm on it.
WARMING_UP = "baselines warming up (no scored feature known yet; score reads 0)"


@dataclass(frozen=True)
class Score:
    """The predictor's verdict on one sample of one node.

    Attributes:
        node: node name.
        ts: sample time, seconds.
        score: risk in [0, 1] (1.0 on a rule hit).
        threshold: the alarm threshold in force for this node (its own when calibrated online; inf while
            the node's calibration warms up).
        alarm: ``score >= threshold`` or a rule hit.
        top_features: ``[(feature or "rule:<name>", contribution), ...]``, most alarming first.
        rule_hits: rules that matched.
        source: ``"rules"`` when a rule decided, else ``"model"``.
        degraded: reasons the score is less informed than in training (empty when fully informed).
        surprise: ``-log10`` of the probability that this node shows a score this high in a block of its
            own history (NaN without online calibration or while it warms up): comparable between nodes.
            With per-family thresholds: of the node's statistic (the largest family margin).
        family: with per-family thresholds, the metric family whose margin over its own threshold is the
            largest (it decides ``alarm``; ``score`` is that family's score and ``threshold`` its own
            threshold plus the node's); else empty.
    """

    node: str
    ts: float
    score: float
    threshold: float
    alarm: bool
    top_features: list[tuple[str, float]] = field(default_factory=list)
    rule_hits: list[RuleHit] = field(default_factory=list)
    source: str = "model"
    degraded: tuple[str, ...] = ()
    surprise: float = math.nan
    family: str = ""


@dataclass(frozen=True)
class NodeStatus:
    """Live calibration state of one node.

    Attributes:
        node: node name.
        threshold: threshold in force (inf while warming up).
        calibrated: whether the node has enough history to alarm.
        alarms: learned-tier alarm events so far (cooldown applied; rules excluded).
        observed_days: time observed, days (gaps beyond 10 intervals not counted).
        alarms_per_day: realised rate (an upper bound of the false-alarm rate: every alarm counts).
        budget_per_day: the budget the threshold is calibrated to (the node's: with per-family
            thresholds each family gets an equal share).
        family_thresholds: with per-family thresholds, ``(family, threshold)`` of each (log-odds;
            ``threshold`` is then the node's, on the largest family margin); empty otherwise.
    """

    node: str
    threshold: float
    calibrated: bool
    alarms: int
    observed_days: float
    alarms_per_day: float
    budget_per_day: float
    family_thresholds: tuple[tuple[str, float], ...] = ()


class _NodeBuffer:
    """Tail of one node's samples (forward-filled), long enough for the long window."""

    def __init__(self, n_metrics: int, capacity: int, counters: list[int] | tuple[int, ...] = ()) -> None:
        self.ts = np.empty(capacity)
        self.filled = np.empty((capacity, n_metrics))
        self.nan_frac = np.empty(capacity)
        self.seen_t = np.empty((capacity, n_metrics))  # time of the reading each filled cell comes from
        self.n = 0
        self.last_valid = np.full(n_metrics, np.nan)
        self.last_seen = np.full(n_metrics, np.nan)
        self.counters = list(counters)  # the columns whose rates are timed by their readings
        self.t_first: float | None = None

    def append(self, ts: float, raw: np.ndarray, long_window_s: float) -> None:
        nan = np.isnan(raw)
        filled = np.where(nan, self.last_valid, raw)
        self.last_valid = filled
        if self.t_first is None:
            self.t_first = ts
        # keep rows inside the new sample's long window plus the one before (for the gap feature)
        if self.n:
            # back to the oldest reading a filled cell comes from too (a counter's rate is timed by its readings,
            # see features.STALE_COUNTER_S), for at most that long beyond the window
            seen = self.last_seen[self.counters]
            oldest = float(np.nanmin(seen)) if len(seen) and not np.isnan(seen).all() else ts
            keep_from = max(min(ts, oldest) - long_window_s, ts - long_window_s - STALE_COUNTER_S)
            first_inside = int(np.searchsorted(self.ts[: self.n], keep_from, side="left"))
            drop = max(0, first_inside - 1)
            if drop:
                m = self.n - drop
                self.ts[:m] = self.ts[drop : self.n]
                self.filled[:m] = self.filled[drop : self.n]
                self.nan_frac[:m] = self.nan_frac[drop : self.n]
                self.seen_t[:m] = self.seen_t[drop : self.n]
                self.n = m
        if self.n == len(self.ts):
            self._grow()
        self.ts[self.n], self.filled[self.n], self.nan_frac[self.n] = ts, filled, nan.mean() if len(raw) else 0.0
        self.last_seen = np.where(nan, self.last_seen, ts)
        self.seen_t[self.n] = self.last_seen
        self.n += 1

    def _grow(self) -> None:
        cap = 2 * len(self.ts)
        for name in ("ts", "filled", "nan_frac", "seen_t"):
            old = getattr(self, name)
            new = np.empty((cap,) + old.shape[1:], dtype=old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)


def _as_time(ts: object, node: str) -> float:
    """A sample's time as float seconds; a value that is no number (None, ``"12:00"``) is refused like a
    non-numeric metric value, not a TypeError from deep inside (a string a CSV reader gave, such as ``"1060"``,
    is taken, as the metric values are)."""
    try:
        return float(ts)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DataFormatError(f"node {node!r}: timestamp {ts!r} is not a number of Unix seconds") from None


def _node_order(node: object) -> tuple[int, object]:
    """Sort key of node names of any type (API callers pass rank numbers too): names of one kind in their own
    order, strings first, then numbers, then anything else by its text; mixed kinds made ``sorted`` raise."""
    if isinstance(node, str):
        return 0, node
    if isinstance(node, (int, float)) and not isinstance(node, bool) and not math.isnan(node):
        return 1, node
    return 2, repr(node)


class PredictorRuntime:
    """Scores a node's metric stream online; see the module docstring for tiers and degradation."""

    def __init__(
        self, model: PredictorModel | None, rules: RulesTier | None = None, missing: str = "error", top_k: int = 5,
    ) -> None:
        """Creates a runtime.

        Args:
            model: learned tier; None for rules only.
            rules: rules tier; default the shipped rules (``RulesTier.load()``).
            missing: ``"error"`` or ``"nan"``: what to do when a sample lacks a model metric.
            top_k: how many contributing features each :class:`Score` carries.

        Raises:
            FeatureMismatchError: unknown ``missing`` policy.
        """
        if missing not in ("error", "nan"):
            raise FeatureMismatchError(f"missing-metric policy {missing!r} is not 'error' or 'nan'")
        self.model = model
        self.rules = rules if rules is not None else RulesTier.load()
        self.missing = missing
        self.top_k = top_k
        self._nodes: dict[str, _NodeBuffer] = {}
        self._self: dict[str, SelfBaseline] = {}
        self._long: dict[str, LongBaseline] = {}
        self._cal: dict[str, TailCalibrator] = {}
        self._fam: dict[str, FamilyCalibrator] = {}
        self._ledger: dict[str, AlarmLedger] = {}
        self._last_ts: dict[str, float] = {}  # each node's latest accepted sample time (rules only included)
        self._families: list[str] | None = None  # metric families with their own thresholds (None: one)
        if model is not None and model.calibration is not None and model.calibration.per_family:
            names, _ = family_scores(model.scorer, model.spec.families, np.zeros((1, len(model.spec.feature_names))))
            self._families = names if names != ["all"] else None
        self._fast = None
        if model is not None and isinstance(model.scorer, TreeEnsembleScorer):
            self._fast = [
                (t["is_leaf"].tolist(), t["feature"].tolist(), t["threshold"].tolist(), t["missing_left"].tolist(),
                 t["left"].tolist(), t["right"].tolist(), t["value"].tolist(), t["expected"].tolist())
                for t in model.scorer.trees
            ]

    @classmethod
    def load(cls, model_path: str | Path | None, key: str | bytes | None = None, rules_path: str | Path | None = None,
             missing: str = "error", top_k: int = 5) -> "PredictorRuntime":
        """Loads a model file (verified, see :meth:`PredictorModel.load`) and a rules file.

        Args:
            model_path: model file, or None for rules only.
            key: HMAC key (default ``$TRAINGUARD_PREDICTOR_KEY``).
            rules_path: rules file (default the shipped one).
            missing: missing-metric policy.
            top_k: contributing features per score.

        Raises:
            ModelFileError: bad model file. RuleFileError: bad rules file.
        """
        model = PredictorModel.load(model_path, key) if model_path is not None else None
        rules = RulesTier.load(rules_path)
        return cls(model, rules, missing, top_k)

    @property
    def threshold(self) -> float:
        """The learned tier's alarm threshold (1.0 for rules only)."""
        return self.model.threshold if self.model is not None else 1.0

    def check_metrics(self, names: list[str] | set[str]) -> list[str]:
        """Model metrics absent from ``names`` (call once at start-up with the agent's metric names).

        Raises:
            FeatureMismatchError: some are absent and the policy is ``"error"``.
        """
        if self.model is None:
            return []
        absent = [m for m in self.model.spec.metrics if m not in set(names)]
        if absent and self.missing == "error":
            raise FeatureMismatchError(
                f"the agent's metrics lack {absent}, which the model was trained on; enable those detectors, "
                "retrain on the metrics available, or run with missing='nan' (degraded scores)"
            )
        return absent

    def forget(self, node: str) -> None:
        """Drops a node's history (it left the job or was replaced): a new node calibrates afresh."""
        for d in (self._nodes, self._self, self._long, self._cal, self._fam, self._ledger, self._last_ts):
            d.pop(node, None)  # type: ignore[attr-defined]
        # the rules tier's too: a node that came back compared its counters with the values it left with
        self.rules.forget(node)

    def record_incident(self, node: str, start: float, end: float) -> None:
        """Takes a confirmed incident of a node (it failed; an operator labelled the span) out of the history
        its online threshold is fitted on: the budget is one of false alarms (see :mod:`.calibration`).

        Args:
            node: the node.
            start, end: the incident's span, Unix seconds.

        Raises:
            PredictorError: a span that is not finite or not in time order.
        """
        cal = self._cal.get(node)
        if cal is not None:
            cal.exclude(start, end)
        fc = self._fam.get(node)
        if fc is not None:
            fc.exclude(start, end)

    def status(self) -> list[NodeStatus]:
        """Live calibration state and realised alarm rate of every node seen (sorted by node)."""
        if self.model is None:
            return []
        cal = self.model.calibration
        budget = cal.budget_per_day if cal is not None else self.model.eval_config.budget_per_100_node_days / 100.0
        out = []
        for node in sorted(self._ledger, key=_node_order):
            led = self._ledger[node]
            c = self._cal.get(node)
            thr = c.threshold if c is not None else self.model.threshold
            fc = self._fam.get(node)
            fam = tuple(zip(self._families, fc.thresholds)) if fc is not None and self._families else ()
            out.append(NodeStatus(node, thr, c.warm if c is not None else True, led.events,
                                  led.observed_s / 86400.0, led.per_day, budget, fam))
        return out

    def realised_alarms_per_day(self) -> float:
        """Learned-tier alarm events per observed node-day over every node seen (NaN before any time)."""
        led = list(self._ledger.values())
        days = sum(x.observed_s for x in led) / 86400.0
        return sum(x.events for x in led) / days if days > 0 else math.nan

    def _check_sample(self, ts: float, node: str, metrics: dict[str, float]) -> None:
        """Refuses a sample before the rules tier or the features take it in. The rules tier ran first and kept
        what it saw, so a refused sample (a repeated timestamp, an infinite value) that carried a fatal counter's
        increase left none for the next sample to show: the XID alarm never fired.

        Raises:
            DataFormatError, FeatureMismatchError: as :meth:`observe`.
        """
        if not math.isfinite(ts):
            raise DataFormatError(f"node {node!r}: timestamp {ts!r} is not finite")
        # kept apart from the model's buffers: without a model the rules tier took a sample from the past (a
        # replayed, stale counter) and, at the next current one, a fatal counter's old increase again
        last = self._last_ts.get(node)
        if last is not None and ts <= last:
            raise DataFormatError(
                f"node {node!r}: timestamp {ts} is not after the previous {last}; samples must arrive "
                "in increasing time (check the clock or drop the duplicate)"
            )
        for m, v in metrics.items():
            if v is None:
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise DataFormatError(f"node {node!r}: metric {m!r} has non-numeric value {v!r}") from None
            if math.isinf(x):
                raise DataFormatError(f"node {node!r}: metric {m!r} is infinite; report NaN when unknown")
        if self.model is not None and self.missing == "error":
            absent = [m for m in self.model.spec.metrics if metrics.get(m) is None]
            if absent:
                raise FeatureMismatchError(
                    f"node {node!r}: sample lacks {absent}, which the model was trained on; supply them or run "
                    "with missing='nan' (degraded scores)"
                )

    def _node_row(self, ts: float, node: str, metrics: dict[str, float], degraded: list[str]) -> np.ndarray:
        """The model's feature row of one sample (its timestamp and values already passed :meth:`_check_sample`)."""
        assert self.model is not None
        spec = self.model.spec
        buf = self._nodes.get(node)
        raw = np.empty(len(spec.metrics))
        absent = []
        for i, m in enumerate(spec.metrics):
            v = metrics.get(m)
            if v is None:
                absent.append(m)
                raw[i] = np.nan
                continue
            try:
                raw[i] = float(v)
            except (TypeError, ValueError):
                raise DataFormatError(f"node {node!r}: metric {m!r} has non-numeric value {v!r}") from None
            if math.isinf(raw[i]):
                raise DataFormatError(f"node {node!r}: metric {m!r} is infinite; report NaN when unknown")
        if absent:
            if self.missing == "error":
                raise FeatureMismatchError(
                    f"node {node!r}: sample lacks {absent}, which the model was trained on; supply them or run "
                    "with missing='nan' (degraded scores)"
                )
            degraded.append("missing metrics: " + ",".join(absent))
        if buf is None:
            rows = int(spec.config.long_window_s / spec.config.interval_s) + 8
            buf = self._nodes[node] = _NodeBuffer(len(spec.metrics), rows, spec.counters)
        buf.append(float(ts), raw, spec.config.long_window_s)
        assert buf.t_first is not None
        n = buf.n
        w = node_features(spec, buf.ts[:n], buf.filled[:n], buf.nan_frac[:n], buf.t_first, rows=slice(n - 1, n),
                          seen_t=buf.seen_t[:n])[0]
        if not spec.self_source_columns:
            return w
        base = self._self.get(node)
        if base is None:
            base = self._self[node] = SelfBaseline(len(spec.self_source_columns), spec.config.self_alpha,
                                                   spec.config.self_min_rows)
        src = w[spec.self_source_columns]
        parts = [w, base.step(src)]
        lb_cfg = spec.config.long_baseline
        if lb_cfg is not None:
            lb = self._long.get(node)
            if lb is None:
                lb = self._long[node] = LongBaseline(lb_cfg)
            parts.append(lb.step(float(ts), src))
        return np.concatenate(parts)

    def _finish(self, ts: float, node: str, row: np.ndarray, hits: list[RuleHit], degraded: list[str]) -> Score:
        assert self.model is not None
        names = self.model.spec.feature_names
        if self._fast is not None:
            raw = self.model.scorer.baseline  # type: ignore[attr-defined]
            vals = row.tolist()  # Python floats: a pure-Python walk is ~10x faster than indexing numpy
            contrib = [0.0] * len(vals)
            for leaf, feat, thr, ml, left, right, value, exp in self._fast:
                i = 0
                while not leaf[i]:
                    f = feat[i]
                    v = vals[f]
                    nxt = (left[i] if ml[i] else right[i]) if v != v else (left[i] if v <= thr[i] else right[i])
                    contrib[f] += exp[nxt] - exp[i]
                    i = nxt
                raw += value[i]
            score = 1.0 / (1.0 + math.exp(-raw))
            top = sorted(((names[f], round(c, 4)) for f, c in enumerate(contrib) if c > 0), key=lambda p: -p[1])
            top = top[: self.top_k]
        else:
            score = float(self.model.scorer.score(row.reshape(1, -1))[0])
            top = self.model.scorer.top_features(row, self.top_k)
        thr, sur, family = self.model.threshold, math.nan, ""
        informed = score == score  # NaN: no scored feature known yet (the node's baselines warm up)
        cfg = self.model.calibration
        if cfg is not None:
            cal = self._cal.get(node)
            if cal is None:
                cal = self._cal[node] = TailCalibrator(cfg)
            stat = log_odds(score) if informed else math.nan
            fam_thr = 0.0
            if self._families is not None:
                fs = family_scores(self.model.scorer, self.model.spec.families, row.reshape(1, -1))[1][0].tolist()
                fc = self._fam.get(node)
                if fc is None:
                    fc = self._fam[node] = FamilyCalibrator(cfg, len(fs))
                stat, f, fam_thr = fc.statistic(ts, [log_odds(v) if v == v else math.nan for v in fs])
                family = self._families[f]
                if fs[f] == fs[f]:
                    score = fs[f]  # the deciding family's score, against its own threshold plus the node's
            thr_lo, p = cal.observe(ts, stat)  # a NaN is skipped: the threshold learns only from real scores
            sur = surprise(p)
            learned_alarm = stat == stat and stat >= thr_lo
            # the threshold in score units (inf while warming up)
            thr_lo = thr_lo + fam_thr
            thr = 1.0 / (1.0 + math.exp(-min(max(thr_lo, -700.0), 700.0))) if math.isfinite(thr_lo) else math.inf
        else:
            learned_alarm = informed and score >= thr
        if score != score:
            degraded.append(WARMING_UP)
            score = 0.0
        led = self._ledger.get(node)
        if led is None:
            ev = self.model.eval_config
            led = self._ledger[node] = AlarmLedger(ev.cooldown_s, 10.0 * self.model.spec.config.interval_s)
        led.add(ts, learned_alarm)
        if hits:
            top = [(f"rule:{h.rule}", 1.0) for h in hits] + top
            return Score(node, ts, 1.0, thr, True, top[: self.top_k + len(hits)], hits, "rules", tuple(degraded), sur,
                         family)
        return Score(node, ts, score, thr, learned_alarm, top, [], "model", tuple(degraded), sur, family)

    def observe(self, ts: float, node: str, metrics: dict[str, float]) -> Score:
        """Scores one sample of one node.

        Args:
            ts: sample time, Unix seconds (must increase per node).
            node: node name.
            metrics: the sample (flat metric name -> value; NaN for a value that could not be read).

        Returns:
            The score. Peer features are missing here (see :meth:`observe_many`).

        Raises:
            DataFormatError: time not increasing, non-numeric or infinite value.
            FeatureMismatchError: a model metric is absent and the policy is ``"error"``.
        """
        ts = _as_time(ts, node)
        self._check_sample(ts, node, metrics)
        self._last_ts[node] = ts
        hits = self.rules.evaluate(ts, node, metrics)
        if self.model is None:
            return Score(node, ts, 1.0 if hits else 0.0, 1.0, bool(hits),
                         [(f"rule:{h.rule}", 1.0) for h in hits], hits, "rules")
        degraded: list[str] = []
        spec = self.model.spec
        node_row = self._node_row(ts, node, metrics, degraded)
        row = np.full(len(spec.feature_names), np.nan)
        row[: len(node_row)] = node_row
        if spec.config.peer:
            degraded.append("peer features missing (single-node observe; use observe_many with the job's nodes)")
        return self._finish(ts, node, row.astype(np.float32).astype(np.float64), hits, degraded)

    def observe_many(self, ts: float, samples: dict[str, dict[str, float]],
                     node_ts: dict[str, float] | None = None) -> dict[str, Score]:
        """Scores one interval of several nodes of one job, with peer z-scores across them.

        Args:
            ts: interval time, Unix seconds.
            samples: node -> sample.
            node_ts: node -> its own sample time, where nodes' clocks or collection times differ within the
                interval (default ``ts`` for every node); each node's features and threshold use its own.

        Returns:
            node -> score. With fewer than 3 nodes, peer features stay missing (as in training) and each
            score's ``degraded`` says so.

        Raises:
            DataFormatError, FeatureMismatchError: as :meth:`observe`.
        """
        out: dict[str, Score] = {}
        at = {n: _as_time(ts if node_ts is None else node_ts.get(n, ts), n) for n in samples}
        nodes = list(samples)
        for n in nodes:  # every node's sample before any state changes: one refused sample refuses the round
            self._check_sample(at[n], n, samples[n])
        if self.model is None:
            return {n: self.observe(at[n], n, m) for n, m in samples.items()}
        spec = self.model.spec
        self._last_ts.update(at)
        hits = {n: self.rules.evaluate(at[n], n, samples[n]) for n in nodes}
        degraded = {n: [] for n in nodes}  # type: dict[str, list[str]]
        rows = np.full((len(nodes), len(spec.feature_names)), np.nan)
        n_node = len(spec.node_feature_names)
        for k, n in enumerate(nodes):
            rows[k, :n_node] = self._node_row(at[n], n, samples[n], degraded[n])
        if spec.config.peer:
            rows32 = rows.astype(np.float32)
            rows[:, n_node:] = peer_z(rows32[:, spec.peer_base_columns].astype(np.float64), np.zeros(len(nodes), np.int64))
            if len(nodes) < 3:
                for n in nodes:
                    degraded[n].append("peer features missing (fewer than 3 nodes)")
        rows = rows.astype(np.float32).astype(np.float64)
        for k, n in enumerate(nodes):
            out[n] = self._finish(at[n], n, rows[k], hits[n], degraded[n])
        return out
