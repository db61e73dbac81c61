"""Errors of the ETTR model and the soak drill."""

from __future__ import annotations

from trainguard.errors import TrainguardError


class DrillError(TrainguardError):
    """Base of every error the ETTR model and the soak drill raise on purpose."""


class TraceError(DrillError):
    """A fault trace is missing, empty or malformed."""


class ComponentsError(DrillError):
    """Component times are out of range, or a components file is malformed."""


class SoakError(DrillError):
    """The soak drill could not run or its job did not finish as required."""
