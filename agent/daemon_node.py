"""The node as the daemon serves it on ``trainguard.v1.NodeAgent``: node health's events and risk, no workers.

``trainguard agent`` composes :class:`~trainguard.agent.node_health.LocalNodeHealth` (detectors, predictor, event
bus) and its coordinator reporting (:mod:`trainguard.agent.daemon_jobs`) directly; it runs no workers, so it has
no supervisor and no coordinator link of a job. :class:`DaemonNode` is what its local gRPC service
(:class:`~trainguard.agent.local_server.NodeAgentService`) reads: the same ``GetHealth`` snapshot and
``WatchEvents`` stream a ``trainguard run`` node serves, with the worker parts empty. Workers of an attached
job heartbeat to their own launcher (its socket), not to the daemon.
"""

from __future__ import annotations

import threading
import time

from trainguard._version import __version__
from trainguard.agent.event_bus import EventBus
from trainguard.agent.node_health import LocalNodeHealth
from trainguard.proto import agent_pb2


class DaemonNode:
    """What the daemon's local service answers from (implements
    :class:`~trainguard.agent.local_server.ServedNode`).

    Args:
        node_id: the daemon's ``agent.node_id``.
        health: the daemon's node health (event bus, predictor score and threshold in force).
    """

    #: The daemon runs no workers: never a generation.
    generation = -1

    def __init__(self, node_id: str, health: LocalNodeHealth) -> None:
        self.node_id = node_id
        self.health = health
        self.stopping = False  # set at shutdown: ends WatchEvents streams
        self.started_at = time.monotonic()  # for the uptime: a duration, so no wall-clock steps in it
        self.last_checkpoint_step = -1
        self._lock = threading.Lock()

    @property
    def bus(self) -> EventBus:
        """The node's event bus (node health's)."""
        return self.health.bus

    def on_worker_heartbeat(self, rank: int, pid: int, generation: int, step: int, step_time_s: float,
                            finished: bool = False, sections: object = None, acked: object = None) -> list:
        """A worker heartbeat reaching the daemon: no worker of the daemon's, so no advisory for it."""
        return []

    def on_checkpoint_report(self, report: agent_pb2.CheckpointReport) -> None:
        """Records a durable checkpoint step reported on the daemon's socket (shown in ``GetHealth``)."""
        with self._lock:
            self.last_checkpoint_step = max(self.last_checkpoint_step, report.step)

    def health_snapshot(self, max_events: int = 20) -> agent_pb2.NodeHealth:
        """The node's health now as a ``NodeHealth`` message (no job, no workers)."""
        h = agent_pb2.NodeHealth(
            node_id=self.node_id,
            version=__version__,
            uptime_s=time.monotonic() - self.started_at,
            predictor_score=self.health.score,
            predictor_threshold=self.health.threshold,
            generation=self.generation,
            last_checkpoint_step=self.last_checkpoint_step,
        )
        for ev in self.bus.recent(max_events):
            h.recent_events.append(ev.to_proto())
        return h


__all__ = ["DaemonNode"]
