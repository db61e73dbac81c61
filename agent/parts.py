"""The node agent's three parts as contracts: their states, their transition tables, their interfaces.

A node runs up to three parts, each with a lifecycle of its own; ``trainguard run`` composes all three
(:class:`~trainguard.agent.node.NodeAgent`), a health-only member (the node daemon between jobs) composes
:class:`NodeHealth` and :class:`CoordinatorLink` without a :class:`Supervisor`.

**Supervisor** (:class:`~trainguard.agent.supervisor.LocalSupervisor`): the worker group of the current
generation and the warm standbys for the next one (:data:`SUPERVISOR_TRANSITIONS`)::

                 start                spawned
    INIT -------------> STARTING -------------> RUNNING ---every worker exited 0---> SUCCEEDED
     ^ (also from         | spawn error          |   \\
     |  STOPPED, FAILED,  v                       |    `--process detector: hang--> HUNG
     |  SUCCEEDED)      FAILED <--stopped-.       |                                  |
     |                                    |       | worker failed / stop             | stop
     |                                 STOPPING <-'----------------------------------'
     |                                    | stopped (on request)
     '------------------------------- STOPPED

  STOPPING ends in FAILED when a worker failed or hung, in STOPPED when the stop was asked for. Each worker has
  its own :class:`~trainguard.agent.workers.WorkerState`: STARTING from spawn until it reports through the hook
  (or has lived ``running_after_s``), then RUNNING, HUNG when the process detector says so, and
  SUCCEEDED/FAILED/STOPPED at its end.

**CoordinatorLink** (:class:`~trainguard.agent.coordinator_link.GrpcCoordinatorLink`): register, heartbeat,
report (:data:`LINK_TRANSITIONS`)::

    UNREGISTERED --registered--> WAITING --START/RESTART naming this node--> RUNNING(g) --new table--> RUNNING(g+1)
         ^                        ^   |                                          |
         '------forgotten---------+---+------------------------------------------'  (from WAITING or RUNNING)
                                  |   '-------------STOP-------------.   .---STOP---'
                                  '------STOP, job goes on------- STOPPING
                                                                     | STOP, job over
                                              any --close-->        DONE

**NodeHealth** (:class:`~trainguard.agent.node_health.LocalNodeHealth`): the event source (local detectors, or
a node daemon's events), the predictor, the drain timer, the event bus (:data:`HEALTH_TRANSITIONS`)::

              start              predictor alarm              grace over, or the asked-for
    INIT -------------> WATCHING ---------------> ALARMED ----checkpoint complete-----> DRAINING
                           ^                      (alarm again: stays)                      |
                           '--------------------- drain reported (or found already done) ---'
    any state --stop--> STOPPED

Every illegal move raises :class:`~trainguard.agent.errors.IllegalTransitionError` (see
:mod:`trainguard.agent.lifecycle`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.event_bus import EventBus
    from trainguard.agent.fault_records import FaultRecord
    from trainguard.agent.node_faults import NodeReportLedger
    from trainguard.agent.workers import WorkerGroup
    from trainguard.detectors.events import HealthEvent
    from trainguard.proto import common_pb2, coordinator_pb2


# ---------------------------------------------------------------------------------------------- supervisor


class SupervisorState(enum.Enum):
    """Lifecycle of a node's worker group (one generation at a time)."""

    INIT = "init"
    STARTING = "starting"
    RUNNING = "running"
    HUNG = "hung"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class SupervisorTrigger(enum.Enum):
    """What moves the supervisor."""

    START = "start"
    SPAWNED = "spawned"
    SPAWN_FAILED = "spawn_failed"
    HANG = "hang"
    WORKER_FAILED = "worker_failed"
    ALL_SUCCEEDED = "all_succeeded"
    STOP = "stop"
    STOPPED = "stopped"
    STOPPED_AFTER_FAILURE = "stopped_after_failure"


_S, _ST = SupervisorState, SupervisorTrigger

#: The supervisor's allowed moves; anything else is an :class:`~trainguard.agent.errors.IllegalTransitionError`.
SUPERVISOR_TRANSITIONS: dict[tuple[SupervisorState, SupervisorTrigger], SupervisorState] = {
    **{(s, _ST.START): _S.STARTING for s in (_S.INIT, _S.STOPPED, _S.SUCCEEDED, _S.FAILED)},
    (_S.STARTING, _ST.SPAWNED): _S.RUNNING,
    (_S.STARTING, _ST.SPAWN_FAILED): _S.FAILED,
    (_S.RUNNING, _ST.HANG): _S.HUNG,
    (_S.RUNNING, _ST.WORKER_FAILED): _S.STOPPING,
    (_S.HUNG, _ST.WORKER_FAILED): _S.STOPPING,
    (_S.RUNNING, _ST.ALL_SUCCEEDED): _S.SUCCEEDED,
    (_S.RUNNING, _ST.STOP): _S.STOPPING,
    (_S.HUNG, _ST.STOP): _S.STOPPING,
    (_S.STOPPING, _ST.STOP): _S.STOPPING,
    (_S.STOPPING, _ST.STOPPED): _S.STOPPED,
    (_S.STOPPING, _ST.STOPPED_AFTER_FAILURE): _S.FAILED,
}


@runtime_checkable
class SupervisorHook(Protocol):
    """Something the supervisor calls on every loop turn: a drill's fault injector (see
    :class:`trainguard.drill.inject.StepFaultInjector`), never production code."""

    def on_tick(self, generation: int, group: "WorkerGroup") -> None:
        """Called with the running generation's workers once per loop turn."""

    def injected_at(self, generation: int, rank: int) -> float | None:
        """When this hook struck ``rank`` in ``generation`` (Unix seconds), for the fault timeline."""


class Supervisor(Protocol):
    """The contract of a node's worker supervisor (see the module docstring for its states)."""

    @property
    def state(self) -> SupervisorState:
        """The current lifecycle state."""

    @property
    def generation(self) -> int:
        """Generation of the current (or last) worker group; -1 before the first."""

    @property
    def group(self) -> "WorkerGroup | None":
        """The current generation's workers, if any run (or ran and were not stopped)."""

    fault_records: list["FaultRecord"]

    def start(self, table: "common_pb2.RankTable") -> bool:
        """Starts this node's ranks of ``table``; False when the table has none here."""

    def stop(self, keepalive: Callable[[], None] | None = None) -> None:
        """Stops the workers (SIGTERM, then SIGKILL after the grace)."""

    def poll(self) -> "WorkerFailure | None":
        """Reaps ended workers; returns the first failure of this generation, if any."""

    def mark_hung(self, event: "HealthEvent") -> int | None:
        """Takes the process detector's hang verdict; returns the hung rank (None: not a current worker)."""


class WorkerFailure(Protocol):
    """What :meth:`Supervisor.poll` returns about a failed worker."""

    rank: int
    exit_code: int | None
    error: str | None
    record: "FaultRecord"


# ---------------------------------------------------------------------------------------- coordinator link


class LinkState(enum.Enum):
    """Lifecycle of a node's membership in one coordinator's job."""

    UNREGISTERED = "unregistered"
    WAITING = "waiting"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


class LinkTrigger(enum.Enum):
    """What moves the coordinator link."""

    REGISTERED = "registered"
    GENERATION = "generation"
    IDLE = "idle"
    FORGOTTEN = "forgotten"
    STOP = "stop"
    JOB_ENDED = "job_ended"
    CLOSE = "close"


_L, _LT = LinkState, LinkTrigger

#: The link's allowed moves.
LINK_TRANSITIONS: dict[tuple[LinkState, LinkTrigger], LinkState] = {
    (_L.UNREGISTERED, _LT.REGISTERED): _L.WAITING,
    (_L.WAITING, _LT.GENERATION): _L.RUNNING,
    (_L.RUNNING, _LT.GENERATION): _L.RUNNING,
    (_L.WAITING, _LT.IDLE): _L.WAITING,
    (_L.RUNNING, _LT.IDLE): _L.WAITING,
    (_L.WAITING, _LT.FORGOTTEN): _L.UNREGISTERED,
    (_L.RUNNING, _LT.FORGOTTEN): _L.UNREGISTERED,
    (_L.WAITING, _LT.STOP): _L.STOPPING,
    (_L.RUNNING, _LT.STOP): _L.STOPPING,
    (_L.STOPPING, _LT.JOB_ENDED): _L.DONE,
    (_L.STOPPING, _LT.IDLE): _L.WAITING,
    **{(s, _LT.CLOSE): _L.DONE for s in LinkState},
}


class HeartbeatContent(Protocol):
    """What a heartbeat says about this node's workers (:class:`NoWorkers` for a health-only member)."""

    def heartbeat_fields(self) -> Mapping[str, object]:
        """``NodeHeartbeatRequest`` fields: generation, workers_running, last_step, workers_succeeded,
        timings."""


class NoWorkers:
    """Heartbeat content of a member that runs no workers (a node daemon reporting health between jobs)."""

    def heartbeat_fields(self) -> Mapping[str, object]:
        """No generation, nothing running."""
        return {"generation": -1, "workers_running": 0, "last_step": -1, "workers_succeeded": False}


class CoordinatorLink(Protocol):
    """The contract of a node's connection to its job's coordinator (states in the module docstring)."""

    @property
    def state(self) -> LinkState:
        """The current lifecycle state."""

    @property
    def connected(self) -> bool:
        """Whether a coordinator is dialled (False for a standalone node: reports go nowhere)."""

    reports: "NodeReportLedger"

    def open(self) -> None:
        """Dials and registers (UNREGISTERED -> WAITING)."""

    def heartbeat(self, content: HeartbeatContent) -> "coordinator_pb2.NodeHeartbeatResponse | None":
        """One heartbeat; None when the coordinator could not be reached (or forgot this node)."""

    def follow(self, resp: "coordinator_pb2.NodeHeartbeatResponse", node_id: str) -> None:
        """Moves the link's state after the command in ``resp``."""

    def report(self, event: "HealthEvent", level: int, generation: int, rank: int = -1, code: int = 0) -> None:
        """Reports an event to the coordinator (never raises for an unreachable one)."""

    def report_node(self, event: "HealthEvent", generation: int, rank: int = -1, code: int = 0) -> None:
        """Reports a node- (or job-) level fault of ``generation`` once."""

    def close(self) -> None:
        """Leaves (any state -> DONE) and closes the channel."""


# --------------------------------------------------------------------------------------------- node health


class HealthState(enum.Enum):
    """Lifecycle of a node's health watch."""

    INIT = "init"
    WATCHING = "watching"
    ALARMED = "alarmed"
    DRAINING = "draining"
    STOPPED = "stopped"


class HealthTrigger(enum.Enum):
    """What moves the node's health watch."""

    START = "start"
    ALARM = "alarm"
    DRAIN_DUE = "drain_due"
    DRAINED = "drained"
    STOP = "stop"


_H, _HT = HealthState, HealthTrigger

#: Node health's allowed moves.
HEALTH_TRANSITIONS: dict[tuple[HealthState, HealthTrigger], HealthState] = {
    (_H.INIT, _HT.START): _H.WATCHING,
    (_H.INIT, _HT.ALARM): _H.ALARMED,  # a predictor scored before the event source started (tests, tools)
    (_H.WATCHING, _HT.ALARM): _H.ALARMED,
    (_H.ALARMED, _HT.ALARM): _H.ALARMED,
    (_H.ALARMED, _HT.DRAIN_DUE): _H.DRAINING,
    (_H.DRAINING, _HT.DRAINED): _H.WATCHING,
    (_H.DRAINING, _HT.ALARM): _H.ALARMED,
    **{(s, _HT.STOP): _H.STOPPED for s in HealthState},
}


class EventSource(Protocol):
    """Where a node's health events and metrics come from: the local detectors
    (:class:`~trainguard.agent.node_health.DetectorEventSource`) or, later, a node daemon's event stream."""

    hardware_names: tuple[str, ...]

    def start(self, on_event: Callable[["HealthEvent"], None]) -> None:
        """Starts delivering events to ``on_event`` (from the source's own threads)."""

    def stop(self) -> None:
        """Stops delivering events and releases the source."""

    def latest_metrics(self) -> dict[str, float]:
        """The newest value of every metric (the predictor's input)."""

    def statuses(self) -> list:
        """Per-detector :class:`~trainguard.detectors.runner.DetectorStatus` (active conditions included)."""

    def sample_now(self, names: Sequence[str], timeout_s: float) -> list | None:
        """Asks the named hardware detectors for an out-of-schedule sample; None when it did not finish."""


class NodeHealth(Protocol):
    """The contract of a node's health watch (states in the module docstring)."""

    bus: "EventBus"

    @property
    def state(self) -> HealthState:
        """The current lifecycle state."""

    @property
    def score(self) -> float:
        """The predictor's last risk score in [0, 1]."""

    @property
    def threshold(self) -> float:
        """The alarm threshold in force: the configured one, else the model's calibrated one."""

    def start(self, source: EventSource | None) -> None:
        """Starts watching (INIT -> WATCHING)."""

    def tick(self, step_time_s: float | None) -> None:
        """Scores one predictor sample when its interval has passed."""

    def take_actionable(self) -> list["HealthEvent"]:
        """Events that ask for a restart or more, not handled yet (the caller acts on them)."""

    def stop(self) -> None:
        """Stops the event source (any state -> STOPPED)."""


__all__ = [
    "CoordinatorLink", "EventSource", "HEALTH_TRANSITIONS", "HealthState", "HealthTrigger", "HeartbeatContent",
    "LINK_TRANSITIONS", "LinkState", "LinkTrigger", "NoWorkers", "NodeHealth", "SUPERVISOR_TRANSITIONS",
    "Supervisor", "SupervisorHook", "SupervisorState", "SupervisorTrigger", "WorkerFailure",
]
