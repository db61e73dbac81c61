"""Shared fixtures of the predictor tests: small synthetic traces (StepFun-based) and a trained model."""

from __future__ import annotations

import numpy as np
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


@pytest.fixture(scope="module")
def shared_long_baseline():
    """Computes each node's long-baseline deviations once per test module, however often its features are asked.

    Leave-one-series-out (``bench.ours``) computes every series' features once per fold, and tests that train
    and score several methods on the same fleet compute the same features once per method; the long baseline is
    most of that cost (measured: 67 of 76 s for the 5 NAB series on a loaded 2-core box, 18 of 35 s for the two
    transfer methods). It is a pure function of its arguments (the config, the node's times and its own
    forward-filled feature columns; with peer features off nothing of another node enters), so repeats are
    served from a memo keyed by those exact bytes and every number a test checks is the one the real function
    computes. Module-scoped: tests of the module after the first user see the memo too (same results). Yields
    the memo (key -> result)."""
    from trainguard.predictor import features

    real = features.long_baseline_z
    memo: dict = {}

    def once(cfg, ts: np.ndarray, x: np.ndarray) -> np.ndarray:
        key = (cfg, ts.dtype.str, ts.shape, ts.tobytes(), x.dtype.str, x.shape, x.tobytes())
        if key not in memo:
            memo[key] = real(cfg, ts, x)
        return memo[key].copy()  # a caller may write into its result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features, "long_baseline_z", once)
        yield memo
