"""CPU time of the predictor's online scoring (``PredictorRuntime.observe``) of one node, per sample: steady, and
with one counter's cells empty for 90 of the measured minutes (the rows its rates need are kept meanwhile).

Usage: python bench/bench_predictor_observe.py
To compare with another version, install it apart (``pip install --no-deps --target DIR <checkout>``) and run
this script with ``PYTHONPATH=DIR`` in the same session; the figures are only comparable within one session.
One node of a generated fleet (the StepFun fault trace's mix, 60 s samples), a robust-z model trained on six
nodes x 3 days; 2000 samples of warm-up, then 2000 measured (``time.process_time``).
"""

from __future__ import annotations

import time

import numpy as np

import trainguard
from trainguard.predictor.features import FeatureConfig
from trainguard.predictor.runtime import PredictorRuntime
from trainguard.predictor.tracegen import TraceConfig, generate
from trainguard.predictor.training import TrainConfig, train

WARM, MEASURED, OUTAGE = 2000, 2000, 90


def main() -> int:
    """Prints the CPU milliseconds per ``observe``, steady and through a counter's empty cells."""
    tr = generate(TraceConfig(n_nodes=6, days=3, interval_s=60, rate_scale=100, repair_scale=0.05, seed=3))
    model = train(tr.metrics, tr.events,
                  TrainConfig(method="robust-z", features=FeatureConfig(interval_s=60.0, peer=False)))
    node = str(tr.metrics.node[0])
    rows = np.flatnonzero(tr.metrics.node.astype(str) == node)[:WARM + MEASURED]
    cols = tr.metrics.columns
    counter = next(c for c in cols if c.endswith("_total"))
    print(f"trainguard {trainguard.__version__} from {trainguard.__file__}")
    for label, blank in (("steady", False), (f"{counter} empty for {OUTAGE} min", True)):
        rt = PredictorRuntime(model)
        t0 = 0.0
        for k, i in enumerate(rows):
            if k == WARM:
                t0 = time.process_time()
            sample = dict(zip(cols, tr.metrics.values[i].tolist()))
            if blank and WARM <= k < WARM + OUTAGE:
                sample[counter] = float("nan")
            rt.observe(float(tr.metrics.ts[i]), node, sample)
        print(f"{label}: {(time.process_time() - t0) / MEASURED * 1e3:.3f} ms CPU per observe")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
