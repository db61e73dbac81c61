"""Errors of the node agent and the ``trainguard run`` launcher."""

from __future__ import annotations

from trainguard.errors import TrainguardError


class AgentError(TrainguardError):
    """Base of every error the node agent raises on purpose."""


class WorkerStartError(AgentError):
    """A worker process could not be started (missing script, bad interpreter, fork failure)."""


class CoordinatorUnavailableError(AgentError):
    """The coordinator did not answer within the configured patience."""


class RegistrationCancelledError(CoordinatorUnavailableError):
    """A stop was asked for while the node still waited to register with an unreachable coordinator."""


class JoinTimeoutError(AgentError):
    """The job's first generation did not form within ``--rdzv-conf join_timeout``: fewer nodes than ``--nnodes``
    joined. torchrun fails its rendezvous the same way; without it the node waited forever."""


class JobFailedError(AgentError):
    """The coordinator declared the job failed (restart budget exhausted or impossible membership)."""


class IllegalTransitionError(AgentError):
    """A part of the node agent was asked for a lifecycle transition its table does not allow (a bug)."""
