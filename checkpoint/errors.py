"""Errors of the checkpoint subsystem.

:class:`CheckpointError` is the one base; callers that only care whether a checkpoint operation failed catch it.
Messages say what is wrong and what to do, in one line.
"""

from __future__ import annotations

from trainguard.errors import ConfigError, TrainguardError


class CheckpointError(TrainguardError):
    """Base of every error the checkpoint subsystem raises on purpose."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """A checkpoint configuration value is malformed or inconsistent."""


class StorageUnavailableError(CheckpointError):
    """A tier cannot be written or read (unwritable directory, full disk, unreachable remote)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's manifest or data fails its checksums or is torn; it must not be loaded."""


class WorldSizeMismatchError(CheckpointError):
    """The checkpoint was written by a different number of ranks and the state is not replicated."""


class StateMismatchError(CheckpointError):
    """The checkpoint's structure does not fit the state it is restored into (missing key, shape, dtype)."""


class UnsupportedValueError(CheckpointError):
    """The state holds a value the checkpoint format cannot store (sparse, quantized or complex32 tensor...)."""


class ArenaOwnedError(CheckpointError):
    """Another live process already writes this (job, rank)'s shared-memory staging area."""


class NoCheckpointError(CheckpointError):
    """A specific step was asked for and no tier holds a complete, valid copy of it."""
