"""Keeping nodes out of the job: node daemons' verdicts, held cordons, pre-flight refusals, and uncordoning.

Part of :class:`~trainguard.recovery.coordinator.JobCoordinator`: a mixin, whose state the coordinator's ``__init__``
sets up; its methods with a leading underscore run with the coordinator's lock held. A node daemon's fatal verdict
cordons its node through the policy's node-failure path (:mod:`~trainguard.recovery.daemon_reports` keeps the
reports and the cordons held for nodes not registered yet); a failed pre-flight check
(:mod:`~trainguard.recovery.qualification`) cordons the node with its reason; an operator or a restarted daemon
returns a node to service. The job state's cordon list is bounded (:meth:`~trainguard.recovery.spec.JobSpec.
cordon_limit`): past it, a node that must be kept out and holds no slot is refused membership instead.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from trainguard.recovery.decide import DaemonHealthy, NodeDisqualified, OperatorUncordon
from trainguard.recovery.membership import Member
from trainguard.recovery.node_health import NodeHealthReport, Verdict
from trainguard.recovery.policy import Cause, Failure, Level, Phase
from trainguard.recovery.store import Put

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split


class Cordoning:
    """Who is kept out of the job, for :class:`~trainguard.recovery.coordinator.JobCoordinator` (see the module)."""

    def _excluded(self, node_id: str) -> bool:
        """Whether the node is cordoned, or about to be by the pending plan (called with the lock held)."""
        st = self._policy.state
        return node_id in st.cordoned or (st.plan is not None and node_id in st.plan.cordon)

    def _room_to_cordon(self, nid: str) -> bool:
        """Whether ``nid`` may join the job state's cordon list (lock held): a slot holder always may (its failure
        must be handled); any other node while the list is under the spec's ``cordon_limit()`` (``--max-cordoned``)."""
        if self._layout is not None and self._layout.slot_of(nid) is not None:
            return True
        st = self._policy.state
        return len(set(st.cordoned) | set(st.plan.cordon if st.plan else ())) < self.spec.cordon_limit()

    def _no_room(self, nid: str, why: str) -> str:
        """The refusal of a node that must be kept out while the cordon list is full."""
        return (f"node {nid!r} is refused by job {self.spec.job!r} ({' '.join(why.split())[:200]}) instead of "
                f"cordoned: the job state's cordon list holds {self.spec.cordon_limit()} nodes, the most it may "
                "(the state is stored whole at each change, and etcd refuses requests over 1.5 MiB by default); "
                "return repaired nodes to service (`trainguard uncordon NODE`, or restart their node daemon), or "
                "check for a client registering made-up node ids, or raise the coordinator's --max-cordoned")

    def _cordon_held(self, nid: str, now: float) -> None:
        """Applies a held cordon to a node that registered (lock held, or from ``_load``): a node-level failure,
        stored before its held record is deleted."""
        held, st = self._daemons.held_reason(nid), self._policy.state
        self._fail(Failure(nid, st.generation, Cause.NODE_CRITICAL, Level.NODE,
                           detail=f"node daemon reports a fatal fault: {held}", time_s=self._wall()), now)
        self._mver += 1  # the forming layout must drop the node even when the policy state looks unchanged
        self._save_state()
        self._daemons.release(nid)
        log.warning("job %s: node %s cordoned at registration on its daemon's report: %s", self.spec.job, nid, held)

    def _disqualify(self, m: Member, now: float) -> Future | None:
        """Cordons a node that failed qualification (lock held; see :mod:`~trainguard.recovery.qualification`).

        A slot holder of a running generation fails at node level (its slot goes to a spare); any other node only
        joins the cordon list. Returns the state write to wait for, or None when nothing changed.
        """
        nid, st = m.info.node_id, self._policy.state
        if nid in st.cordoned:
            return None
        if self._layout is not None and self._layout.slot_of(nid) is not None \
                and st.phase in (Phase.RUNNING, Phase.RECOVERING):
            self._fail(Failure(nid, st.generation, Cause.NODE_CRITICAL, detail=m.refused, time_s=self._wall()), now)
        elif self._apply(NodeDisqualified(nid, m.refused)).changed:
            self._mver += 1
        return self._state_fut

    def refusal(self, node_id: str) -> str:
        """Why ``node_id`` is refused: the qualification it failed ("" when it did not)."""
        with self._lock:
            m = self._members.get(node_id)
            return m.refused if m is not None and node_id in self._policy.state.cordoned else ""

    def qualify_peers(self, job: str, node_id: str, count: int) -> tuple[list[tuple[str, str, int]], float, int]:
        """Up to ``count`` qualified peers for ``node_id``'s timed exchange, and the reference time.

        Peers are live, not cordoned, serve exchanges, and are picked at random so that many nodes qualifying at
        once spread over the qualified ones.

        Returns:
            ([(node id, address, echo port)], median exchange time of the qualified nodes so far, how many).

        Raises:
            UnknownJobError, NotServingError: wrong job, or this coordinator cannot serve.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(job)
            return self._peers.pick(self._members.values(), node_id, count, set(self._policy.state.cordoned),
                                    lambda m: self._lease_live(m, now))

    def report_node_health(self, report: NodeHealthReport) -> tuple[bool, str, Future | None]:
        """Records a node daemon's verdict; a FATAL one cordons the node through the policy's node-failure path.

        The node need not be registered: a daemon reports between jobs, before its node's launcher registers,
        so the node is kept out before the first generation forms and never gets a rank. Until it registers the
        cordon is held, in a record of its own (see :mod:`~trainguard.recovery.daemon_reports`), and applied to the
        job state at its registration: reports naming made-up ids filled the stored cordon list. A node holding a slot
        gets a node-level recovery (its slot goes to a spare, or the job waits for one). A daemon's silence
        changes nothing.

        Uncordon. A cordoned node stays out while the daemon that was running when it was cordoned keeps
        reporting (HEALTHY included: a latched fault, a slow or crashing node look healthy to it). A HEALTHY report
        from a *restarted* daemon (another instance: what an operator does once the machine is repaired; its
        second in a row, so its detectors have sampled) returns the node to service, as a spare or a waiting
        vacancy's filler, without a new node id or a coordinator restart. A node refused by its pre-flight check,
        or about to be cordoned by the pending plan, stays out (``trainguard uncordon`` overrules those).

        Args:
            report: the report (validated for format by the service).

        Returns:
            (whether the node is cordoned in this job now, message, the store write it depends on or None).

        Raises:
            UnknownJobError, NotServingError: the report names another job, or this coordinator cannot serve.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(report.job or self.spec.job)
            fut_before, held_before = self._state_fut, self._held_fut
            cordoned, message = self._daemons.record(report, now, self._policy.state, self._excluded,
                                                     lambda f: self._fail_node_on_report(f, now), self._wall,
                                                     self.spec.node_id_limit(), 3 * self.report_interval_s(),
                                                     known=lambda n: n in self._members)
            if cordoned and self._may_uncordon(report):
                step = self._apply(DaemonHealthy(report.node_id, report.instance))
                if step.changed:
                    cordoned, message = False, step.state.message
                    self._mver += 1  # a vacancy waiting for a spare is re-planned with this node
                    self._advance()
            if self._state_fut is not fut_before:
                return cordoned, message, self._state_fut
            # A cordon held for a node not registered yet is answered once its record is stored, so a coordinator
            # restarted right after the answer still keeps the node out.
            return cordoned, message, self._held_fut if self._held_fut is not held_before else None

    def uncordon(self, job: str, node_id: str, reason: str = "") -> tuple[bool, str, Future | None]:
        """An operator returns a cordoned node to service (``trainguard uncordon``): a repaired machine with no node
        daemon to vouch for it, or one whose pre-flight refusal they overrule (its record is rewritten without it).

        Args:
            job: job name from the request.
            node_id: the node.
            reason: the operator's one line, for the log.

        Returns:
            (whether it was uncordoned, message, the store write to wait for or None).

        Raises:
            UnknownJobError, NotServingError: wrong job, or this coordinator cannot serve.
        """
        with self._lock:
            self._check_serving(job)
            st = self._policy.state
            # A plan waiting for a spare nobody has: the node may end the wait by taking its slot back, if its agent
            # heartbeats (a slot holder is not checked for a live lease at node level: a dead one would be placed).
            m = self._members.get(node_id)
            alive = m is not None and self._lease_live(m, self._clock())
            waiting = self._policy.waiting_for(node_id) and alive
            if st.plan is not None and node_id in st.plan.cordon and not waiting:
                later = ("its agent is not heartbeating: start it, then uncordon it again"
                         if self._policy.waiting_for(node_id) else "uncordon it once that generation runs")
                return False, (f"node {node_id} stays cordoned: generation {st.plan.generation} is replacing it now; "
                               f"{later}"), None
            held = self._daemons.held_reason(node_id) if m is None and node_id not in st.cordoned else ""
            if node_id not in st.cordoned and not waiting and not held:
                return False, f"node {node_id} is not cordoned in job {self.spec.job!r}", None
            row = self._daemons.table.get(node_id)
            if row is not None and row.report.verdict is Verdict.FATAL \
                    and not row.silent(self._clock(), 3 * self._interval_s()):
                # Its daemon latched the fault and still says so: uncordoned, the node would take a slot with its
                # daemon reporting FATAL, and that daemon's reports (never a new fault) could not cordon it again.
                return False, (f"node {node_id} stays cordoned: its node daemon still reports a fatal fault "
                               f"({row.fatal_reason or row.report.reason}); once the machine is repaired restart "
                               "the daemon (its healthy reports return the node), or stop it and uncordon again"), None
            if held:  # kept out on its daemon's report before it registered: nothing stored to rewrite
                self._daemons.release(node_id)
                self._daemons.table.rearm(node_id)
                return True, (f"node {node_id} returned to service: its daemon's fatal report ({held}), held until "
                              "it registers, is dropped"), None
            step = self._apply(OperatorUncordon(node_id, " ".join(reason.split())[:200]), persist=False)
            if not step.changed:
                return False, f"node {node_id} stays cordoned: {st.message}", None
            self._daemons.table.rearm(node_id)  # a fatal report of its daemon from now on is a new fault
            m = self._members.get(node_id)
            if m is not None and m.refused:
                m.refused = ""
                self._submit([Put(self._prefix + "nodes/" + node_id, self._member_value(m))])
            message = step.state.message
            self._mver += 1  # a vacancy waiting for a spare is re-planned with this node
            self._save_state()
            self._advance()
            return True, message, self._state_fut

    def _may_uncordon(self, report: NodeHealthReport) -> bool:
        """Whether a daemon's report may return its cordoned node to service (lock held): the second HEALTHY report
        in a row of its daemon process, and the node neither refused by its pre-flight check nor holding a slot.

        The second, not the first: a daemon just restarted on a machine still broken may send its first report
        before its detectors sampled the fault; one report interval later they have."""
        nid = report.node_id
        m = self._members.get(nid)
        row = self._daemons.table.get(nid)
        return report.verdict is Verdict.HEALTHY and row is not None and row.healthy_streak >= 2 \
            and not (m is not None and m.refused) and (self._layout is None or self._layout.slot_of(nid) is None)

    def _fail_node_on_report(self, f: Failure, now: float) -> None:
        """Applies a daemon's fatal verdict as a node failure (lock held), and moves the job on."""
        m = self._members.get(f.node_id)
        if m is not None and not self._room_to_cordon(f.node_id):
            # Kept out as a node not registered is: its cordon is held (a record of its own), its membership goes,
            # and its agent's next registration is refused while the cordon list stays full.
            log.error("job %s: %s", self.spec.job, self._no_room(f.node_id, f.detail))
            self._forget(m)
            self._daemons.hold(f.node_id)
            self._advance()
            return
        self._fail(f, now)
        self._mver += 1  # the forming layout must drop the node even when the policy state looks unchanged
        self._save_state()
        self._advance()

    def silent_daemons(self) -> list[str]:
        """Nodes whose daemon reported before but not for 3 report intervals (shown only, never cordoned)."""
        return self._daemons.silent(self._clock(), 3 * self._interval_s())

    def report_interval_s(self) -> float:
        """How often node daemons should report: the heartbeat interval told to nodes now."""
        return self._interval_s()

    def cordon_reason(self, node_id: str) -> str:
        """Why a node was cordoned when its daemon said so ("" otherwise: the policy's message tells)."""
        return self._daemons.cordon_reason(node_id)

    def held_cordons(self) -> list[str]:
        """Nodes kept out on their daemon's fatal report before they registered (in records of their own, not the job
        state's cordon list, until they register): the scheduler's cordon hooks mark them too."""
        with self._lock:
            if self._policy.state.phase in (Phase.SUCCEEDED, Phase.FAILED):
                return []
            return [n for n in self._daemons.held() if n not in self._members and not self._excluded(n)]
