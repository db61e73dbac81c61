"""Errors raised by the detectors subsystem.

:class:`DetectorError` is the one base; the runner turns a :class:`DetectorReadError` raised inside a detector into
a ``detector.error`` health event instead of letting it escape into the agent.
"""

from __future__ import annotations

from trainguard.errors import ConfigError, TrainguardError


class DetectorError(TrainguardError):
    """Base of every error the detectors raise on purpose."""


class DetectorConfigError(DetectorError, ConfigError):
    """A detector's configuration is malformed (unknown detector name, bad threshold, bad field)."""


class DetectorReadError(DetectorError):
    """An input file or device answered with something that is not in its documented format.

    Attributes:
        path: the file (or device, or command) that was read.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}; check the file or driver, or exclude it from the detector's config")
        self.path = path
        self.reason = reason


class RuleFileError(DetectorError):
    """A shipped or operator-supplied rule file is not valid."""
