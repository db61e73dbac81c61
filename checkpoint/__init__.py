"""trainguard.checkpoint: tiered asynchronous checkpoints (shared memory, local disk, fsspec remote).

Public API::

    from trainguard.checkpoint import Checkpointer, CheckpointConfig

Torch is imported lazily so ``trainguard.checkpoint.config``/``service`` stay cheap for the agent and CLI.
"""

from trainguard.checkpoint.config import (
    CHECKPOINT_SERVICE_ENV,
    CheckpointConfig,
    DiskTierConfig,
    MemoryTierConfig,
    PersistConfig,
    RemoteTierConfig,
)
from trainguard.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StateMismatchError,
    StorageUnavailableError,
    WorldSizeMismatchError,
)

__all__ = [
    "CHECKPOINT_SERVICE_ENV", "CheckpointConfig", "MemoryTierConfig", "DiskTierConfig", "RemoteTierConfig",
    "PersistConfig", "Checkpointer", "SaveHandle", "StepInfo", "CheckpointError", "CorruptCheckpointError",
    "NoCheckpointError", "StateMismatchError", "StorageUnavailableError", "WorldSizeMismatchError", "LocalShard",
]


def __getattr__(name: str):
    if name in ("Checkpointer", "SaveHandle", "StepInfo"):
        from trainguard.checkpoint import checkpointer

        return getattr(checkpointer, name)
    if name == "LocalShard":
        from trainguard.checkpoint.tree import LocalShard

        return LocalShard
    raise AttributeError(f"module 'trainguard.checkpoint' has no attribute {name!r}")
