"""Errors of the anomaly predictor: one base, :class:`PredictorError`, and a subclass per kind of refusal.

Every message says what is wrong and what to do, in one line, so the CLI can print it as is.
"""

from __future__ import annotations

from trainguard.errors import TrainguardError


class PredictorError(TrainguardError):
    """Base of everything the predictor refuses on purpose."""


class DataFormatError(PredictorError):
    """A metrics or events table is malformed: missing columns, non-numeric cells, unsorted timestamps."""


class InsufficientDataError(PredictorError):
    """There is too little data (rows, nodes, failures) to fit or calibrate what was asked."""


class FeatureMismatchError(PredictorError):
    """The metrics offered to a model lack columns it was trained on, and the chosen policy is to refuse."""


class ModelFileError(PredictorError):
    """A model file is unreadable, corrupted, from another format version, or fails its signature check."""


class HistoryError(PredictorError):
    """The metric history store cannot be opened, written or exported."""


class RuleFileError(PredictorError):
    """A rules-tier data file is malformed (unknown operator, missing field, bad JSON)."""
