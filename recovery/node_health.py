"""The coordinator's per-node health table: what each node's daemon last said about its node.

A node daemon (``trainguard agent`` with a coordinator configured, or attached by ``trainguard run``) reports
its node's verdict continuously, between jobs too. The table keeps the latest report per node id and answers
two questions for the coordinator:

- which nodes must be cordoned: a node whose daemon reported :attr:`Verdict.FATAL` (a node-level fault such as
  a fatal PCIe AER error, a GPU gone, a link down). The verdict is sticky for that daemon process, as the
  daemon's own latch is: a later HEALTHY report from the same instance changes nothing; a restarted daemon (a new
  instance, as after a repair) starts with a clean slate, and the coordinator may return the node to service
  (see :meth:`~trainguard.recovery.coordinator.JobCoordinator.report_node_health`).
- which nodes went silent: reported once, then stopped. Silence alone is *not* a reason to cordon (a daemon
  restarting, or a node between jobs without a daemon, is not a sick node); it is only shown.

Plain types only: the service converts protobuf in :mod:`trainguard.recovery.convert`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from trainguard.recovery.errors import CapacityError


class Verdict(enum.IntEnum):
    """A daemon's verdict on its node, ordered: larger is worse."""

    HEALTHY = 1
    DEGRADED = 2  # predictor alarm or warnings: shown, never cordoned for
    FATAL = 3  # a node-level fault: cordon


@dataclass(frozen=True)
class NodeHealthReport:
    """One report of a node's daemon.

    Attributes:
        job: job named by the reporter; ``""`` means the job this coordinator serves.
        node_id: the node reported about.
        host: scheduler node name (for cordon hooks); ``""`` when unknown.
        verdict: the daemon's verdict.
        reason: one line saying why (the fault event's message for FATAL).
        risk: the predictor's score in [0, 1].
        instance: random id of the reporting daemon process.
    """

    job: str
    node_id: str
    host: str
    verdict: Verdict
    reason: str = ""
    risk: float = 0.0
    instance: str = ""


@dataclass(frozen=True)
class NodeHealthEntry:
    """The table's row of one node.

    Attributes:
        report: the newest report.
        received_s: when it arrived (the coordinator's monotonic clock), seconds.
        fatal_reason: the reason of the first FATAL report ("" while the node never reported one).
        healthy_streak: HEALTHY reports in a row from this daemon instance (its newest included).
    """

    report: NodeHealthReport
    received_s: float
    fatal_reason: str = ""
    healthy_streak: int = 0

    def silent(self, now_s: float, after_s: float) -> bool:
        """Whether the daemon has not reported for more than ``after_s`` seconds."""
        return now_s - self.received_s > after_s


class NodeHealthTable:
    """Latest daemon report per node; thread-safe."""

    def __init__(self) -> None:
        """Creates an empty table."""
        self._lock = threading.Lock()
        self._rows: dict[str, NodeHealthEntry] = {}

    def record(self, report: NodeHealthReport, now_s: float, limit: int | None = None,
               silent_after_s: float = 0.0) -> bool:
        """Keeps ``report`` as the node's newest.

        Args:
            report: the report.
            now_s: arrival time, seconds (monotonic).
            limit: most rows kept (None: no bound). A new node's report when full replaces the row silent longest,
                if it is silent for ``silent_after_s`` and never latched a fatal fault (a cordon's reason).
            silent_after_s: see ``limit``, seconds.

        Returns:
            True when this report makes the node newly fatal (its first FATAL verdict from this daemon instance).

        Raises:
            CapacityError: the table is full and no row can go: reports naming made-up node ids grew it without
                end before.
        """
        with self._lock:
            old = self._rows.get(report.node_id)
            if old is None and limit is not None and len(self._rows) >= limit:
                self._make_room(report.node_id, now_s, limit, silent_after_s)
            same_daemon = old is not None and old.report.instance == report.instance
            fatal_reason = old.fatal_reason if old is not None and same_daemon else ""
            newly = report.verdict is Verdict.FATAL and not fatal_reason
            if newly:
                fatal_reason = report.reason or "fatal fault reported by the node daemon"
            healthy = report.verdict is Verdict.HEALTHY
            streak = (old.healthy_streak + 1 if same_daemon else 1) if healthy else 0
            self._rows[report.node_id] = NodeHealthEntry(report, now_s, fatal_reason, streak)
            return newly

    def _make_room(self, node_id: str, now_s: float, limit: int, silent_after_s: float) -> None:
        """Drops the row silent longest that may go (lock held), or raises :class:`CapacityError`."""
        quiet = [(e.received_s, n) for n, e in self._rows.items()
                 if not e.fatal_reason and e.silent(now_s, silent_after_s)]
        if not quiet:
            raise CapacityError(
                f"node daemon report for {node_id!r} refused: the coordinator keeps reports of {len(self._rows)} "
                f"nodes, its limit ({limit}), all of them recent or fatal; check for a client reporting made-up "
                "node ids")
        del self._rows[min(quiet)[1]]

    def restore(self, report: NodeHealthReport, now_s: float, fatal_reason: str) -> None:
        """Puts back a fatal latch read from the store (a coordinator restarted while it held a node's cordon): as if
        ``report`` had just arrived, so the same daemon's next reports keep the latch and a restarted one's clear it.
        """
        with self._lock:
            self._rows[report.node_id] = NodeHealthEntry(report, now_s, fatal_reason, 0)

    def rearm(self, node_id: str) -> None:
        """Forgets the node's fatal latch (an operator returned it to service): its daemon's next FATAL report,
        from the instance that latched too, is a new fault."""
        with self._lock:
            old = self._rows.get(node_id)
            if old is not None and old.fatal_reason:
                self._rows[node_id] = NodeHealthEntry(old.report, old.received_s, "", old.healthy_streak)

    def get(self, node_id: str) -> NodeHealthEntry | None:
        """The node's row, or None when its daemon never reported."""
        with self._lock:
            return self._rows.get(node_id)

    def fatal(self) -> dict[str, str]:
        """Node id -> reason, for every node whose daemon ever reported a fatal fault."""
        with self._lock:
            return {n: e.fatal_reason for n, e in self._rows.items() if e.fatal_reason}

    def silent(self, now_s: float, after_s: float) -> list[str]:
        """Node ids whose daemon has not reported for more than ``after_s`` seconds (shown, never cordoned)."""
        with self._lock:
            return sorted(n for n, e in self._rows.items() if e.silent(now_s, after_s))

    def snapshot(self) -> dict[str, NodeHealthEntry]:
        """A copy of every row."""
        with self._lock:
            return dict(self._rows)


__all__ = ["NodeHealthEntry", "NodeHealthReport", "NodeHealthTable", "Verdict"]
