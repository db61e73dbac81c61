"""Scorers: features in, a risk score in [0, 1] out, plus each feature's contribution to a row's score.

Three kinds, registered by name in :data:`SCORERS` and stored as plain numbers (JSON), never pickles:

- ``hgb``: a scikit-learn ``HistGradientBoostingClassifier`` trained for "hard failure within H", exported to
  flat arrays (split feature, threshold, NaN direction, children, leaf values) and evaluated here; the score
  is the predicted probability. Contributions follow each tree's decision path (Saabas): the change of the
  expected value at each split is credited to the split's feature, so they add up to the raw margin.
- ``robust-z``: unsupervised. Per feature, ``z = (x - median) / (1.4826 MAD)`` against the training rows;
  the raw score is the mean of the three largest ``|z|`` and the score is ``raw / (raw + k)`` with ``k`` the
  99.9th percentile of raw training scores. A sparse feature (MAD 0) takes its scale from its 99.9th-percentile
  deviation / 3.29. Contributions are the ``|z|`` values. Only *scored* features count: never the telemetry
  health ones (a gap is missing data, reported as such, not an anomaly to score), and, when the features
  include the scale-free ``_z``/``peer_z`` ones, only those (raw levels of one fleet mean nothing on another).
- ``threshold``: the plain baseline. Each counter rate and gauge level divided by its 99.9th training
  percentile (a counter rate's limit is at least one event per 5 minutes); the score is ``r / (1 + r)`` of
  the largest ratio ``r``.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from trainguard.predictor.errors import ModelFileError

Contribution = tuple[str, float]


class Scorer(abc.ABC):
    """Maps feature rows to risk scores in [0, 1]."""

    kind: ClassVar[str]

    def __init__(self, feature_names: list[str]) -> None:
        self.feature_names = list(feature_names)

    @abc.abstractmethod
    def score(self, x: np.ndarray) -> np.ndarray:
        """Scores rows.

        Args:
            x: features, shape (n, len(feature_names)); NaN is a missing value.

        Returns:
            Scores in [0, 1], shape (n,).
        """

    @abc.abstractmethod
    def contributions(self, row: np.ndarray) -> np.ndarray:
        """Per-feature contribution to one row's score (larger = more alarming), shape (len(feature_names),)."""

    @abc.abstractmethod
    def to_params(self) -> dict[str, Any]:
        """JSON-ready parameters."""

    @classmethod
    @abc.abstractmethod
    def from_params(cls, feature_names: list[str], params: dict[str, Any]) -> "Scorer":
        """Inverse of :meth:`to_params`.

        Raises:
            ModelFileError: the parameters are malformed.
        """

    def family_scores(self, x: np.ndarray, groups: list[list[int]]) -> np.ndarray | None:
        """One score per group of feature columns (a metric family), shape (n, len(groups)), on the same
        scale as :meth:`score`; None when the scorer has no per-family score (a tree ensemble's score is
        one joint function of all features)."""
        return None

    def top_features(self, row: np.ndarray, k: int = 5) -> list[Contribution]:
        """The ``k`` features contributing most to one row's score, largest first.

        Args:
            row: one feature row.
            k: how many.

        Returns:
            ``[(feature name, contribution), ...]``, positive contributions only.
        """
        c = self.contributions(row)
        order = np.argsort(-c, kind="stable")[:k]
        return [(self.feature_names[i], round(float(c[i]), 4)) for i in order if c[i] > 0]


def _arr(params: dict[str, Any], key: str, dtype: Any) -> np.ndarray:
    try:
        return np.asarray(params[key], dtype=dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"model parameter {key!r} is missing or malformed; retrain and save the model") from exc


class TreeEnsembleScorer(Scorer):
    """Gradient-boosted binary classifier evaluated from flat arrays (see the module docstring)."""

    kind = "hgb"

    def __init__(self, feature_names: list[str], baseline: float, trees: list[dict[str, np.ndarray]]) -> None:
        super().__init__(feature_names)
        self.baseline = float(baseline)
        self.trees = trees
        for t in trees:
            if "expected" not in t:
                t["expected"] = self._expected(t)

    @staticmethod
    def _expected(t: dict[str, np.ndarray]) -> np.ndarray:
        """Count-weighted mean leaf value under each node (for path contributions)."""
        value = t["value"].astype(np.float64).copy()
        count = t["count"].astype(np.float64)
        leaf = t["is_leaf"].astype(bool)
        # children have larger indices than parents in sklearn's layout: one reverse pass suffices
        for i in range(len(value) - 1, -1, -1):
            if not leaf[i]:
                l, r = int(t["left"][i]), int(t["right"][i])
                w = count[l] + count[r]
                value[i] = (value[l] * count[l] + value[r] * count[r]) / w if w > 0 else 0.5 * (value[l] + value[r])
        return value

    @classmethod
    def from_sklearn(cls, clf: Any, feature_names: list[str]) -> "TreeEnsembleScorer":
        """Exports a fitted ``HistGradientBoostingClassifier`` (binary, numeric features only).

        Raises:
            ModelFileError: the classifier is not binary or uses categorical splits.
        """
        if len(getattr(clf, "classes_", [])) != 2:
            raise ModelFileError("only binary classifiers can be exported; train on failure/no-failure labels")
        trees = []
        for (pred,) in clf._predictors:  # one predictor per iteration for binary classification
            nodes = pred.nodes
            if nodes["is_categorical"].any():
                raise ModelFileError("categorical splits cannot be exported; train on numeric features only")
            trees.append({
                "feature": nodes["feature_idx"].astype(np.int32), "threshold": nodes["num_threshold"].astype(np.float64),
                "missing_left": nodes["missing_go_to_left"].astype(bool), "left": nodes["left"].astype(np.int32),
                "right": nodes["right"].astype(np.int32), "value": nodes["value"].astype(np.float64),
                "count": nodes["count"].astype(np.int64), "is_leaf": nodes["is_leaf"].astype(bool),
            })
        return cls(feature_names, float(np.ravel(clf._baseline_prediction)[0]), trees)

    def raw(self, x: np.ndarray) -> np.ndarray:
        """Margins (log-odds) of rows, shape (n,)."""
        x = np.asarray(x, dtype=np.float64)
        n = x.shape[0]
        out = np.full(n, self.baseline)
        rows = np.arange(n)
        for t in self.trees:
            idx = np.zeros(n, dtype=np.int64)
            leaf, feat, thr = t["is_leaf"], t["feature"], t["threshold"]
            ml, left, right = t["missing_left"], t["left"], t["right"]
            active = ~leaf[idx]
            while active.any():
                a = rows[active]
                node = idx[a]
                v = x[a, feat[node]]
                go_left = np.where(np.isnan(v), ml[node], v <= thr[node])
                idx[a] = np.where(go_left, left[node], right[node])
                active[a] = ~leaf[idx[a]]
            out += t["value"][idx]
        return out

    def score(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.raw(x)))

    def contributions(self, row: np.ndarray) -> np.ndarray:
        row = np.asarray(row, dtype=np.float64).ravel()
        contrib = np.zeros(len(self.feature_names))
        for t in self.trees:
            i = 0
            leaf, feat, thr, ml = t["is_leaf"], t["feature"], t["threshold"], t["missing_left"]
            exp = t["expected"]
            while not leaf[i]:
                f = int(feat[i])
                v = row[f]
                nxt = int(t["left"][i] if (ml[i] if np.isnan(v) else v <= thr[i]) else t["right"][i])
                contrib[f] += exp[nxt] - exp[i]
                i = nxt
        return contrib

    def to_params(self) -> dict[str, Any]:
        keys = ("feature", "threshold", "missing_left", "left", "right", "value", "count", "is_leaf")
        return {
            "baseline": self.baseline,
            "trees": [{k: t[k].tolist() for k in keys} for t in self.trees],
        }

    @classmethod
    def from_params(cls, feature_names: list[str], params: dict[str, Any]) -> "TreeEnsembleScorer":
        trees = []
        n_f = len(feature_names)
        try:
            raw_trees = list(params["trees"])
            baseline = float(params["baseline"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError("tree model lacks 'trees' or 'baseline'; retrain and save the model") from exc
        for t in raw_trees:
            tree = {
                "feature": _arr(t, "feature", np.int32), "threshold": _arr(t, "threshold", np.float64),
                "missing_left": _arr(t, "missing_left", bool), "left": _arr(t, "left", np.int32),
                "right": _arr(t, "right", np.int32), "value": _arr(t, "value", np.float64),
                "count": _arr(t, "count", np.int64), "is_leaf": _arr(t, "is_leaf", bool),
            }
            m = len(tree["value"])
            inner = ~tree["is_leaf"]
            if (
                any(len(v) != m for v in tree.values()) or m == 0
                or (inner.any() and (tree["feature"][inner].min() < 0 or tree["feature"][inner].max() >= n_f))
                or (inner.any() and (tree["left"][inner].max() >= m or tree["right"][inner].max() >= m))
                or (inner.any() and ((tree["left"][inner] <= np.flatnonzero(inner)).any()
                                     or (tree["right"][inner] <= np.flatnonzero(inner)).any()))
            ):
                raise ModelFileError("a tree in the model file is inconsistent (bad child or feature index); retrain")
            trees.append(tree)
        return cls(feature_names, baseline, trees)


class RobustZScorer(Scorer):
    """Unsupervised robust z-score scorer (see the module docstring)."""

    kind = "robust-z"
    TOP_K = 3
    Z_CLIP = 1e4

    def __init__(self, feature_names: list[str], median: np.ndarray, scale: np.ndarray, k: float,
                 scored: np.ndarray | None = None) -> None:
        super().__init__(feature_names)
        self.median = np.asarray(median, dtype=np.float64)
        self.scale = np.asarray(scale, dtype=np.float64)
        self.k = float(k)
        self.scored = np.asarray(scored if scored is not None else self.default_scored(feature_names), dtype=bool)

    @staticmethod
    def default_scored(feature_names: list[str]) -> np.ndarray:
        """Which features count in the score (see the module docstring)."""
        names = list(feature_names)
        if any(n.endswith("_rz") for n in names):  # the robust long baseline supersedes the EW one
            return np.array([n.endswith(("_rz", ".peer_z")) for n in names], dtype=bool)
        free = np.array([n.endswith(("_z", ".peer_z")) for n in names], dtype=bool)
        if free.any():
            return free
        return np.array([not n.startswith("telemetry.") for n in names], dtype=bool)

    @classmethod
    def fit(cls, feature_names: list[str], x: np.ndarray) -> "RobustZScorer":
        """Fits medians and scales on (mostly healthy) rows.

        Args:
            feature_names: column names.
            x: training features, shape (n, F).
        """
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nan_to_num(np.nanmedian(x, axis=0), nan=0.0)
            mad = np.nan_to_num(np.nanmedian(np.abs(x - med), axis=0), nan=0.0)
            sub = x[:: max(1, len(x) // 200_000)]
            dev999 = np.nan_to_num(np.nanpercentile(np.abs(sub - med), 99.9, axis=0), nan=0.0)
        # sparse features (a counter at rest, a rare telemetry gap) have MAD 0: their scale is at least their
        # 99.9th-percentile deviation / 3.29 (where a normal puts it), so one benign blip is not z = 1000
        scale = np.maximum.reduce([1.4826 * mad, dev999 / 3.29, 0.01 * np.abs(med), np.full_like(med, 1e-3)])
        tmp = cls(feature_names, med, scale, 1.0)
        raw = tmp._raw(x[:: max(1, len(x) // 200_000)])
        k = float(np.percentile(raw, 99.9)) if len(raw) else 1.0
        return cls(feature_names, med, scale, max(k, 1e-6))

    def _z(self, x: np.ndarray) -> np.ndarray:
        z = np.abs((np.asarray(x, dtype=np.float64) - self.median) / self.scale)
        return np.minimum(np.nan_to_num(z, nan=0.0), self.Z_CLIP)

    def _raw(self, x: np.ndarray) -> np.ndarray:
        z = self._z(x)[:, self.scored]
        k = min(self.TOP_K, z.shape[1])
        return np.partition(z, z.shape[1] - k, axis=1)[:, -k:].mean(axis=1)

    def score(self, x: np.ndarray) -> np.ndarray:
        """Scores in [0, 1]; NaN for a row with no scored feature known yet (e.g. a node's baselines still
        warming up): no evidence is not a score of 0, and a self-calibrated threshold must not learn from it."""
        x = np.asarray(x, dtype=np.float64)
        raw = self._raw(x)
        out = raw / (raw + self.k)
        unknown = np.isnan(x[:, self.scored]).all(axis=1) if self.scored.any() else np.zeros(len(x), dtype=bool)
        return np.where(unknown, np.nan, out)

    def contributions(self, row: np.ndarray) -> np.ndarray:
        return np.where(self.scored, self._z(np.asarray(row, dtype=np.float64).reshape(1, -1))[0], 0.0)

    def family_scores(self, x: np.ndarray, groups: list[list[int]]) -> np.ndarray | None:
        """The score restricted to each group's scored features (top-k mean, same ``k`` normaliser)."""
        x = np.asarray(x, dtype=np.float64)
        z = self._z(x)
        out = np.full((len(x), len(groups)), np.nan)
        for g, cols in enumerate(groups):
            c = [i for i in cols if self.scored[i]]
            if not c:
                continue
            zz = z[:, c]
            k = min(self.TOP_K, len(c))
            raw = np.partition(zz, len(c) - k, axis=1)[:, -k:].mean(axis=1)
            out[:, g] = np.where(np.isnan(x[:, c]).all(axis=1), np.nan, raw / (raw + self.k))
        return out

    def to_params(self) -> dict[str, Any]:
        return {"median": self.median.tolist(), "scale": self.scale.tolist(), "k": self.k,
                "scored": self.scored.tolist()}

    @classmethod
    def from_params(cls, feature_names: list[str], params: dict[str, Any]) -> "RobustZScorer":
        med, scale = _arr(params, "median", np.float64), _arr(params, "scale", np.float64)
        if len(med) != len(feature_names) or len(scale) != len(feature_names) or (scale <= 0).any():
            raise ModelFileError("robust-z parameters do not match the feature list; retrain and save the model")
        scored = params.get("scored")
        if scored is not None and len(scored) != len(feature_names):
            raise ModelFileError("robust-z 'scored' mask does not match the feature list; retrain and save the model")
        return cls(feature_names, med, scale, float(params.get("k", 1.0)),
                   None if scored is None else np.asarray(scored, dtype=bool))


class ThresholdScorer(Scorer):
    """Plain per-metric threshold baseline (see the module docstring)."""

    kind = "threshold"
    QUANTILE = 99.9

    def __init__(self, feature_names: list[str], columns: np.ndarray, limits: np.ndarray) -> None:
        super().__init__(feature_names)
        self.columns = np.asarray(columns, dtype=np.int64)
        self.limits = np.asarray(limits, dtype=np.float64)

    @classmethod
    def fit(cls, feature_names: list[str], x: np.ndarray, min_rate: float = 0.2) -> "ThresholdScorer":
        """Sets each watched feature's limit to its 99.9th percentile on (mostly healthy) rows.

        Args:
            feature_names: column names.
            x: training rows.
            min_rate: smallest limit of a counter rate, per minute (default 0.2: one event per 5-minute
                window), so a counter that is almost always at rest does not alarm on its first event.
        """
        cols = [i for i, n in enumerate(feature_names) if n.endswith((".rate_s", ".level"))]
        sub = np.abs(x[:, cols].astype(np.float64))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            q = np.nan_to_num(np.nanpercentile(sub, cls.QUANTILE, axis=0), nan=0.0)
        floor = np.array([min_rate if feature_names[c].endswith(".rate_s") else 1e-3 for c in cols])
        return cls(feature_names, np.array(cols), np.maximum(q, floor))

    def _ratio(self, x: np.ndarray) -> np.ndarray:
        return np.nan_to_num(np.abs(np.asarray(x, dtype=np.float64)[:, self.columns]) / self.limits, nan=0.0)

    def score(self, x: np.ndarray) -> np.ndarray:
        r = self._ratio(x).max(axis=1)
        return r / (1.0 + r)

    def contributions(self, row: np.ndarray) -> np.ndarray:
        out = np.zeros(len(self.feature_names))
        out[self.columns] = self._ratio(np.asarray(row).reshape(1, -1))[0]
        return out

    def family_scores(self, x: np.ndarray, groups: list[list[int]]) -> np.ndarray | None:
        """The largest ratio among each group's watched features, as ``r / (1 + r)``."""
        r = self._ratio(x)
        out = np.full((len(r), len(groups)), np.nan)
        pos = {int(c): j for j, c in enumerate(self.columns)}
        for g, cols in enumerate(groups):
            j = [pos[c] for c in cols if c in pos]
            if j:
                m = r[:, j].max(axis=1)
                out[:, g] = m / (1.0 + m)
        return out

    def to_params(self) -> dict[str, Any]:
        return {"columns": self.columns.tolist(), "limits": self.limits.tolist()}

    @classmethod
    def from_params(cls, feature_names: list[str], params: dict[str, Any]) -> "ThresholdScorer":
        cols, lim = _arr(params, "columns", np.int64), _arr(params, "limits", np.float64)
        if len(cols) != len(lim) or (len(cols) and (cols.min() < 0 or cols.max() >= len(feature_names))):
            raise ModelFileError("threshold parameters do not match the feature list; retrain and save the model")
        return cls(feature_names, cols, lim)


def family_scores(scorer: Scorer, families: list[tuple[str, list[int]]], x: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Scores per metric family for per-(node, family) thresholds.

    Args:
        scorer: the model's scorer.
        families: ``[(family, feature columns), ...]`` (:attr:`~.features.FeatureSpec.families`).
        x: feature rows, shape (n, F).

    Returns:
        ``(family names, scores of shape (n, len(names)))``: the families with a scored feature; a single
        ``"all"`` column holding :meth:`Scorer.score` when there are fewer than two or the scorer has no
        per-family score.
    """
    x = np.asarray(x, dtype=np.float64)
    if len(families) >= 2:
        fs = scorer.family_scores(x, [cols for _, cols in families])
        if fs is not None:
            keep = [g for g in range(fs.shape[1]) if _has_scored(scorer, families[g][1])]  # fixed by the model
            if len(keep) >= 2:
                return [families[g][0] for g in keep], fs[:, keep]
    return ["all"], scorer.score(x).reshape(-1, 1)


def _has_scored(scorer: Scorer, cols: list[int]) -> bool:
    scored = getattr(scorer, "scored", None)
    if scored is not None:
        return bool(np.asarray(scored)[cols].any())
    return bool(set(cols) & set(np.asarray(getattr(scorer, "columns", [])).tolist()))


#: Scorer kinds by name.
SCORERS: dict[str, type[Scorer]] = {c.kind: c for c in (TreeEnsembleScorer, RobustZScorer, ThresholdScorer)}
