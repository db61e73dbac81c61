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
def test_self_calibrated_budget_holds_on_unseen_real_series(bench):
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
