"""What the coordinator does with node daemons' health reports: keep them, and fail a node on a fatal one.

A node daemon reports its node's verdict continuously, between jobs too (:mod:`~trainguard.recovery.node_health`
holds the table). :class:`DaemonReports` records each report and decides whether it is a new fault of this job:
a FATAL verdict, new since the daemon's last report, about a node not cordoned already, while the job still
runs. The coordinator applies that failure through the policy's ordinary node-failure path.

Only a node the coordinator knows (one that registered) is cordoned in the stored job state. A fatal report about
any other node is *held*: the daemon's latch in the (bounded, in-memory) table keeps the node out, and the cordon
is applied when the node registers (:meth:`DaemonReports.held_reason`). A daemon may report before its node's
launcher registers, and such a node still never gets a rank; but reports naming made-up ids no longer fill the
job state's cordon list, which every state write carries whole (thousands of them neared etcd's request limit).

A held cordon is stored too, one small record per node (``held/<node id>``, see :mod:`.job_records`), written
when it is held and deleted when it is applied or dropped: a coordinator restarted over the same store reads them
back (:meth:`DaemonReports.restore`). Kept in memory only, a restart lost them, and the node registered and got
work until its daemon's next fatal report. One record per node, as for node records, so none of them grows with
the count; their count is bounded by the table's (a fatal row is never dropped to make room).

It is not thread-safe on its own: :class:`~trainguard.recovery.coordinator.JobCoordinator` calls
:meth:`DaemonReports.record` with its lock held; the table is thread-safe and is read without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainguard.recovery.job_records import StoredHeld, held_value
from trainguard.recovery.node_health import NodeHealthReport, NodeHealthTable, Verdict
from trainguard.recovery.policy import Cause, Failure, Level, Phase, PolicyState

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split


class DaemonReports:
    """Node daemons' reports to one job's coordinator.

    Args:
        job: the job name, for log lines.
        persist: ``persist(node_id, value)`` stores a held cordon's record (``value``: :func:`.job_records.held_value`)
            or deletes it (None); called with the coordinator's lock held.
    """

    def __init__(self, job: str, persist: Callable[[str, bytes | None], None] = lambda _n, _v: None) -> None:
        self._job = job
        self._persist = persist
        self.table = NodeHealthTable()  # what node daemons report: see record
        # Nodes whose daemon latched a fatal fault while they were not registered: the cordon their registration
        # applies. Only those: a member's latch was applied already (one failure per latch, see record).
        self._held: set[str] = set()

    def record(self, report: NodeHealthReport, now: float, st: PolicyState,
               excluded: Callable[[str], bool], fail: Callable[[Failure], None],
               wall: Callable[[], float], limit: int | None = None, silent_after_s: float = 0.0,
               known: Callable[[str], bool] = lambda _: True) -> tuple[bool, str]:
        """Records a report and fails its node on a new fatal verdict (call with the coordinator's lock held).

        One failure per fatal latch: a job that restarts on the node anyway (one node, nowhere else to go) must
        not see every later report (each interval) as a new fault burning its restart budget.

        Args:
            report: the report.
            now: the coordinator's monotonic clock, seconds.
            st: the job's policy state now (read before the failure is applied).
            excluded: whether a node is cordoned, or about to be by the pending plan.
            fail: applies a node failure (the policy's node-failure path).
            wall: the wall clock for the failure's time.
            limit: most rows kept (see :meth:`NodeHealthTable.record`); None: no bound.
            silent_after_s: a row silent this long may make room for a new node's.
            known: whether a node registered; another node's fatal verdict is held, not applied (see the module).

        Returns:
            (whether the node is cordoned in this job now, the message for the daemon).

        Raises:
            CapacityError: a new node's report while the table is full (see :meth:`NodeHealthTable.record`).
        """
        newly = self.table.record(report, now, limit, silent_after_s)
        nid = report.node_id
        running = st.phase not in (Phase.SUCCEEDED, Phase.FAILED)
        if running and not known(nid) and not excluded(nid):
            if newly:
                self._held.add(nid)
                self._persist(nid, held_value(self.table.get(nid).fatal_reason, report.instance,  # type: ignore
                                              report.host))
            held = self.held_reason(nid)
            if newly:
                log.warning("job %s: node %s, not registered, is kept out of the job on its daemon's report: %s",
                            self._job, nid, held)
            return (True, f"node {nid} cordoned: {held} (it has not registered; it is kept out when it does)") \
                if held else (False, "noted")
        if report.verdict is Verdict.FATAL and newly and not excluded(nid) and running:
            fail(Failure(nid, st.generation, Cause.NODE_CRITICAL, Level.NODE,
                         detail=f"node daemon reports a fatal fault: {report.reason}", time_s=wall()))
            cordoned = excluded(nid) or nid in self._held  # held: the cordon list was full (see hold)
            if cordoned:
                log.warning("job %s: node %s cordoned on its daemon's report: %s", self._job, nid, report.reason)
            return cordoned, f"node {nid} {'cordoned' if cordoned else 'failed'}: {report.reason}"
        cordoned = excluded(nid)
        return cordoned, f"node {nid} is cordoned" if cordoned else "noted"

    def held_reason(self, node_id: str) -> str:
        """The fatal fault the node's daemon latched while the node had not registered ("" when none, or when a
        restarted daemon's report reset the latch): the cordon the coordinator applies when it registers."""
        if node_id not in self._held:
            return ""
        row = self.table.get(node_id)
        if row is None or not row.fatal_reason:
            self.release(node_id)
            return ""
        return row.fatal_reason

    def held(self) -> list[str]:
        """Every node with a held cordon (see :meth:`held_reason`)."""
        return sorted(n for n in list(self._held) if self.held_reason(n))

    def release(self, node_id: str) -> None:
        """The node's held cordon was applied at its registration, or an operator dropped it: its record goes."""
        if node_id in self._held:
            self._held.discard(node_id)
            self._persist(node_id, None)

    def stored_value(self, node_id: str) -> bytes | None:
        """What the node's held cordon record holds now (None: no record), to write again after a store failure."""
        reason = self.held_reason(node_id)
        row = self.table.get(node_id)
        return held_value(reason, row.report.instance, row.report.host) if reason and row is not None else None

    def hold(self, node_id: str) -> None:
        """Holds the node's latched fault as for a node not registered: the coordinator forgot the member because
        the job state's cordon list is full (see :meth:`~trainguard.recovery.spec.JobSpec.cordon_limit`), and applies
        it if it registers again."""
        row = self.table.get(node_id)
        if row is not None and row.fatal_reason and node_id not in self._held:
            self._held.add(node_id)
            self._persist(node_id, held_value(row.fatal_reason, row.report.instance, row.report.host))

    def restore(self, held: StoredHeld, now: float) -> None:
        """Holds a cordon read back from the store at a coordinator start, with its daemon's latch in the table
        (the same daemon's next reports keep it, a restarted daemon's healthy ones clear it, as before the restart).
        """
        self.table.restore(NodeHealthReport(self._job, held.node_id, held.host, Verdict.FATAL, held.reason,
                                            instance=held.instance), now, held.reason)
        self._held.add(held.node_id)

    def silent(self, now: float, after_s: float) -> list[str]:
        """Nodes whose daemon reported before but not for ``after_s`` (shown only, never cordoned)."""
        return self.table.silent(now, after_s)

    def cordon_reason(self, node_id: str) -> str:
        """Why a node was cordoned when its daemon said so ("" otherwise: the policy's message tells)."""
        return self.table.fatal().get(node_id, "")
