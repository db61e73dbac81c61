"""The root of trainguard's error hierarchy.

Each subsystem has one base class derived from :class:`TrainguardError` (``CheckpointError``,
``DetectorError``, ``RecoveryError``, ``AgentError``) and specific subclasses beside its code. Callers that
only want "anything trainguard refused" catch :class:`TrainguardError`; the CLI turns it into a one-line
message and a non-zero exit instead of a traceback.
"""

from __future__ import annotations


class TrainguardError(Exception):
    """Base of every error trainguard raises on purpose.

    Messages say what is wrong and what to do about it, in one line.
    """


class ConfigError(TrainguardError):
    """A configuration file, flag or environment variable is malformed or inconsistent."""


class UsageError(TrainguardError):
    """The command line asks for something that cannot be done (missing script, bad flag value...)."""
