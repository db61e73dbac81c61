"""How the coordinator hands fail-slow detection the job's state and takes back its decisions.

All fail-slow logic lives in :mod:`trainguard.recovery.failslow` (:class:`~.failslow.FailSlowSupervisor`);
:class:`FailSlowWiring` only translates between it and the coordinator: the rank-to-node map a report needs,
the findings, stack request and link probes a heartbeat reply carries, the slot holders' addresses for link
probes, and the node failure a replacement decision becomes. The coordinator applies that failure through its
ordinary node-failure path.

It is not thread-safe on its own: :class:`~trainguard.recovery.coordinator.JobCoordinator` calls every method
with its lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from trainguard.recovery.domain import FaultReport, Instruction
from trainguard.recovery.failslow import FailSlowSupervisor
from trainguard.recovery.membership import Member
from trainguard.recovery.policy import Cause, Failure, Level, Phase, PolicyState
from trainguard.recovery.ranks import RankLayout
from trainguard.recovery.straggler import ReplaceDecision

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split


class FailSlowWiring:
    """Translation between a job's coordinator and its fail-slow supervisor (call with the coordinator's lock).

    Args:
        job: the job name, for log lines.
        supervisor: the job's fail-slow supervisor.
    """

    def __init__(self, job: str, supervisor: FailSlowSupervisor) -> None:
        self._job = job
        self._sup = supervisor

    def on_report(self, req: FaultReport, layout: RankLayout | None, generation: int,
                  now: float) -> tuple[str | None, ReplaceDecision | None]:
        """Shows a report to fail-slow.

        Returns:
            (the answer when the report was fail-slow's own (stacks of a hang), else None and the report goes on
            to the policy; a replacement to apply first, or None).
        """
        node_of = {s.first_rank + i: s.node_id for s in layout.slots for i in range(s.local_world_size)} \
            if layout else {}
        out = self._sup.on_report(req, generation, node_of, now)
        return (out.message if out.handled else None), out.replace

    def decorate(self, ins: Instruction, node_id: str = "") -> Instruction | None:
        """``ins`` with fail-slow's findings, an open stack request and the node's link probes; None when there is
        nothing to add (the service puts them on the wire; a START shared by every node is rebuilt there only
        when they change)."""
        findings, stacks = self._sup.reply_findings(), self._sup.stack_request()
        probes = self._sup.link_asks(node_id) if node_id else ()
        if findings is None and stacks is None and not probes:
            return None
        return replace(ins, failslow=findings, stacks=stacks, link_probes=probes)

    @staticmethod
    def slot_addresses(layout: RankLayout | None, members: Mapping[str, Member]) -> dict[str, str]:
        """Slot holders' addresses, for link probes that pair them."""
        return {s.node_id: members[s.node_id].info.address for s in (layout.slots if layout else ())
                if s.node_id in members}

    def replacement(self, d: ReplaceDecision | None, layout: RankLayout | None, st: PolicyState,
                    has_spare: Callable[[], bool], members: Iterable[Member], now: float,
                    wall: Callable[[], float]) -> Failure | None:
        """The node-level failure that replaces a slow (or repeatedly hanging) node, or None.

        Only a slot holder of a running (or recovering) generation is replaced, and only when a spare exists;
        otherwise the decision is logged and dropped. A returned failure is recorded as applied with the job's
        furthest step; the caller feeds it to the policy's ordinary node-failure path.
        """
        if d is None or layout is None or layout.slot_of(d.node_id) is None:
            return None
        if st.phase not in (Phase.RUNNING, Phase.RECOVERING) or not has_spare():
            log.warning("job %s: fail-slow would replace node %s but no spare is available: %s", self._job,
                        d.node_id, d.detail)
            return None
        step = max((m.last_step for m in members if m.generation == st.generation), default=-1)
        self._sup.applied(d, now, step, st.generation)
        return Failure(d.node_id, st.generation, Cause.NODE_CRITICAL, Level.NODE, detail=d.detail, time_s=wall())
