"""Coordinator and recovery: membership, rank assignment, multi-level recovery decisions."""

from trainguard.recovery.service import CoordinatorServer, CoordinatorService, JobSpec

__all__ = ["CoordinatorServer", "CoordinatorService", "JobSpec"]
