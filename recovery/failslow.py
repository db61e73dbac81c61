"""Fail-slow at the coordinator: straggler detection, replace-by-policy and hang localisation, behind one object.

:class:`FailSlowSupervisor` is what :class:`~trainguard.recovery.coordinator.JobCoordinator` calls; it holds
no lock and no clock of its own (the coordinator calls it under its lock with its clock) and never touches the
store or the recovery policy: it *returns* :class:`~trainguard.recovery.straggler.ReplaceDecision` s, which
the coordinator applies through its ordinary node-failure path (cordon the node, give its slot to a spare).

- Heartbeats carry per-rank timing (``NodeHeartbeatRequest.timings``): fed to
  :class:`~trainguard.recovery.straggler.StragglerDetector`; a slow node may be replaced by
  :class:`~trainguard.recovery.straggler.ReplacePolicy`.
- A hang report (``process.hung``) opens a :class:`~trainguard.recovery.hang_locator.HangCollection`: every
  heartbeat reply asks the nodes for their workers' stacks (``NodeHeartbeatResponse.stacks``), agents answer
  with a ``hang.stacks`` event before they stop their workers, and when every rank answered (or
  ``hang_collect_s`` passed) the stacks are grouped (:func:`~trainguard.recovery.hang_locator.localise`).
  When the same node is the outlier of ``hang_repeats_to_replace`` hangs in a row it is replaced.
- Every heartbeat reply carries the findings (``NodeHeartbeatResponse.failslow``), so ``trainguard status``
  on any node shows the slow ranks and the last hang localisation.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from trainguard.proto import common_pb2, coordinator_pb2
from trainguard.recovery.errors import InvalidRequestError
from trainguard.recovery.hang_locator import HangCollection, Localisation, localise
from trainguard.recovery.straggler import ReplaceDecision, ReplacePolicy, StragglerConfig, StragglerDetector, Timing

log = logging.getLogger(__name__)

#: Event kind agents use to answer a stack request.
STACKS_KIND = "hang.stacks"
#: Most timings one heartbeat may carry (ranks of one node).
MAX_TIMINGS = 1024


def validate_timings(req: coordinator_pb2.NodeHeartbeatRequest) -> None:
    """Checks the timing part of a heartbeat before anything is touched.

    Raises:
        InvalidRequestError: too many entries, or a negative/non-finite number; the message names the field.
    """
    if len(req.timings) > MAX_TIMINGS:
        raise InvalidRequestError(f"timings has {len(req.timings)} entries; at most {MAX_TIMINGS} are allowed")
    for i, t in enumerate(req.timings):
        if t.rank < 0 or t.steps < 0:
            raise InvalidRequestError(f"timings[{i}].rank/steps must be >= 0 (got {t.rank}/{t.steps})")
        if not (t.step_s >= 0 and t.step_s < 1e7):
            raise InvalidRequestError(f"timings[{i}].step_s={t.step_s} must be a finite number of seconds >= 0")
        for name in ("wait_s", "compute_s"):
            v = getattr(t, name)
            if not (v >= -1 and v < 1e7):
                raise InvalidRequestError(f"timings[{i}].{name}={v} must be seconds >= 0, or -1 when unknown")


@dataclass(frozen=True)
class ReportOutcome:
    """What the supervisor made of a reported event.

    Attributes:
        handled: the event was fail-slow's own (stacks for a hang); the coordinator answers with ``message``
            and does nothing else.
        message: answer for the reporter.
        replace: a node to replace (a hang's repeated outlier), or None.
    """

    handled: bool = False
    message: str = ""
    replace: ReplaceDecision | None = None


def is_hang_report(event: common_pb2.HealthEvent) -> bool:
    """Whether a reported event declares a hung worker (``process.hung`` and alike)."""
    kind = event.kind.lower()
    return kind != STACKS_KIND and ("hung" in kind or "hang" in kind or "stall" in kind)


class FailSlowSupervisor:
    """Fail-slow state of one job (see the module docstring).

    Args:
        config: straggler and replace-policy knobs.
        hang_collect_s: how long to wait for every rank's stack after a hang report, seconds.
        hang_repeats_to_replace: consecutive hangs with the same outlier node that make it replaced.
        wall: wall clock for the Unix times shown to operators.
    """

    def __init__(self, config: StragglerConfig | None = None, hang_collect_s: float = 8.0,
                 hang_repeats_to_replace: int = 2, wall=time.time) -> None:
        self.detector = StragglerDetector(config)
        self.config = self.detector.config
        self.policy = ReplacePolicy(self.config)
        self.hang_collect_s = hang_collect_s
        self.hang_repeats_to_replace = hang_repeats_to_replace
        self._wall = wall
        self._collection: HangCollection | None = None
        self.findings: list[tuple[int, Localisation]] = []  # (generation, localisation), oldest first
        self._hang_repeats = 0
        self._hang_proto = common_pb2.HangFinding()
        self._status: common_pb2.FailSlowStatus | None = None
        self._action = ""
        self._wall_of: dict[float, float] = {}

    # -- heartbeats ------------------------------------------------------------------------------------------
    def on_heartbeat(self, req: coordinator_pb2.NodeHeartbeatRequest, generation: int, now: float,
                     spares: Callable[[], int]) -> ReplaceDecision | None:
        """Feeds one heartbeat's timing; may return a replacement the coordinator should apply.

        Args:
            req: the heartbeat (validated).
            generation: the job's current generation.
            now: coordinator clock, seconds.
            spares: counts the spare nodes available now (called only when a slow node is up for replacement).
        """
        decision = None
        if req.generation == generation:
            cost = self.policy.progress(generation, req.last_step, now)
            if cost is not None:
                log.warning("fail-slow: a node-level restart cost %.1f s (decision to the job back at its step)",
                            cost)
            timings = [Timing(t.rank, req.node_id, t.step, t.step_s, t.wait_s, t.compute_s, t.steps)
                       for t in req.timings]
            result = self.detector.observe(generation, timings, now) if timings else None
            if result is not None:
                self._status = None
                for f in result.newly_flagged:
                    what = f"rank {f.rank} on node {f.node_id}" if f.rank >= 0 else f"node {f.node_id}"
                    log.warning("fail-slow: %s is a straggler: own work %.2fx the others' median, the job loses "
                                "%.0f ms per %.0f ms step", what, f.ratio, f.excess_s * 1000, result.job_step_s * 1000)
                    self._wall_of[f.since] = self._wall()
                if result.slow_nodes:
                    decision = self.policy.decide(result, now, spares())
                    if decision is None and not self._action.startswith("replace"):
                        self._action = "report"
        return decision or self._maybe_finish(now)

    def applied(self, decision: ReplaceDecision, now: float, step: int, generation: int) -> None:
        """The coordinator replaced ``decision.node_id`` (cost measurement and cooldown start)."""
        self.policy.applied(decision, now, step, generation)
        self._action = f"replace {decision.node_id}"
        self._status = None
        log.warning("fail-slow: replacing node %s: %s", decision.node_id, decision.detail)

    # -- hangs -----------------------------------------------------------------------------------------------
    def on_report(self, req: coordinator_pb2.ReportEventRequest, generation: int, node_of: Mapping[int, str],
                  now: float) -> ReportOutcome:
        """Looks at a reported event: answers stack reports, opens a collection on a hang report.

        Args:
            req: the report (validated).
            generation: the job's current generation.
            node_of: rank -> node id of the current generation (every rank expected to answer).
            now: coordinator clock, seconds.
        """
        ev = req.event
        if ev.kind == STACKS_KIND:
            col = self._collection
            if col is None or col.request_id != ev.evidence.get("request_id", ""):
                return ReportOutcome(True, "no hang localisation is open for these stacks")
            new = col.add(req.node_id, ev.evidence)
            done = self._maybe_finish(now)
            return ReportOutcome(True, f"{new} stack(s) received", done)
        if not is_hang_report(ev) or req.generation != generation or generation < 0:
            return ReportOutcome()
        col = self._collection
        if col is None or col.generation != generation:
            col = HangCollection(generation, uuid.uuid4().hex[:12], now, now + self.hang_collect_s,
                                 frozenset(node_of), node_of=dict(node_of))
            self._collection = col
            log.warning("fail-slow: %s reports a hang in generation %d; collecting every rank's stack",
                        req.node_id, generation)
        evidence = dict(ev.evidence)
        if "stack" in evidence and req.failed_rank >= 0:
            evidence.setdefault(f"stack.{req.failed_rank}", evidence["stack"])
        col.add(req.node_id, evidence)
        return ReportOutcome(False, "", self._maybe_finish(now))

    def tick(self, now: float) -> ReplaceDecision | None:
        """Closes a hang collection whose deadline passed (call periodically)."""
        return self._maybe_finish(now)

    def _maybe_finish(self, now: float) -> ReplaceDecision | None:
        col = self._collection
        if col is None or not col.complete(now):
            return None
        self._collection = None
        loc = localise(col.stacks, col.node_of)
        prev = self.findings[-1][1] if self.findings else None
        same = bool(loc.outlier_nodes) and prev is not None and prev.outlier_nodes == loc.outlier_nodes
        self._hang_repeats = self._hang_repeats + 1 if same else (1 if loc.outlier_nodes else 0)
        self.findings.append((col.generation, loc))
        missing = sorted(col.expected - col.stacks.keys())
        self._hang_proto = common_pb2.HangFinding(
            generation=col.generation, outlier_ranks=list(loc.outlier_ranks), outlier_nodes=list(loc.outlier_nodes),
            outlier_frame=loc.outlier_frame, majority_frame=loc.majority_frame, ranks_seen=loc.ranks_seen,
            groups=loc.groups, repeats=self._hang_repeats, time=self._wall())
        self._status = None
        log.warning("fail-slow: hang of generation %d localised: outlier rank(s) %s on %s in %s; %d rank(s) wait in "
                    "%s; %d stack group(s)%s", col.generation, list(loc.outlier_ranks) or "none",
                    ",".join(loc.outlier_nodes) or "-", loc.outlier_frame or "-",
                    loc.ranks_seen - len(loc.outlier_ranks),
                    loc.majority_frame or "-", loc.groups, f"; no stack from rank(s) {missing}" if missing else "")
        if self._hang_repeats >= self.hang_repeats_to_replace and len(loc.outlier_nodes) == 1:
            node = loc.outlier_nodes[0]
            return ReplaceDecision(node, f"hang outlier {self._hang_repeats} times in a row: rank(s) "
                                         f"{list(loc.outlier_ranks)} stuck in {loc.outlier_frame}", 0.0, 0.0)
        return None

    # -- replies ---------------------------------------------------------------------------------------------
    def status(self) -> common_pb2.FailSlowStatus:
        """The findings as shown to operators (cached until something changes)."""
        if self._status is not None:
            return self._status
        st = common_pb2.FailSlowStatus()
        res = self.detector.last
        if res is not None:
            st.job_step_s = res.job_step_s if res.job_step_s == res.job_step_s else 0.0
            st.job_slowdown = res.job_slowdown if res.job_slowdown == res.job_slowdown else 0.0
            st.ranks_observed = len(res.ratios)
            for f in res.slow_ranks[: self.config.max_listed]:
                st.slow.add(rank=f.rank, node_id=f.node_id, ratio=f.ratio, excess_s=f.excess_s,
                            since=self._wall_of.get(f.since, 0.0), basis=f.basis, individual=f.individual)
            if res.slow_ranks or res.slow_nodes:
                st.action = self._action or "report"
                nodes = ", ".join(f"{f.node_id} ({f.ratio:.2f}x)" for f in res.slow_nodes) or "-"
                st.message = (f"{len(res.slow_ranks)} slow rank(s); slow node(s): {nodes}; restart cost "
                              f"{self.policy.cost_s:.1f} s ({'measured' if self.policy.measured else 'assumed'})")
        if self._hang_proto.ranks_seen:
            st.hang.CopyFrom(self._hang_proto)
        self._status = st
        return st

    def has_news(self) -> bool:
        """Whether replies carry anything (findings, or a stack request)."""
        return self._collection is not None or bool(self.status().ByteSize())

    def fill(self, resp: coordinator_pb2.NodeHeartbeatResponse) -> None:
        """Puts the findings, and an open stack request, into a heartbeat reply."""
        st = self.status()
        if st.ByteSize():
            resp.failslow.CopyFrom(st)
        col = self._collection
        if col is not None:
            resp.stacks.request_id = col.request_id
            resp.stacks.generation = col.generation
