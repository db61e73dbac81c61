"""Model files: JSON only, checksummed, HMAC-signed on request; the exported trees equal scikit-learn."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from trainguard.predictor.errors import ModelFileError
from trainguard.predictor.features import FeatureConfig, FeatureSpec
from trainguard.predictor.model import KEY_ENV, PredictorModel
from trainguard.predictor.scorers import RobustZScorer, TreeEnsembleScorer


def test_exported_trees_match_sklearn_and_contributions_add_up():
    from sklearn.ensemble import HistGradientBoostingClassifier
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 4)).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = np.nan
    y = ((np.nan_to_num(x[:, 0]) + 0.5 * np.nan_to_num(x[:, 2], nan=2.0)) > 1.0).astype(int)
    # One OpenMP thread, as predictor.training fits: on 2 loaded cores OpenMP's spinning threads made this fit
    # and predict_proba take seconds (measured 0.38 s vs 0.02 s for the fit alone at load 8).
    with threadpool_limits(limits=1):
        clf = HistGradientBoostingClassifier(max_iter=30, max_leaf_nodes=8, random_state=0).fit(x, y)
        expected = clf.predict_proba(x)[:, 1]
    sc = TreeEnsembleScorer.from_sklearn(clf, ["a", "b", "c", "d"])
    np.testing.assert_allclose(sc.score(x), expected, rtol=1e-9, atol=1e-12)
    row = x[5].astype(np.float64)
    expected0 = sc.baseline + sum(t["expected"][0] for t in sc.trees)
    assert expected0 + sc.contributions(row).sum() == pytest.approx(sc.raw(row.reshape(1, -1))[0])


def _model():
    spec = FeatureSpec(("gpu_temp_c",), FeatureConfig(interval_s=60.0, peer=False))
    x = np.random.default_rng(1).normal(size=(500, len(spec.feature_names)))
    return PredictorModel(spec, RobustZScorer.fit(spec.feature_names, x), 0.8, training_summary={"rows": 500})


def test_round_trip(tmp_path, hgb_model):
    p = tmp_path / "m.json"
    size = hgb_model.save(p)
    assert size == p.stat().st_size
    back = PredictorModel.load(p)
    assert back.threshold == hgb_model.threshold and back.spec == hgb_model.spec
    assert back.training_summary["method"] == "hgb"
    x = np.random.default_rng(0).normal(size=(50, len(back.spec.feature_names)))
    np.testing.assert_array_equal(back.scorer.score(x), hgb_model.scorer.score(x))


def test_tampered_truncated_and_foreign_files_are_refused(tmp_path):
    p = tmp_path / "m.json"
    _model().save(p)
    doc = json.loads(p.read_text())
    doc["payload"]["threshold"] = 0.1
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ModelFileError, match="checksum"):
        PredictorModel.load(bad)
    trunc = tmp_path / "trunc.json"
    trunc.write_bytes(p.read_bytes()[:-20])
    with pytest.raises(ModelFileError, match="not a JSON"):
        PredictorModel.load(trunc)
    pk = tmp_path / "model.pkl"
    pk.write_bytes(pickle.dumps({"payload": 1}))
    with pytest.raises(ModelFileError, match="not a JSON"):
        PredictorModel.load(pk)
    with pytest.raises(ModelFileError, match="cannot read"):
        PredictorModel.load(tmp_path / "absent.json")


def test_hmac_signature(tmp_path, monkeypatch):
    p = tmp_path / "m.json"
    _model().save(p, key="s3cret")
    PredictorModel.load(p, key="s3cret")
    PredictorModel.load(p)  # no key configured: checksum only
    with pytest.raises(ModelFileError, match="HMAC"):
        PredictorModel.load(p, key="other")
    monkeypatch.setenv(KEY_ENV, "other")
    with pytest.raises(ModelFileError, match="HMAC"):
        PredictorModel.load(p)
    unsigned = tmp_path / "u.json"
    monkeypatch.delenv(KEY_ENV)
    _model().save(unsigned)
    with pytest.raises(ModelFileError, match="HMAC"):
        PredictorModel.load(unsigned, key="s3cret")


def test_inconsistent_tree_is_refused(tmp_path, hgb_model):
    import hashlib

    from trainguard.predictor.model import _canonical

    p = tmp_path / "m.json"
    hgb_model.save(p)
    doc = json.loads(p.read_text())
    doc["payload"]["params"]["trees"][0]["left"][0] = 10**6
    doc["sha256"] = hashlib.sha256(_canonical(doc["payload"])).hexdigest()  # consistent checksum, bad content
    p.write_text(json.dumps(doc))
    with pytest.raises(ModelFileError, match="inconsistent"):
        PredictorModel.load(p)
