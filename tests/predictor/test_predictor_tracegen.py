"""Trace generator: fault mix follows StepFun's trace, precursors only where the literature has them."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from trainguard.predictor.errors import DataFormatError
from trainguard.predictor.tracegen import (
    STEPFUN_FAULTS, TraceConfig, default_trace_dir, generate, load_stepfun, stepfun_summary,
)

needs_trace = pytest.mark.skipif(
    not (default_trace_dir() / "fault_trace.json").is_file(),
    reason=f"StepFun fault trace absent at {default_trace_dir()} (the generator follows its fault mix)",
)


@needs_trace
def test_real_trace_is_read():
    kinds = load_stepfun()
    assert sum(k.count for k in kinds) == STEPFUN_FAULTS
    s = stepfun_summary()
    assert s["families"]["none"] > s["families"]["ecc"] > 0
    assert 0.15 < s["predictable_share"] < 0.4


def test_absent_trace_is_a_clear_error(tmp_path):
    with pytest.raises(DataFormatError, match="not found"):
        load_stepfun(tmp_path)


def test_a_fault_without_a_description_is_refused_before_generating(tmp_path):
    """Its Desc becomes the generated events' kind, which may not be empty: refused when read, not after the
    minutes of generation."""
    ev = {"event_type": "fault_start", "event_time": 1.0, "node_id": "n1",
          "fault_type": {"Level": "Hardware Failure", "Class": "GPU", "Desc": " "}}
    (tmp_path / "fault_trace.json").write_text(json.dumps([ev]))
    with pytest.raises(DataFormatError, match="no fault Desc"):
        load_stepfun(tmp_path)


@needs_trace
def test_fault_mix_follows_the_trace():
    cfg = TraceConfig(n_nodes=200, days=3.0, interval_s=1800.0, rate_scale=300.0, repair_scale=0.01,
                      decoy_rate=0.0, rule_columns=False, seed=7)
    tr = generate(cfg)
    got = Counter(f.family or "none" for f in tr.faults)
    real = stepfun_summary()["families"]
    n = sum(got.values())
    assert n > 500
    expected_rate = 0.00418 * 300 * 200 * 3
    assert 0.7 * expected_rate < n < 1.1 * expected_rate  # downtime pauses the process
    for fam in ("none", "ecc", "link"):
        share, real_share = got[fam] / n, real[fam] / sum(real.values())
        assert abs(share - real_share) < 0.06, (fam, share, real_share)


@needs_trace
def test_precursor_only_for_predictable_faults(small_trace):
    m = small_trace.metrics
    nd = m.node.astype(str)
    col = {c: i for i, c in enumerate(m.columns)}
    checked = 0
    for f in small_trace.faults:
        w = (nd == f.node) & (m.ts >= f.ts - 900) & (m.ts < f.ts)
        if w.sum() < 5:
            continue
        if f.predictable:
            assert f.precursor_start is not None and f.precursor_start < f.ts
            checked += 1
        else:
            assert f.precursor_start is None
    assert checked >= 1
    assert len(small_trace.events) == len(small_trace.faults)
    # nodes are absent (no samples) while down for repair
    f = small_trace.faults[0]
    assert not ((nd == f.node) & (m.ts >= f.ts) & (m.ts < f.ts + min(f.repair_s, 600))).any()
    assert "gpu_ecc_sbe_total" in col


@needs_trace
def test_same_seed_same_trace():
    cfg = TraceConfig(n_nodes=4, days=0.5, interval_s=120.0, rate_scale=50.0, seed=11)
    a, b = generate(cfg), generate(cfg)
    np.testing.assert_array_equal(a.metrics.values, b.metrics.values)
    assert a.faults == b.faults
