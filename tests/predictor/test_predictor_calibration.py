"""Per-node online thresholds: the budget holds on scores never seen in training, online == offline, the
realised rate is reported live, and the node's own baseline (``_z`` features) agrees online and offline."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainguard.predictor.calibration import (
    CalibrationConfig, TailCalibrator, calibrate_series, calibrate_table, fit_tail,
)
from trainguard.predictor.evaluation import alarm_events
from trainguard.predictor.errors import PredictorError


def _alarms_per_day(ts, above, cooldown=1200.0, warmup=86400.0):
    ev = alarm_events(ts, above.astype(float), 0.5, cooldown)
    return len(ev) / ((ts[-1] - ts[0] - warmup) / 86400.0)


@pytest.mark.parametrize("dist", ["exponential", "pareto", "normal"])
def test_budget_holds_on_iid_scores_of_any_tail(dist):
    rng = np.random.default_rng(7)
    ts = np.arange(60 * 288) * 300.0  # 60 days at 5 min
    draw = {"exponential": lambda n: rng.exponential(size=n), "pareto": lambda n: np.log1p(rng.pareto(3.0, n)),
            "normal": rng.standard_normal}[dist]
    s = draw(len(ts))
    for budget in (0.2, 1.0):  # 12 and 59 alarms allowed: enough for the count to mean something
        thr, _ = calibrate_series(ts, s, CalibrationConfig.for_interval(300.0, budget))
        assert np.isinf(thr[: 288]).all()  # no alarm before a day of history
        rate = _alarms_per_day(ts, s >= thr)
        assert rate <= budget, (dist, budget, rate)


def test_threshold_follows_the_node_not_the_fleet():
    # two nodes whose scores differ by a constant: their thresholds differ by that constant
    rng = np.random.default_rng(1)
    ts = np.arange(5 * 1440) * 60.0
    base = rng.exponential(size=len(ts))
    cfg = CalibrationConfig.for_interval(60.0, 0.1)
    t1, _ = calibrate_series(ts, base, cfg)
    t2, _ = calibrate_series(ts, base + 3.0, cfg)
    warm = np.isfinite(t1)
    assert warm.any() and np.allclose(t2[warm] - t1[warm], 3.0)


def test_tail_fit_reads_quantiles_and_refuses_bad_config():
    x = np.random.default_rng(2).exponential(size=20000)
    fit = fit_tail(x, 1e-5, 0.05)  # far beyond the data: extrapolated, close to the exponential's quantile
    assert fit.threshold == pytest.approx(-math.log(1e-5), rel=0.15)
    sat = np.r_[np.random.default_rng(3).random(500), np.full(100, 50.0)]  # a score pinned at its maximum
    assert fit_tail(sat, 1e-5, 0.05).threshold > 50.0
    with pytest.raises(PredictorError, match="--budget"):
        CalibrationConfig(budget_per_day=0)
    cal = TailCalibrator(CalibrationConfig.for_interval(60.0, 0.1))
    assert cal.observe(0.0, 1.0)[0] == math.inf and not cal.warm


def _table(n_nodes=3, days=2.5, step=300.0, seed=0):
    from trainguard.predictor.table import MetricTable

    rng = np.random.default_rng(seed)
    n = int(days * 86400 / step)
    ts, nodes, vals = [], [], []
    for k in range(n_nodes):
        t = 1_700_000_000.0 + step * np.arange(n)
        level = 40 + 10 * k + rng.standard_normal(n) * (1 + k)
        level += 5 * np.sin(2 * np.pi * t / 86400.0)  # a daily pattern
        spikes = rng.random(n) < 0.01
        level[spikes] += 60 + rng.exponential(15, spikes.sum())
        cnt = np.cumsum(rng.poisson(0.2 + 0.1 * k, n)).astype(float)
        ts.append(t)
        nodes += [f"n{k}"] * n
        vals.append(np.column_stack([level, cnt]))
    return MetricTable(["cpu_pct", "errors_total"], np.concatenate(ts), np.array(nodes, object), np.vstack(vals))


@pytest.fixture(scope="module")
def model():
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.evaluation import EvalConfig
    from trainguard.predictor.training import TrainConfig, train

    table = _table(seed=0)
    fc = FeatureConfig.for_data(300.0, 2.5 * 86400, peer=False)
    return train(table, None, TrainConfig(method="robust-z", features=fc, per_family=True,
                                          evaluation=EvalConfig(budget_per_100_node_days=300.0)))


def test_online_scores_thresholds_and_alarms_equal_offline(model):
    from trainguard.predictor.runtime import PredictorRuntime
    from trainguard.predictor.training import calibration_scores, score_table

    assert model.spec.config.self_window_s > 0 and any(n.endswith("_z") for n in model.spec.feature_names)
    assert model.calibration is not None and model.calibration.budget_per_day == pytest.approx(3.0)
    table = _table(days=3.0, seed=5)  # other data than the training's
    frame, score = score_table(model, table)
    fam = calibration_scores(model, frame, score)  # one threshold per node and metric family
    assert model.calibration.per_family and [f for f, _ in model.spec.families] == ["errors", "cpu"]
    assert fam.shape == (len(score), 2)
    margin, _ = calibrate_table(frame.ts, frame.node, fam, model.calibration)
    rt = PredictorRuntime(model)
    online = {}
    for i in np.argsort(table.ts, kind="stable"):
        s = rt.observe(float(table.ts[i]), str(table.node[i]), dict(zip(table.columns, table.values[i].tolist())))
        online[(s.node, s.ts)] = s
    keys = list(zip(frame.node.tolist(), frame.ts.tolist()))
    on_score = np.array([online[k].score for k in keys])
    # the online score is the deciding family's (NaN while the baselines warm up reads 0, said in degraded)
    idx = np.array([["errors", "cpu"].index(online[k].family) for k in keys])
    expect = fam[np.arange(len(keys)), idx]
    assert np.allclose(on_score, np.nan_to_num(expect, nan=0.0), atol=1e-5)
    assert all("warming up" in " ".join(online[k].degraded) for k, e in zip(keys, expect) if np.isnan(e))
    on_alarm = np.array([online[k].alarm for k in keys])
    off_alarm = margin >= 0
    assert off_alarm.any() and (on_alarm != off_alarm).sum() <= 2  # rounding at the threshold only
    st = {x.node: x for x in rt.status()}
    assert set(st) == {"n0", "n1", "n2"} and all(x.calibrated for x in st.values())
    for node, x in st.items():
        sel = frame.node == node
        expect = len(alarm_events(frame.ts[sel], margin[sel], 0.0, model.eval_config.cooldown_s))
        assert abs(x.alarms - expect) <= 1 and x.budget_per_day == pytest.approx(3.0)
        assert x.alarms_per_day == pytest.approx(x.alarms / x.observed_days)
    assert rt.realised_alarms_per_day() == pytest.approx(
        sum(x.alarms for x in st.values()) / sum(x.observed_days for x in st.values()))


def test_saved_model_keeps_its_calibration(model, tmp_path):
    from trainguard.predictor.model import PredictorModel

    model.save(tmp_path / "m.json")
    back = PredictorModel.load(tmp_path / "m.json")
    assert back.calibration == model.calibration and back.spec == model.spec


def test_per_family_thresholds_keep_the_node_budget_and_hear_a_quiet_family():
    """Issue 19: calibrate per node AND metric family. Three families of one node, each with its own tail:
    each family's margin over its own threshold, and the node's threshold on the largest margin, keep the
    node's alarms within its budget; an incident in the quiet family, below the noisy family's usual tail, is
    heard, while one threshold over the node's overall score loses it under the noisy family's tail."""
    rng = np.random.default_rng(11)
    ts = np.arange(30 * 288) * 300.0  # 30 days at 5 min
    lo = np.column_stack([rng.exponential(2.0, len(ts)) + 2.0,  # a noisy family
                          rng.exponential(0.3, len(ts)),  # a quiet one
                          rng.standard_normal(len(ts))])  # a light-tailed one
    inc = (ts >= 20 * 86400.0) & (ts < 20 * 86400.0 + 3600.0)
    lo[inc, 1] += 6.0  # far out for the quiet family, ordinary for the noisy one (p99 of it is ~11)
    fam = 1.0 / (1.0 + np.exp(-lo))
    node = np.array(["a"] * len(ts), dtype=object)
    budget = 0.5
    cfg = CalibrationConfig.for_interval(300.0, budget, per_family=True)
    margin, sur = calibrate_table(ts, node, fam, cfg)
    quiet = ~inc
    rate = len(alarm_events(ts[quiet], margin[quiet], 0.0, 1200.0)) / ((ts[-1] - ts[0] - 86400.0) / 86400.0)
    assert rate <= budget, rate
    assert (margin[inc] >= 0).any()  # heard by the quiet family's own threshold
    single, _ = calibrate_table(ts, node, fam.max(axis=1), CalibrationConfig.for_interval(300.0, budget))
    assert not (single[inc] >= 0).any()  # lost under the node's one threshold over its overall score
    assert np.nanmax(sur[inc]) > np.nanmax(sur[quiet & (ts > 86400.0 * 2)]) - 1.0


def _noise_with_incidents(seed=4, days=40, every_days=3.0, height=6.0):
    """A node at 5 min: exponential noise, and a 3-hour incident (noise + ``height``) every ``every_days``."""
    rng = np.random.default_rng(seed)
    ts = np.arange(days * 288) * 300.0
    s = rng.exponential(size=len(ts))
    spans = []
    for start in np.arange(2.0, days - 0.5, every_days) * 86400.0:
        end = start + 3 * 3600.0
        s[(ts >= start) & (ts < end)] += height
        spans.append((float(start), float(end)))
    return ts, s, spans


def test_confirmed_incidents_leave_the_history_and_the_false_alarm_budget_holds():
    ts, s, spans = _noise_with_incidents()
    inside = np.zeros(len(ts), bool)
    for a, b in spans:
        inside |= (ts >= a) & (ts < b)
    budget = 1.0
    cfg = CalibrationConfig.for_interval(300.0, budget)
    alone, _ = calibrate_series(ts, s, cfg)
    fed, _ = calibrate_series(ts, s, cfg, incidents=[(a, b, b) for a, b in spans])  # known once each ends
    warm = np.isfinite(alone) & (ts > 9 * 86400.0)  # after the first week: incidents in every history
    # without feedback the node's own incidents set its threshold: above all of its noise, so the budget of
    # false alarms goes unused and an incident only a little above the noise would go unheard
    assert np.median(alone[warm]) > s[~inside].max()
    assert np.median(fed[warm]) < np.median(alone[warm]) - 2.0
    # with them fed back the threshold is fitted on the node's normal operation: false alarms (outside the
    # incidents) stay within the budget, which now counts false alarms only
    false = (s >= fed) & ~inside
    assert 0 < _alarms_per_day(ts, false) <= budget
    caught = sum(bool(((s >= fed) & (ts >= a) & (ts < b)).any()) for a, b in spans)
    assert caught == len([a for a, _ in spans if a > 86400.0])


def test_incident_known_later_changes_nothing_before_it_and_bad_spans_are_refused():
    ts, s, spans = _noise_with_incidents(days=12)
    cfg = CalibrationConfig.for_interval(300.0, 1.0)
    alone, _ = calibrate_series(ts, s, cfg)
    known = spans[1][1] + 86400.0  # confirmed a day after the incident ended
    fed, _ = calibrate_series(ts, s, cfg, incidents=[(spans[1][0], spans[1][1], known)])
    assert np.array_equal(alone[ts < known], fed[ts < known])  # no hindsight
    assert (fed[ts >= known] != alone[ts >= known]).any()  # and from then on it is out of the history
    cal = TailCalibrator(cfg)
    for bad in ((5.0, 1.0), (math.nan, 1.0), (0.0, math.inf)):
        with pytest.raises(PredictorError, match="incident span"):
            cal.exclude(*bad)


def test_runtime_record_incident_equals_offline_feedback(model):
    from trainguard.predictor.runtime import PredictorRuntime
    from trainguard.predictor.training import calibration_scores, score_table

    table = _table(days=3.0, seed=5)
    frame, score = score_table(model, table)
    fam = calibration_scores(model, frame, score)
    t_fail = float(table.ts.min()) + 2.3 * 86400.0  # n1 fails; its next day is scored with the feedback
    span = (t_fail - model.eval_config.early_s, t_fail)
    margin, _ = calibrate_table(frame.ts, frame.node, fam, model.calibration, {"n1": [(*span, t_fail)]})
    alone, _ = calibrate_table(frame.ts, frame.node, fam, model.calibration)
    after = (frame.node == "n1") & (frame.ts > t_fail + 3600.0)
    assert (margin[after] != alone[after]).any()  # the feedback matters here
    rt = PredictorRuntime(model)
    online = {}
    fed = False
    for i in np.argsort(table.ts, kind="stable"):
        if not fed and table.ts[i] >= t_fail:
            rt.record_incident("n1", *span)
            fed = True
        s = rt.observe(float(table.ts[i]), str(table.node[i]), dict(zip(table.columns, table.values[i].tolist())))
        online[(s.node, s.ts)] = s
    keys = list(zip(frame.node.tolist(), frame.ts.tolist()))
    on_alarm = np.array([online[k].alarm for k in keys])
    assert (on_alarm != (margin >= 0)).sum() <= 2  # rounding at the threshold only
    rt.record_incident("nobody-seen", *span)  # a node without history: nothing to take out, no error


def test_status_takes_node_names_that_are_not_strings(model):
    """API callers name nodes by rank number too; ``status()`` sorted the names and raised TypeError as soon
    as a number and a string (or None) were both among them."""
    from trainguard.predictor.runtime import PredictorRuntime

    table = _table(n_nodes=1, days=0.1, seed=2)
    rt = PredictorRuntime(model)
    for i in range(len(table.ts)):
        smp = dict(zip(table.columns, table.values[i].tolist()))
        for node in ("n1", 3, None, 1, "n0"):
            rt.observe(float(table.ts[i]), node, smp)  # type: ignore[arg-type]
    assert [s.node for s in rt.status()] == ["n0", "n1", 1, 3, None]
