"""Anomaly predictor: warns before a node fails, from its metric history.

Two tiers. The rules tier (:mod:`.rules`, data in ``rules.json``) alarms at once on faults that are already
fatal (XID 79, AER fatal, a PCIe link below its width, a NIC down...). The learned tier turns a node's metric
stream into windowed features (:mod:`.features`) and scores them with a model (:mod:`.models`): robust z-scores
when no failure labels exist, gradient-boosted trees for "hard failure within horizon H" once they do, each with
a threshold calibrated to a false-alarm budget (:mod:`.evaluation`).

Offline: :func:`.training.train` fits on a history (CSV interchange, :mod:`.table`, or the agent's store,
:mod:`.history`); :func:`.evaluation.evaluate_events` reports event recall, lead times and false alarms per 100
node-days. Online: :class:`.runtime.PredictorRuntime` scores one interval of one node in well under a
millisecond. :mod:`.tracegen` synthesises fault traces that follow StepFun's published fault mix.

Importing this package is cheap; scikit-learn is imported only by training code.
"""

from trainguard.predictor.errors import (
    DataFormatError,
    FeatureMismatchError,
    HistoryError,
    InsufficientDataError,
    ModelFileError,
    PredictorError,
    RuleFileError,
)

__all__ = [
    "DataFormatError",
    "FeatureMismatchError",
    "HistoryError",
    "InsufficientDataError",
    "ModelFileError",
    "PredictorError",
    "RuleFileError",
]
