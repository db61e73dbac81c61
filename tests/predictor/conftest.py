"""Shared fixtures of the predictor tests: small synthetic traces (StepFun-based) and a trained model."""

from __future__ import annotations

import pytest

from trainguard.predictor.tracegen import TraceConfig, default_trace_dir


def _trace_available() -> bool:
    return (default_trace_dir() / "fault_trace.json").is_file()


needs_trace = pytest.mark.skipif(
    not _trace_available(),
    reason=f"StepFun fault trace absent at {default_trace_dir()} (the generator follows its fault mix)",
)

SMALL = TraceConfig(n_nodes=12, days=2.0, interval_s=60.0, rate_scale=150.0, repair_scale=0.05, seed=3)


@pytest.fixture(scope="session")
def small_trace():
    """12 nodes x 2 days at 60 s with an accelerated StepFun fault mix."""
    if not _trace_available():
        pytest.skip(f"StepFun fault trace absent at {default_trace_dir()}")
    from trainguard.predictor.tracegen import generate

    return generate(SMALL)


@pytest.fixture(scope="session")
def hgb_model(small_trace):
    """A supervised model trained on the small trace (peer features off, as on a lone agent)."""
    from trainguard.predictor.evaluation import EvalConfig
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.training import TrainConfig, train

    cfg = TrainConfig(method="hgb", features=FeatureConfig(interval_s=60.0, peer=False), evaluation=EvalConfig(),
                      max_iter=40, min_failures=1)
    return train(small_trace.metrics, small_trace.events, cfg)
