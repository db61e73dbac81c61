"""Transfer: a model trained on one synthetic fleet holds its false-alarm budget on a fleet generated
differently (other seed, 3x the benign decoys, 2x the congestion, 3x the telemetry dropouts, jobs of 4, gauges
at other levels and scales with a daily pattern), with each node's threshold calibrated online from its own
scores. The fleet's own fixed threshold raises more false alarms there (what issue 19 found on real data): for
the supervised model 73 per 100 node-days (3.7x the budget) until partial counter drops and empty counter cells
stopped reading as bursts (2026-12-04); 15 now on this seed, 9 and 81 on seeds 12 and 13."""

from __future__ import annotations

import numpy as np
import pytest

from trainguard.predictor.tracegen import default_trace_dir

needs_trace = pytest.mark.skipif(
    not (default_trace_dir() / "fault_trace.json").is_file(),
    reason=f"StepFun fault trace absent at {default_trace_dir()}",
)
BUDGET = 20.0  # false alarms per 100 node-days (0.2 per node-day): about 11 allowed on the test fleet


@needs_trace
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["hgb", "robust-z"])
def test_budget_holds_on_a_fleet_generated_differently(method, shared_long_baseline):
    from trainguard.predictor.calibration import calibrate_table
    from trainguard.predictor.evaluation import EvalConfig, evaluate_events, failures_by_node
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.tracegen import TraceConfig, generate, shifted_fleet
    from trainguard.predictor.training import TrainConfig, calibration_scores, score_table, train

    a = generate(TraceConfig(n_nodes=12, days=3, interval_s=60, rate_scale=100, repair_scale=0.05, seed=1))
    cfg = TrainConfig(method=method, features=FeatureConfig.for_data(60.0, 3 * 86400, peer=False),
                      evaluation=EvalConfig(budget_per_100_node_days=BUDGET), max_iter=60, min_failures=1)
    model = train(a.metrics, a.events, cfg)
    b_metrics, b_trace = shifted_fleet(seed=11, n_nodes=12)
    b_events = b_trace.events
    frame, score = score_table(model, b_metrics)
    failures = failures_by_node(b_events.node, b_events.ts)
    # what the runtime does (one threshold per node: the default; per node and family is measured in the bench)
    margin, _ = calibrate_table(frame.ts, frame.node, calibration_scores(model, frame, score), model.calibration)
    assert np.isneginf(margin[frame.ts < frame.ts.min() + 86400]).all()  # a day of warm-up: no alarm
    warm = frame.ts >= frame.ts.min() + 86400
    online = evaluate_events(frame.ts[warm], frame.node[warm], margin[warm], 0.0, failures, model.eval_config, 60.0)
    assert online.node_days > 50 and online.false_alarms_per_100_node_days <= BUDGET, online.summary()
    if method == "hgb":  # the fleet's fixed threshold, calibrated on fleet A, does worse on fleet B
        fixed = evaluate_events(frame.ts[warm], frame.node[warm], score[warm], model.threshold, failures,
                                model.eval_config, 60.0)
        assert fixed.false_alarms_per_100_node_days > 2 * online.false_alarms_per_100_node_days, fixed.summary()
