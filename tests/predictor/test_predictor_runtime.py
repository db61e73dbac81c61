"""Online runtime: tiers, degradation policies, refusals, and agreement with the evaluation pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from trainguard.predictor.errors import DataFormatError, FeatureMismatchError
from trainguard.predictor.runtime import PredictorRuntime


def _sample(trace, i):
    m = trace.metrics
    return float(m.ts[i]), str(m.node[i]), dict(zip(m.columns, m.values[i].tolist()))


def test_rule_hit_is_an_immediate_alarm(hgb_model, small_trace):
    rt = PredictorRuntime(hgb_model)
    ts, node, smp = _sample(small_trace, 0)
    assert rt.observe(ts, node, smp).source == "model"
    s = rt.observe(ts + 60, node, {**smp, "gpu_xid_79_total": smp["gpu_xid_79_total"] + 1})
    assert s.alarm and s.score == 1.0 and s.source == "rules"
    assert s.top_features[0] == ("rule:xid79-fell-off-bus", 1.0)


def test_missing_metric_policy(hgb_model, small_trace):
    ts, node, smp = _sample(small_trace, 0)
    partial = {k: v for k, v in smp.items() if k != "gpu_temp_c"}
    with pytest.raises(FeatureMismatchError, match="gpu_temp_c"):
        PredictorRuntime(hgb_model).observe(ts, node, partial)
    with pytest.raises(FeatureMismatchError, match="gpu_temp_c"):
        PredictorRuntime(hgb_model).check_metrics(list(partial))
    rt = PredictorRuntime(hgb_model, missing="nan")
    s = rt.observe(ts, node, partial)
    assert any("gpu_temp_c" in d for d in s.degraded) and 0.0 <= s.score <= 1.0
    assert rt.check_metrics(list(partial)) == ["gpu_temp_c"]


def test_bad_samples_are_refused(hgb_model, small_trace):
    rt = PredictorRuntime(hgb_model)
    ts, node, smp = _sample(small_trace, 0)
    rt.observe(ts, node, smp)
    with pytest.raises(DataFormatError, match="not after"):
        rt.observe(ts, node, smp)
    with pytest.raises(DataFormatError, match="non-numeric"):
        rt.observe(ts + 60, node, {**smp, "gpu_temp_c": "hot"})
    with pytest.raises(DataFormatError, match="infinite"):
        rt.observe(ts + 60, node, {**smp, "gpu_temp_c": float("inf")})
    # a NaN value is a normal missing reading, and unknown metric names are ignored
    s = rt.observe(ts + 60, node, {**smp, "gpu_temp_c": float("nan"), "brand_new_metric": 3.0})
    assert s.source == "model" and not s.degraded


def test_single_node_observe_on_a_peer_model_says_it_is_degraded(small_trace):
    from trainguard.predictor.evaluation import EvalConfig
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.training import TrainConfig, train

    sub = small_trace.metrics.select_rows(small_trace.metrics.ts < small_trace.metrics.ts.min() + 12 * 3600)
    model = train(sub, None, TrainConfig(features=FeatureConfig(interval_s=60.0), evaluation=EvalConfig()))
    assert model.kind == "robust-z"  # no events: unsupervised
    ts, node, smp = _sample(small_trace, 0)
    s = PredictorRuntime(model).observe(ts, node, smp)
    assert any("peer" in d for d in s.degraded)


def test_alarms_come_with_evidence_and_precursors_score_higher(hgb_model, small_trace):
    from trainguard.predictor.training import score_table

    frame, score = score_table(hgb_model, small_trace.metrics)
    nd = frame.node.astype(str)
    in_window = np.zeros(len(score), dtype=bool)
    for f in small_trace.faults:
        if f.predictable:
            in_window |= (nd == f.node) & (frame.ts >= f.ts - 1800) & (frame.ts <= f.ts - 120)
    assert in_window.sum() > 20
    # the model was trained on this trace: a functional check that the pipeline carries signal end to end
    assert np.median(score[in_window]) > np.percentile(score[~in_window], 90)
    row = frame.x[np.flatnonzero(in_window)[np.argmax(score[in_window])]]
    top = hgb_model.scorer.top_features(row.astype(np.float64), 3)
    assert top and all(c > 0 for _, c in top)


def test_a_timestamp_that_is_no_number_is_refused_as_data(hgb_model, small_trace):
    """``observe(None, ...)`` or a time text raised a bare TypeError ('must be real number, not NoneType') from the
    finiteness check, where a non-numeric metric value is a DataFormatError; a number given as text (as a CSV reader
    yields it) was a TypeError too, though such metric values are taken. Without a model (rules only) as well."""
    ts, node, smp = _sample(small_trace, 0)
    for rt in (PredictorRuntime(hgb_model), PredictorRuntime(None)):
        for bad in (None, "12:00", [ts]):
            with pytest.raises(DataFormatError, match="timestamp .* is not a number of Unix seconds"):
                rt.observe(bad, node, smp)  # type: ignore[arg-type]
            with pytest.raises(DataFormatError, match="is not a number of Unix seconds"):
                rt.observe_many(ts, {node: smp}, {node: bad})  # type: ignore[dict-item]
        s = rt.observe(str(ts), node, smp)  # type: ignore[arg-type]
        assert s.ts == ts and isinstance(s.ts, float)
        with pytest.raises(DataFormatError, match="not after the previous"):
            rt.observe(ts, node, smp)
        assert rt.observe(ts + 60, node, smp).ts == ts + 60


def test_rules_only_runtime_refuses_time_going_back_and_raises_no_second_xid_alarm():
    """Without a model file (rules tier only, as the agent runs with ``predictor.model = ""``) no timestamp was
    checked: a replayed stale sample (time back, the fatal counter at its older value) was taken, and the next
    current sample read the counter's old increase again, a second fatal XID 79 alarm for one event. The same
    timestamp twice was taken too. Both are refused as with a model, in ``observe_many`` before any node's."""
    rt = PredictorRuntime(None)
    assert rt.observe(100.0, "a", {"gpu_xid_79_total": 0.0}).alarm is False
    assert rt.observe(160.0, "a", {"gpu_xid_79_total": 1.0}).alarm is True  # the fault
    for t, v in ((40.0, 0.0), (160.0, 1.0)):
        with pytest.raises(DataFormatError, match="not after the previous 160.0"):
            rt.observe(t, "a", {"gpu_xid_79_total": v})
    assert rt.observe(220.0, "a", {"gpu_xid_79_total": 1.0}).alarm is False
    with pytest.raises(DataFormatError, match="node 'a': timestamp 220.0 is not after"):
        rt.observe_many(280.0, {"b": {"gpu_xid_79_total": 0.0}, "a": {"gpu_xid_79_total": 1.0}}, {"a": 220.0})
    assert rt.observe(280.0, "b", {"gpu_xid_79_total": 0.0}).alarm is False  # b's refused round left no state
    rt.forget("a")
    assert rt.observe(10.0, "a", {"gpu_xid_79_total": 0.0}).alarm is False  # a new node starts afresh
