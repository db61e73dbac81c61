"""The predictor finds the StepFun trace the same way every other trainguard command does."""

from __future__ import annotations

import pytest

from trainguard.drill import trace as drill_trace
from trainguard.predictor.errors import DataFormatError
from trainguard.predictor.tracegen import default_trace_dir, load_stepfun


def test_environment_variable_is_honoured_like_ettr(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(drill_trace.TRACE_DIR_ENV, str(tmp_path / "mine"))
    assert default_trace_dir() == drill_trace.trace_dir() == tmp_path / "mine"
    with pytest.raises(DataFormatError, match="--trace DIR"):
        load_stepfun()


def test_without_the_variable_it_is_the_drill_default(monkeypatch) -> None:
    monkeypatch.delenv(drill_trace.TRACE_DIR_ENV, raising=False)
    assert default_trace_dir() == drill_trace.trace_dir()
