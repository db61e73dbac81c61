"""A worker's part of the coordinator's restore plan: which steps it may restore from its own node's memory.

The memory tier alone counts a step complete only when every rank's copy lies on this host. In a multi-node job
each node holds its own ranks' copies; the coordinator, which hears every node's verified holdings, tells each
worker of a new generation (through :data:`~trainguard.checkpoint.config.RESTORE_PLAN_ENV`, set by the node agent)
the steps whose every rank's copy lies in its own node's memory. The Checkpointer then lists those steps in its
memory tier when this rank's own copy is here, and restores them from it (a same-world-size restore reads only
the rank's own copy). The ranks still agree on one step afterwards, so a copy replaced since the plan was made
costs a fallback to disk, never a mixed restore.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Set

from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.config import RESTORE_PLAN_ENV, CheckpointConfig

log = logging.getLogger(__name__)


def job_memory_steps_from_env() -> frozenset[int]:
    """The ``memory_steps`` of the restore plan in :data:`RESTORE_PLAN_ENV` (empty when unset or malformed)."""
    raw = os.environ.get(RESTORE_PLAN_ENV)
    if not raw:
        return frozenset()
    try:
        return frozenset(int(s) for s in json.loads(raw).get("memory_steps", ()))
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring a malformed %s (%s); restoring from complete tiers only", RESTORE_PLAN_ENV, exc)
        return frozenset()


def own_memory_steps(config: CheckpointConfig, job: str, rank: int, world_size: int,
                     planned: Set[int]) -> set[int]:
    """The ``planned`` steps of which ``rank``'s own copy, saved at ``world_size``, lies in this node's memory."""
    if not planned:
        return set()
    listing = arena_mod.memory_manifests(config.memory.directory, job, config.location)
    return {s for s in planned
            if (c := listing.get(s, {}).get(rank)) is not None and c[1].world_size == world_size}
