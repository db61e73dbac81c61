"""Errors of the coordinator and the recovery machinery."""

from __future__ import annotations

from trainguard.errors import TrainguardError


class RecoveryError(TrainguardError):
    """Base of every error the coordinator and recovery code raise on purpose."""


class CoordinatorError(RecoveryError):
    """The coordinator cannot start or serve (address in use, unreadable store...)."""


# --- Specific errors of rank assignment, the state store and the coordinator's request validation. The
# coordinator service maps each one to one precise gRPC status code.


class MembershipError(RecoveryError):
    """The membership cannot be laid out into a valid rank table (bad labels, short pods, vacant slots)."""


class VacancyError(MembershipError):
    """Rank slots of the previous generation that no member can fill (the message names each slot's need)."""


class GroupSizeError(MembershipError):
    """A pod's rank count is not a multiple of the parallel group size, or a group would span pods."""


class StoreError(RecoveryError):
    """The state store cannot be reached, read or written (I/O error, etcd down, corrupt record)."""


class StoreURLError(StoreError):
    """A store URL is malformed or names an unknown backend."""


class FencedError(StoreError):
    """Another coordinator took over the job's state: this one's fencing token is stale and it must stop."""


class PolicyError(RecoveryError):
    """The recovery policy was asked for a transition its table does not allow."""


class RequestError(RecoveryError):
    """A coordinator request is refused; the service maps each subclass to one gRPC status code."""


class UnknownJobError(RequestError):
    """The request names a job this coordinator does not run (NOT_FOUND)."""


class InvalidRequestError(RequestError):
    """A field is missing, malformed or out of range (INVALID_ARGUMENT)."""


class UnknownNodeError(RequestError):
    """The node is not registered (NOT_FOUND): register first."""


class StaleLeaseError(RequestError):
    """The lease is not the node's current one (FAILED_PRECONDITION): register again."""


class DuplicateNodeError(RequestError):
    """The node id is held by another live agent (ALREADY_EXISTS)."""


class SlotTakenError(RequestError):
    """The node claims the slot of a node that is alive and holds it (FAILED_PRECONDITION)."""


class StaleGenerationError(RequestError):
    """The request names a generation this job never had (OUT_OF_RANGE)."""


class NodeRefusedError(RequestError):
    """The node failed its pre-flight qualification and is cordoned (FAILED_PRECONDITION): it gets no rank."""


class CapacityError(RequestError):
    """The coordinator keeps as many node ids as it may and none can be dropped (RESOURCE_EXHAUSTED)."""


class NotServingError(RequestError):
    """The coordinator cannot serve: its store failed or another coordinator took the job over (UNAVAILABLE)."""
