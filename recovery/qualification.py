"""Node qualification as the coordinator sees it: a node that failed its pre-flight check never takes a slot.

A node brings the verdict of its pre-flight check (:mod:`trainguard.agent.qualify`) to its registration, and a
node waiting without a slot (a spare, a standby) sends each new verdict with a heartbeat. A failed verdict:

- cordons the node with the reason (the policy's cordon list, so it is excluded from the first generation, from
  every vacancy a spare fills, and the scheduler cordon hooks of :mod:`~trainguard.recovery.cordon` mark it),
- refuses its registration (FAILED_PRECONDITION naming the reason; the launcher ends with it), and
- for a node that holds a slot while it runs (an agent restarted on a node that now fails), is a node-level
  failure: the slot goes to a spare, as for any node-level fault.

Peers: a node that passed and serves timed exchanges (its ``echo_port``) is handed, with a few others, to the
next nodes that qualify (:meth:`~trainguard.recovery.coordinator.JobCoordinator.qualify_peers`), with the
median of the exchange times the qualified nodes measured (:class:`PeerTimes`, in memory) as their reference.

The node stays cordoned for the job, even if a later check passes (a link that narrowed once is a failing part);
the reason is kept in its durable node record, so a restarted coordinator refuses it the same way.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Qualification:
    """A node's pre-flight verdict, as the coordinator keeps it.

    Attributes:
        passed: the node may take a slot.
        reason: why it may not, one line ("" when it passed).
        duration_s: how long the node's check took, seconds.
        echo_port: where the node answers peers' timed exchanges on its address (0: it does not).
        peer_s: its median exchange time with its peers, seconds (0: none measured).
    """

    passed: bool
    reason: str = ""
    duration_s: float = 0.0
    echo_port: int = 0
    peer_s: float = 0.0

    @property
    def refusal(self) -> str:
        """The cordon reason this verdict gives ("" when it passed)."""
        return "" if self.passed else f"failed qualification: {self.reason or 'no reason given'}"


class PeerTimes:
    """Exchange times of the nodes that qualified, for the next node's comparison (the last ``keep``).

    Args:
        keep: how many recent times the reference is the median of.
    """

    def __init__(self, keep: int = 64) -> None:
        self._times: deque[float] = deque(maxlen=keep)

    def record(self, seconds: float) -> None:
        """Keeps a qualified node's median exchange time."""
        if seconds > 0:
            self._times.append(seconds)

    def reference(self) -> tuple[float, int]:
        """(median of the kept times, how many), (0.0, 0) when none."""
        return (statistics.median(self._times), len(self._times)) if self._times else (0.0, 0)


def refusal_message(node_id: str, reason: str) -> str:
    """The one line a refused node's registration gets."""
    return f"node {node_id!r} is cordoned ({reason}); it gets no rank in this job: repair it and start a new job"


__all__ = ["PeerTimes", "Qualification", "refusal_message"]
