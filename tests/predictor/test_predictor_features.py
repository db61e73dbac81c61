"""Windowed features: known answers on hand-made series, and online (runtime) == offline (table) features."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainguard.predictor.errors import FeatureMismatchError
from trainguard.predictor.features import (
    FeatureConfig, FeatureSpec, forward_fill, node_features, peer_z, seen_times, table_features,
)
from trainguard.predictor.table import MetricTable

CFG = FeatureConfig(interval_s=60.0, short_window_s=300.0, long_window_s=1800.0, peer=False)


def _feats(spec, ts, vals):
    raw = np.asarray(vals, dtype=float).reshape(len(ts), len(spec.metrics))
    ts = np.asarray(ts, float)
    return dict(zip(spec.node_feature_names, node_features(spec, ts, forward_fill(raw), np.isnan(raw).mean(axis=1),
                                                             float(ts[0]), seen_t=seen_times(ts, raw)).T))


def test_counter_rates_and_reset():
    spec = FeatureSpec(("gpu_ecc_sbe_total",), CFG)
    ts = np.arange(40) * 60.0
    counter = np.arange(40) * 6.0  # 6 per minute
    f = _feats(spec, ts, counter)
    assert f["gpu_ecc_sbe_total.rate_s"][-1] == pytest.approx(6.0)
    assert f["gpu_ecc_sbe_total.rate_l"][-1] == pytest.approx(6.0)
    assert f["gpu_ecc_sbe_total.accel"][-1] == pytest.approx(0.0)
    reset = counter.copy()
    reset[30:] = np.arange(10) * 6.0 + 6.0  # restarted from zero: first value after reset is its increase
    f = _feats(spec, ts, reset)
    assert f["gpu_ecc_sbe_total.rate_s"][-1] == pytest.approx(6.0)
    assert f["gpu_ecc_sbe_total.rate_l"][-1] >= 0


def test_empty_counter_cells_are_a_gap_not_a_fall_to_zero_and_a_burst():
    """Black-box review: an hour of empty cells of a counter that kept counting read as "no increase" during the
    outage and then as the whole hour's increase within the first short window (12x the rate): the node's own
    threshold learnt that burst and stuck at its maximum, and the node raised no learned-tier alarm for good."""
    spec = FeatureSpec(("gpu_ecc_sbe_total", "gpu_temp_c"), CFG)
    ts = np.arange(200) * 60.0
    counter = np.arange(200) * 6.0
    counter[60:120] = np.nan  # read again at row 120, having counted on
    temp = np.full(200, 50.0)
    f = _feats(spec, ts, np.column_stack([counter, temp]))
    rate_s = f["gpu_ecc_sbe_total.rate_s"]
    np.testing.assert_allclose(rate_s[60:120], 6.0)  # the rate as last read, not 0
    np.testing.assert_allclose(rate_s[120:], 6.0)  # the hour's increase over the hour, not within 5 minutes
    np.testing.assert_allclose(f["gpu_ecc_sbe_total.rate_l"][5:], 6.0)


def test_a_burst_right_after_empty_counter_cells_is_not_spread_over_the_outage():
    """Review: windows starting inside the outage were timed from the reading before it, so a burst in the first
    minutes after an outage read 10-20x diluted; it reads as the same rows without the outage now (over the
    window's length from the first reading after: over the minutes since that reading alone, as after missing
    rows, a few errors read as a burst, and a supervised model alarmed 5x as often after the dropouts of the
    synthetic transfer fleet)."""
    spec = FeatureSpec(("gpu_ecc_sbe_total",), CFG)
    ts = np.arange(200) * 60.0
    steps = np.full(200, 6.0)
    steps[121:124] = 600.0
    counter = np.cumsum(steps)
    gap = counter.copy()
    gap[60:120] = np.nan
    empty_cells = _feats(spec, ts, gap)["gpu_ecc_sbe_total.rate_s"]
    no_outage = _feats(spec, ts, counter)["gpu_ecc_sbe_total.rate_s"]
    np.testing.assert_allclose(empty_cells[120:], no_outage[120:], rtol=0.05)
    assert empty_cells[123] > 300.0


def test_a_counter_first_read_after_the_nodes_first_rows_reads_its_rate():
    """Review: an exporter starting a minute after the node's others left the counter's first cell empty, and its
    rates read as falling for a whole long window (1.2 and 0.8 per minute for 6)."""
    spec = FeatureSpec(("gpu_ecc_sbe_total",), CFG)
    ts = np.arange(40) * 60.0
    counter = np.arange(40) * 6.0
    counter[:1] = np.nan
    f = _feats(spec, ts, counter)
    np.testing.assert_allclose(f["gpu_ecc_sbe_total.rate_s"][2:], 6.0)
    np.testing.assert_allclose(f["gpu_ecc_sbe_total.rate_l"][2:], 6.0)


def test_counter_rates_match_a_plain_reference_on_random_outages():
    """The vectorised rates against a loop over the rules they implement, on random series with empty-cell
    stretches, resets and bursts (a review's reference)."""
    rng = np.random.default_rng(7)
    spec = FeatureSpec(("gpu_ecc_sbe_total",), CFG)
    for _ in range(20):
        n = 300
        ts = np.cumsum(rng.choice([60.0, 60.0, 60.0, 120.0, 600.0], n))
        counter = np.cumsum(rng.poisson(3.0, n) + (rng.random(n) < 0.02) * 500).astype(float)
        raw = counter.copy()
        for _ in range(rng.integers(1, 5)):
            a = int(rng.integers(0, n - 5))
            raw[a:a + int(rng.integers(1, 60))] = np.nan
        got = _feats(spec, ts, raw)
        for window, name in ((CFG.short_window_s, "rate_s"), (CFG.long_window_s, "rate_l")):
            want = [_reference_rate(ts, raw, i, window, CFG.interval_s) for i in range(n)]
            np.testing.assert_allclose(got[f"gpu_ecc_sbe_total.{name}"], want, rtol=1e-9, atol=1e-9)


def _reference_rate(ts, raw, i, window_s, interval_s, stale_s=3600.0):
    """A counter's per-minute rate at row ``i`` by the rules of features._counter_rates, one row at a time."""
    read = [k for k in range(i + 1) if not np.isnan(raw[k])]
    if not read:
        return 0.0
    end = read[-1]
    if ts[i] - ts[end] > stale_s:
        return 0.0
    value = {k: raw[k] for k in read}

    def increase(a, b):  # summed increments between readings a < b (resets: at most half the previous value)
        total, prev = 0.0, a
        for k in [k for k in read if a < k <= b]:
            d = value[k] - value[prev]
            total += d if d >= 0 else (value[k] if value[k] <= -d else 0.0)
            prev = k
        return total

    t_end = ts[end]
    j = int(np.searchsorted(ts, t_end - window_s, side="left"))
    later = [k for k in read if k >= j]
    first_after = later[0] if later else None
    if first_after is not None and first_after < end and first_after != j:
        earlier = [k for k in read if k < first_after]
        if earlier:  # a window reaching into an outage: that part at the outage's mean rate
            p = earlier[-1]
            gap = ts[first_after] - ts[p]
            overlap = min(max(ts[first_after] - (t_end - window_s), 0.0), gap)
            inc = increase(first_after, end) + increase(p, first_after) * (overlap / gap if gap > 0 else 0.0)
            return inc / window_s * 60.0
        start = first_after
    elif first_after is not None and first_after < end:
        start = first_after
    else:
        start = max(end - 1, 0)
    start_read = [k for k in read if k <= start]
    s = start_read[-1] if start_read else start
    return (increase(s, end) if start_read else 0.0) / max(t_end - ts[s], interval_s) * 60.0


def test_a_counter_summed_over_devices_that_drops_in_part_is_no_burst():
    """Black-box review: one GPU's volatile count restarting drops a node's sum by a quarter; taken as a restart
    from zero, the whole remaining sum counted as new errors (rate_s_rz 256, an alarm)."""
    spec = FeatureSpec(("gpu_ecc_sbe_total",), CFG)
    ts = np.arange(40) * 60.0
    counter = 1000.0 + np.arange(40) * 6.0
    counter[20:] -= 0.25 * counter[19]
    f = _feats(spec, ts, counter)
    assert f["gpu_ecc_sbe_total.rate_s"].max() <= 6.0 + 1e-9
    full = np.arange(40) * 6.0 + 1000.0
    full[20:] = np.arange(20) * 6.0 + 6.0  # a restart from zero still counts what it counted since
    assert _feats(spec, ts, full)["gpu_ecc_sbe_total.rate_s"][-1] == pytest.approx(6.0)


def test_online_features_equal_offline_through_empty_counter_cells():
    from trainguard.predictor.runtime import PredictorRuntime
    from trainguard.predictor.training import TrainConfig, train

    rng = np.random.default_rng(3)
    n, cols = 2000, ["gpu_ecc_sbe_total", "gpu_temp_c"]
    ts = 1_700_000_000.0 + np.arange(n) * 60.0
    counter = np.cumsum(rng.poisson(2.0, n)).astype(float)
    temp = 50 + rng.standard_normal(n)
    counter[900:1300] = np.nan  # under 7 h of empty counter cells, well past the long window
    counter[1500:1510] = np.nan
    vals = np.column_stack([counter, temp])
    table = MetricTable(cols, ts, np.array(["a"] * n, dtype=object), vals)
    model = train(table, None, TrainConfig(method="robust-z", features=FeatureConfig(interval_s=60.0, peer=False)))
    from trainguard.predictor.training import score_table

    _, offline = score_table(model, table)
    rt = PredictorRuntime(model)
    online = [rt.observe(float(t), "a", dict(zip(cols, v.tolist()))).score for t, v in zip(ts, vals)]
    np.testing.assert_allclose(online, offline, rtol=1e-6, atol=1e-7)


def test_a_counter_that_kept_counting_through_a_gap_reads_its_rate_not_zero():
    """After a gap longer than both windows, the windows hold no earlier sample: the rate is the increase since
    the previous sample over the time since then (found by a user's review: 0 was read, a -14 robust z and a
    false alarm on the first row after every long gap). Rows with an earlier sample in the window are as before."""
    spec = FeatureSpec(("gpu_ecc_sbe_total", "gpu_temp_c"), CFG)
    ts = np.r_[np.arange(40), np.arange(400, 440)] * 60.0  # a 6-hour gap after row 39
    counter = ts / 60.0 * 6.0  # 6 per minute all along, gap included
    vals = np.column_stack([counter, np.full(len(ts), 60.0)])
    f = _feats(spec, ts, vals)
    for name in ("rate_s", "rate_l"):
        assert f[f"gpu_ecc_sbe_total.{name}"][40] == pytest.approx(6.0)  # 2166 in 361 min
        assert f[f"gpu_ecc_sbe_total.{name}"][41] == pytest.approx(6.0)  # a window with 2 samples: as before
    assert f["gpu_ecc_sbe_total.accel"][40] == pytest.approx(0.0)
    assert f["telemetry.gap_s"][40] == pytest.approx(361 * 60.0)  # the gap is still seen as a gap
    assert f["gpu_temp_c.level"][40] == pytest.approx(60.0)
    # A counter that stood still through the gap (the node was off) does read 0: that is what happened.
    still = counter.copy()
    still[40:] = counter[39] + np.arange(40) * 6.0
    f = _feats(spec, ts, np.column_stack([still, np.full(len(ts), 60.0)]))
    assert f["gpu_ecc_sbe_total.rate_s"][40] == pytest.approx(0.0)


def test_gauge_level_drift_slope_and_telemetry():
    spec = FeatureSpec(("gpu_temp_c",), CFG)
    ts = np.arange(60) * 60.0
    temp = 60.0 + np.arange(60) * 0.5  # +0.5 degC per minute
    temp[55] = np.nan
    f = _feats(spec, ts, temp)
    assert f["gpu_temp_c.level"][55] == pytest.approx(temp[54])  # forward-filled
    assert f["gpu_temp_c.slope_l"][-1] == pytest.approx(0.5, rel=0.05)
    assert f["gpu_temp_c.drift"][-1] > 0
    assert f["telemetry.nan_frac_l"][-1] == pytest.approx(1 / 30, rel=0.2)
    # a 5-minute telemetry gap shows in gap_s and in coverage
    ts_gap = np.r_[np.arange(40), np.arange(45, 60)] * 60.0
    f = _feats(spec, ts_gap, np.full(len(ts_gap), 60.0))
    assert f["telemetry.gap_s"][40] == pytest.approx(360.0)
    assert f["telemetry.coverage_l"][41] < 0.9
    assert f["telemetry.coverage_l"][10] == pytest.approx(1.0)  # a young history is not a gap


def test_peer_z_is_robust_and_missing_with_few_peers():
    base = np.array([[1.0], [1.1], [0.9], [5.0], [1.0], [1.0]])
    z = peer_z(base, np.array([0, 0, 0, 0, 1, 1]))
    assert z[3, 0] > 5 and abs(z[0, 0]) < 1
    assert np.isnan(z[4:, 0]).all()  # group of two: fewer than MIN_PEERS


def test_unknown_and_missing_metrics():
    with pytest.raises(FeatureMismatchError, match="catalog"):
        FeatureSpec(("no_such_metric",), CFG)
    spec = FeatureSpec(("gpu_temp_c", "step_time_s"), CFG)
    table = MetricTable(["gpu_temp_c"], np.arange(5) * 60.0, ["n"] * 5, np.ones((5, 1)))
    with pytest.raises(FeatureMismatchError, match="step_time_s"):
        table_features(table, spec)
    fr = table_features(table, spec, missing="nan")
    assert fr.missing_metrics == ["step_time_s"]
    assert np.isnan(fr.x[:, fr.names.index("step_time_s.level")]).all()


def test_online_features_equal_offline(small_trace, hgb_model):
    from trainguard.predictor.runtime import PredictorRuntime
    from trainguard.predictor.training import score_table

    one = small_trace.metrics.select_rows(small_trace.metrics.node.astype(str) == "node0001")
    frame, offline = score_table(hgb_model, one)
    rt = PredictorRuntime(hgb_model)
    scores = [rt.observe(float(t), "node0001", dict(zip(one.columns, v.tolist()))) for t, v in zip(one.ts, one.values)]
    assert len(scores) == len(offline) > 2000
    model_rows = [i for i, s in enumerate(scores) if s.source == "model"]  # rule hits score 1.0 by design
    assert len(model_rows) > len(scores) - 10
    np.testing.assert_allclose([scores[i].score for i in model_rows], offline[model_rows], rtol=1e-6, atol=1e-7)


def test_observe_many_peer_features_equal_offline(small_trace):
    from trainguard.predictor.catalog import split_known
    from trainguard.predictor.model import PredictorModel
    from trainguard.predictor.runtime import PredictorRuntime
    from trainguard.predictor.scorers import RobustZScorer

    m = small_trace.metrics
    keep = np.isin(m.node.astype(str), ["node0000", "node0001", "node0002", "node0003"]) & (m.ts < m.ts.min() + 6 * 3600)
    sub = m.select_rows(keep)
    spec = FeatureSpec(tuple(split_known(sub.columns)[0]), FeatureConfig(interval_s=60.0))
    frame = table_features(sub, spec)
    model = PredictorModel(spec, RobustZScorer.fit(frame.names, frame.x), 0.9)
    offline = dict(zip(zip(frame.node.astype(str), frame.ts), model.scorer.score(frame.x)))
    rt = PredictorRuntime(model)
    by_ts: dict[float, dict[str, dict[str, float]]] = {}
    for t, n, v in zip(sub.ts, sub.node.astype(str), sub.values):
        by_ts.setdefault(float(t), {})[n] = dict(zip(sub.columns, v.tolist()))
    diffs = []
    for t in sorted(by_ts):
        for n, s in rt.observe_many(t, by_ts[t]).items():
            diffs.append(abs(s.score - offline[(n, t)]))
            if len(by_ts[t]) >= 3:
                assert not any("peer" in d for d in s.degraded)
    assert max(diffs) < 1e-6
    assert not math.isnan(max(diffs))


@pytest.mark.parametrize("alpha", [1e-5, 1.0 / 60.0, 0.5, 1.0 - 1e-12, 1.0])
def test_ewma_is_the_first_order_filter_of_scipy(alpha):
    """The node's own baseline is the filter ``scipy.signal.lfilter`` ran before (scipy.signal's import cost
    ~2 s of CPU per CLI run): the same values to 1e-12, over a spike 1e10 times the level and back."""
    from scipy.signal import lfilter

    from trainguard.predictor.features import ewma

    rng = np.random.default_rng(3)
    v = np.r_[50 + rng.standard_normal(3000), 1e10, 1.0 + rng.random(3000)]
    y0 = 42.0
    ref = lfilter([alpha], [1.0, alpha - 1.0], v, zi=[(1.0 - alpha) * y0])[0]
    np.testing.assert_allclose(ewma(v, alpha, y0), ref, rtol=1e-12, atol=0)
    assert ewma(v[:0], alpha, y0).shape == (0,)


def test_train_and_score_do_not_import_scipy_signal(tmp_path):
    """``trainguard predictor train`` and ``score`` of the robust-z tier run without scipy.signal (whose import was
    most of a small run's time); checked in a fresh interpreter, as a user runs the CLI."""
    import csv
    import subprocess
    import sys

    path = tmp_path / "m.csv"
    rng = np.random.default_rng(0)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", "latency_ms"])
        for i in range(240):
            for k in range(3):
                w.writerow([1_700_000_000 + 60 * i, f"n{k}", round(20 + rng.standard_normal(), 3)])
    code = ("import sys; from trainguard.cli import main; "
            f"assert main(['predictor', 'train', '--metrics', {str(path)!r}, "
            f"'--out', {str(tmp_path / 'm.json')!r}]) == 0; "
            f"assert main(['predictor', 'score', '--model', {str(tmp_path / 'm.json')!r}, '--metrics', {str(path)!r}, "
            f"'--out', {str(tmp_path / 's.csv')!r}]) == 0; "
            "print('scipy.signal' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout
