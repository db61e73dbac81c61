"""Public real data (NAB realAWSCloudwatch, bench/data/nab_aws): a model trained on the other series keeps
the false-alarm budget on each held-out series with its self-calibrated threshold, and catches labelled
incidents there (not a tuning target: the figures are in bench/bench_predictor_real.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_predictor_real.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_predictor_real", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.timeout(300)
def test_self_calibrated_budget_holds_on_unseen_real_series(bench, shared_long_baseline):
    from trainguard.predictor.evaluation import evaluate_windows

    data = bench.load_series(bench.DEFAULT_DATA)
    assert len(data) >= 3 and all(len(ts) > 3000 for ts, _, _ in data.values())
    budget = 0.2
    margins = bench.ours(data, budget)  # leave one series out: each is scored by a model that never saw it
    series = []
    for name, (ts, _, windows) in data.items():
        keep = ts >= ts[0] + 86400.0
        assert np.isneginf(margins[name][1][~keep]).all()  # the first day only warms the threshold up
        series.append((ts[keep], margins[name][1][keep], windows))
    rep = evaluate_windows(series, 0.0, bench.COOLDOWN_S)
    assert rep.days > 30
    assert rep.false_alarms_per_day <= budget, (rep.false_alarms, rep.days)
    assert rep.caught >= 1  # it is not silent: at least one labelled incident is flagged


MS_DATA = BENCH.parent / "data" / "ms_cloud_latency"


def test_label_column_folder_becomes_incident_windows(bench, tmp_path):
    # a folder without windows.json: runs of labelled rows are the windows, ISO timestamps with Z are UTC
    rows = ["timestamp,value,label"] + [f"2018-06-17T{h:02d}:00:00Z,{h},{int(h in (3, 4, 5, 9, 23))}"
                                        for h in range(24)]
    (tmp_path / "s.csv").write_text("\n".join(rows) + "\n")
    (ts, x, win), = bench.load_series(tmp_path).values()
    t0 = 1529193600.0  # 2018-06-17T00:00Z
    assert ts[0] == t0 and x[5] == 5.0 and bench.interval_of({"s": (ts, x, win)}) == 3600.0
    assert win == [(t0 + 3 * 3600, t0 + 5 * 3600), (t0 + 9 * 3600, t0 + 9 * 3600), (t0 + 23 * 3600, t0 + 23 * 3600)]
    (tmp_path / "s.csv").write_text("timestamp,value\n2018-06-17T00:00:00Z,1\n")
    with pytest.raises(ValueError, match="windows.json"):
        bench.load_series(tmp_path)


def test_rows_stamped_at_a_minute_already_seen_are_dropped_for_every_method(bench, tmp_path, capsys):
    # NAB's ec2_disk_write_bytes_1ef3de and ec2_network_in_5abac7 stamp 12 rows 2014-03-09 03:00:00 (the collector
    # at a daylight-saving change); the predictor refuses time standing still, so the loader keeps the first
    rows = ["timestamp,value", "2014-03-09 01:55:00,1", "2014-03-09 03:00:00,2", "2014-03-09 03:00:00,3",
            "2014-03-09 03:00:00,4", "2014-03-09 03:04:00,5"]
    (tmp_path / "s.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "windows.json").write_text('{"s": []}')
    (ts, x, _), = bench.load_series(tmp_path).values()
    assert list(x) == [1.0, 2.0, 5.0] and (np.diff(ts) > 0).all()
    assert "2 row(s) whose timestamp is not after the previous one dropped" in capsys.readouterr().err
    held = bench.load_series(bench.HELDOUT_DATA)  # the copied held-out series load whole, in order
    assert len(held) == 12 and sum(len(w) for _, _, w in held.values()) == 21
    assert all((np.diff(ts) > 0).all() for ts, _, _ in held.values())


def test_label_rows_with_repeated_hours_and_missing_values_keep_their_windows(bench, tmp_path, capsys):
    # MS crash-rate files repeat an hour's row (once with another label) and leave some values empty; the
    # windows come from every labelled hour (a value-less one too), the values keep only hours that have one
    rows = ["TimeStamp,Value,Label", "2018-07-03 00:00:00,1,0", "2018-07-03 01:00:00,5,1", "2018-07-03 01:00:00,5,0",
            "2018-07-03 02:00:00,,1", "2018-07-03 03:00:00,2,0", "2018-07-03 03:00:00,2,0", "2018-07-03 04:00:00,,0",
            "2018-07-03 05:00:00,3,1"]
    (tmp_path / "app.csv").write_text("\n".join(rows))  # upstream has no final newline
    (ts, x, win), = bench.load_series(tmp_path).values()
    t0 = 1530576000.0  # 2018-07-03T00:00Z
    assert list(x) == [1.0, 5.0, 2.0, 3.0] and list(ts) == [t0, t0 + 3600, t0 + 3 * 3600, t0 + 5 * 3600]
    assert win == [(t0 + 3600, t0 + 2 * 3600), (t0 + 5 * 3600, t0 + 5 * 3600)]
    err = capsys.readouterr().err
    assert "2 row(s) whose timestamp is not after" in err and "2 row(s) without a value left out" in err


def test_an_event_labelled_on_most_series_at_once_is_found_as_one_shared_window(bench, tmp_path):
    # 4 series: the 03:00-05:00 window on three of them is one event; the 09:00 one and series d's are not
    labels = {"a": (3, 4, 5), "b": (3, 4, 5, 9), "c": (3, 4, 5), "d": (4, 5)}
    for name, hours in labels.items():
        rows = ["timestamp,value,label"] + [f"2018-06-17T{h:02d}:00:00Z,{h},{int(h in hours)}" for h in range(24)]
        (tmp_path / f"{name}.csv").write_text("\n".join(rows) + "\n")
    t0 = 1529193600.0
    assert bench.shared_windows(bench.load_series(tmp_path)) == {(t0 + 3 * 3600, t0 + 5 * 3600)}
    (tmp_path / "c.csv").unlink()  # two of three series: below the floor of 3 series
    assert bench.shared_windows(bench.load_series(tmp_path)) == frozenset()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not any(MS_DATA.glob("*.csv")), reason="second data set not downloaded (see bench/data/ms_cloud_latency/SOURCE.md)")
def test_self_calibrated_budget_holds_on_hourly_service_latency(bench, shared_long_baseline):
    """Second public data set (Microsoft Cloud Monitoring Dataset, hourly outbound API latency: outbound-01..04
    with 17 labelled windows, or all 23 series with 74): hourly data gets its own derived windows; each
    held-out series keeps the budget."""
    from trainguard.predictor.evaluation import evaluate_windows

    data = bench.load_series(MS_DATA)
    assert len(data) in (4, 23) and all(len(ts) == 720 for ts, _, _ in data.values())
    assert sum(len(w) for _, _, w in data.values()) == {4: 17, 23: 74}[len(data)]
    budget = 0.2
    margins = bench.ours(data, budget)
    series = []
    for name, (ts, _, windows) in data.items():
        keep = ts >= ts[0] + 86400.0
        series.append((ts[keep], margins[name][1][keep], windows))
    rep = evaluate_windows(series, 0.0, bench.COOLDOWN_S)
    assert rep.days > 100
    assert rep.false_alarms_per_day <= budget, (rep.false_alarms, rep.days)
    assert rep.caught >= 1


def _write_series(path: Path, ts: np.ndarray, x: np.ndarray) -> None:
    from datetime import datetime, timezone

    rows = [f"{datetime.fromtimestamp(t, timezone.utc):%Y-%m-%d %H:%M:%S},{v:.4f}" for t, v in zip(ts, x)]
    path.write_text("timestamp,value\n" + "\n".join(rows) + "\n")


@pytest.mark.timeout(300)
def test_a_folder_of_series_at_other_intervals_is_scored_each_at_its_own(bench, tmp_path, capsys):
    # NAB's realKnownCause mixes 5-minute, 30-minute and hourly series, some sampled irregularly: one folder-wide
    # interval scored the hourly series with 5-minute windows, and the predictor refused them
    rng = np.random.default_rng(3)
    t0 = 1_400_000_000.0
    five = t0 + 300.0 * np.arange(4 * 288)
    hourly = t0 + 3600.0 * np.arange(8 * 24)
    # sampled every 5 minutes, then every minute for half a day: the predictor refuses it as one interval
    irregular = np.r_[t0 + 300.0 * np.arange(3 * 288), t0 + 3 * 86400.0 + 60.0 * np.arange(720)]
    for name, ts in (("a", five), ("b", five + 7.0), ("h", hourly), ("i", irregular)):
        _write_series(tmp_path / f"{name}.csv", ts, 50 + 5 * rng.standard_normal(len(ts)))
    (tmp_path / "windows.json").write_text('{"a": [], "b": [], "h": [], "i": []}')
    data = bench.regularise(bench.load_series(tmp_path))
    assert "i: refused as sampled" in capsys.readouterr().err
    ts_i = data["i"][0]
    assert len(ts_i) < len(irregular) and len(set(np.diff(ts_i))) == 1  # one grid: its own median interval
    assert bench.series_interval(data["h"][0]) == 3600.0
    scores = bench.ours(data, 0.2)
    for name, (ts, _, _) in data.items():
        s = scores[name][0]
        assert len(s) == len(ts) and np.isfinite(s[ts >= ts[0] + 2 * 86400.0]).mean() > 0.9, name
    # an hourly series alone has nothing finer to learn from
    only = {"h": data["h"], "h2": (data["h"][0] + 3600.0 * 24 * 30, data["h"][1], [])}
    only["x"] = (five, data["a"][1], [])
    with pytest.raises(ValueError, match="no other series is sampled at 300 s or finer"):
        bench.ours({"x": only["x"], "h": only["h"]}, 0.2)


def test_the_causal_isolation_forest_leaves_a_day_after_a_gap_longer_than_its_window_unscored(bench):
    # NAB's ambient temperature has a 174-hour gap: the day after it has no past week to fit on (it raised)
    ts = np.r_[3600.0 * np.arange(72), 3600.0 * (72 + 200 + np.arange(72))]
    x = np.random.default_rng(0).standard_normal(len(ts))
    s = bench.isolation_forest_causal(ts, x, hour_rows=1)
    # days count from the first sample: the day holding hours 264-287 has no sample in its past week, the next
    # day's week holds that day's 16
    assert np.isnan(s[(ts >= 3600.0 * 264) & (ts < 3600.0 * 288)]).all()
    assert np.isfinite(s[ts >= 3600.0 * 288]).all() and np.isfinite(s[(ts >= 86400.0) & (ts < 3600.0 * 72)]).all()
