"""Coordinator and recovery: membership, rank assignment, multi-level recovery decisions, durable job state.

Public entry points: :class:`CoordinatorServer` (gRPC server for one job, embedded by ``trainguard run`` or
run alone by ``trainguard coordinator``), :class:`JobSpec` (the job's parameters), :func:`assign_ranks` (the
pure rank layout function) and :func:`open_store` (state stores by URL).
"""

from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.ranks import NodeSpec, RankLayout, assign_ranks
from trainguard.recovery.service import CoordinatorServer, CoordinatorService, JobSpec
from trainguard.recovery.store import open_store

__all__ = ["CoordinatorServer", "CoordinatorService", "JobCoordinator", "JobSpec", "NodeSpec", "RankLayout",
           "assign_ranks", "open_store"]
