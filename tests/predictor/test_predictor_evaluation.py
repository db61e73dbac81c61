"""Event-level evaluation on hand-made scores: hits, late/early/false alarms, lead time, calibration."""

from __future__ import annotations

import numpy as np
import pytest

from trainguard.predictor.evaluation import (
    EvalConfig, alarm_events, calibrate_threshold, evaluate_events, labels_for, node_days,
)

EV = EvalConfig(horizon_s=1800, min_lead_s=120, cooldown_s=1200, early_s=14400, budget_per_100_node_days=1.0)
DAY = 86400.0


def test_alarm_events_fire_on_rise_and_repeat_while_high():
    ts = np.arange(0, 7200, 60.0)
    s = np.zeros(len(ts))
    s[10:62] = 1.0  # high from t=600 to 3660: fires at 600, repeats at 1800 and 3000
    s[65:67] = 1.0  # blip at 3900 s, 900 s after the last event: suppressed by the cooldown
    s[80] = 1.0  # blip at 4800 s: fires
    ev = alarm_events(ts, s, 0.5, 1200.0)
    np.testing.assert_array_equal(ev, [600.0, 1800.0, 3000.0, 4800.0])
    assert len(alarm_events(ts, s, 2.0, 1200.0)) == 0


def _one_node(scores_at: dict[float, float], days: float = 2.0):
    ts = np.arange(0, days * DAY, 60.0)
    s = np.zeros(len(ts))
    for t, v in scores_at.items():
        s[int(t // 60)] = v
    return ts, np.full(len(ts), "n", dtype=object), s


def test_event_classes_and_lead_time():
    f = 1.5 * DAY
    ts, node, s = _one_node({f - 1500: 1.0, f - 60: 1.0, f - 3 * 3600: 1.0, 0.3 * DAY: 1.0})
    rep = evaluate_events(ts, node, s, 0.5, {"n": np.array([f])}, EV, 60.0)
    assert (rep.hits, rep.late, rep.early, rep.false_alarms) == (1, 1, 1, 1)
    assert rep.failures == 1 and rep.caught == 1 and rep.lead_times_s == [1500.0]
    assert rep.precision == pytest.approx(0.25)
    assert rep.false_alarms_per_100_node_days == pytest.approx(100 / 2.0, rel=0.01)


def test_alarm_too_late_or_too_early_is_a_miss():
    f = 1.5 * DAY
    for t in (f - 60, f - 2 * 3600):
        ts, node, s = _one_node({t: 1.0})
        rep = evaluate_events(ts, node, s, 0.5, {"n": np.array([f])}, EV, 60.0)
        assert rep.caught == 0 and rep.failures == 1 and rep.false_alarms == 0


def test_failure_before_observation_is_not_counted():
    ts, node, s = _one_node({})
    rep = evaluate_events(ts, node, s, 0.5, {"n": np.array([600.0])}, EV, 60.0)
    assert rep.failures == 0


def test_labels():
    ts = np.arange(0, 7200, 60.0)
    y = labels_for(ts, np.full(len(ts), "n", dtype=object), {"n": np.array([3600.0])}, EV)
    assert y[ts == 1800].item() == 1 and y[ts == 3480].item() == 1
    assert y[ts == 3540].item() == -1 and y[ts == 1740].item() == 0 and y[ts == 3660].item() == 0


def test_node_days_skip_long_gaps():
    ts = np.r_[np.arange(0, DAY, 60.0), np.arange(3 * DAY, 4 * DAY, 60.0)]
    assert node_days(ts, np.full(len(ts), "n", dtype=object), 60.0) == pytest.approx(2.0, rel=0.01)


def test_calibration_respects_the_budget():
    rng = np.random.default_rng(0)
    n_nodes, days = 20, 10
    ts = np.tile(np.arange(0, days * DAY, 60.0), n_nodes)
    node = np.repeat([f"n{i}" for i in range(n_nodes)], int(days * DAY / 60)).astype(object)
    s = rng.random(len(ts)) ** 8
    thr, rep = calibrate_threshold(ts, node, s, {}, EV, 60.0)
    assert rep.false_alarms <= 2  # 200 node-days at 1 per 100
    looser = evaluate_events(ts, node, s, float(np.nextafter(thr, 0)) * 0.999, {}, EV, 60.0)
    assert looser.false_alarms > rep.false_alarms  # the lowest threshold within budget, not any
