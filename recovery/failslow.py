"""Fail-slow at the coordinator: straggler detection, replace-by-policy and hang localisation, behind one object.

:class:`FailSlowSupervisor` is what :class:`~trainguard.recovery.coordinator.JobCoordinator` calls; it holds
no lock and no clock of its own (the coordinator calls it under its lock with its clock) and never touches the
store or the recovery policy: it *returns* :class:`~trainguard.recovery.straggler.ReplaceDecision` s, which
the coordinator applies through its ordinary node-failure path (cordon the node, give its slot to a spare).
Like the rest of the core it sees only the plain types of :mod:`~trainguard.recovery.domain`;
:mod:`~trainguard.recovery.convert` maps them to and from the wire.

- Heartbeats carry per-rank timing (:attr:`Beat.timings <trainguard.recovery.domain.Beat>`, on the wire
  ``NodeHeartbeatRequest.timings``): fed to :class:`~trainguard.recovery.straggler.StragglerDetector`; a slow
  node may be replaced by :class:`~trainguard.recovery.straggler.ReplacePolicy`.
- A hang report (``process.hung``) opens a :class:`~trainguard.recovery.hang_locator.HangCollection`: every
  heartbeat reply asks the nodes for their workers' stacks (:class:`~trainguard.recovery.domain.StackAsk`, on
  the wire ``NodeHeartbeatResponse.stacks``), agents answer with a ``hang.stacks`` event before they stop their
  workers, and when every rank answered (or ``hang_collect_s`` passed) the stacks are grouped
  (:func:`~trainguard.recovery.hang_locator.localise`). When the same node is the outlier of
  ``hang_repeats_to_replace`` hangs in a row it is replaced. Stack answers are fail-slow's own: they never
  reach the recovery policy (their kind would read as a hang).
- Every heartbeat reply carries the findings (:class:`~trainguard.recovery.domain.FailSlowStatus`, on the wire
  ``NodeHeartbeatResponse.failslow``), so ``trainguard status`` on any node shows the slow ranks and the last
  hang localisation.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from trainguard.recovery.domain import (Beat, FailSlowStatus, FaultReport, HangFinding, LinkProbeAsk, SlowRank,
                                        StackAsk)
from trainguard.recovery.errors import InvalidRequestError
from trainguard.recovery.hang_locator import HangCollection, Localisation, localise
from trainguard.recovery.link_locator import LinkFinding, LinkLocator
from trainguard.recovery.straggler import (ReplaceDecision, ReplacePolicy, SlowFinding, StragglerConfig,
                                           StragglerDetector, Timing, WindowResult, WindowSnapshot)

log = logging.getLogger(__name__)

#: Event kind agents use to answer a stack request.
STACKS_KIND = "hang.stacks"
#: Most timings one heartbeat may carry (ranks of one node).
MAX_TIMINGS = 1024


class _TimingFields(Protocol):
    """What :func:`validate_timings` reads of one entry (the wire ``RankTiming`` or the domain one)."""

    rank: int
    steps: int
    step_s: float
    wait_s: float
    compute_s: float


def validate_timings(timings: Sequence[_TimingFields]) -> None:
    """Checks a heartbeat's timing entries before anything is touched (the service calls it on the request).

    Raises:
        InvalidRequestError: too many entries, or a negative/non-finite number; the message names the field.
    """
    if len(timings) > MAX_TIMINGS:
        raise InvalidRequestError(f"timings has {len(timings)} entries; at most {MAX_TIMINGS} are allowed")
    for i, t in enumerate(timings):
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


def _few(items: Sequence[object], shown: int = 3) -> str:
    """``1, 5, 9 and 4 more``: at most ``shown`` items named."""
    head = ", ".join(map(str, items[:shown]))
    return f"{head} and {len(items) - shown} more" if len(items) > shown else head


def is_hang_report(kind: str) -> bool:
    """Whether a reported event's kind declares a hung worker (``process.hung``, ``worker.hang``,
    ``nccl.stalled`` and alike): a word of the kind, split at dots, underscores and dashes, starts with hung,
    hang or stall. Substrings matched too much: every node-level kind holding "change" or "install" (an
    operator rule's ``hw.pcie_speed_change``) opened a hang localisation, stack dumps on every node, and its
    outlier could be replaced."""
    kind = kind.lower()
    return kind != STACKS_KIND and any(w.startswith(("hung", "hang", "stall")) for w in re.split(r"[._\-]", kind))


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
        self._hang: HangFinding | None = None
        self._status: FailSlowStatus | None = None
        self._action = ""
        self._replace_generation = -1  # generation whose node the last replacement took out
        self._wall_of: dict[float, float] = {}
        self._window: WindowSnapshot | None = None  # closed under the coordinator's lock, scored outside it
        # Slow links: probe ports the nodes announce, the locator, the generation its campaign belongs to.
        self.links = LinkLocator(self.config.link)
        self._probe_ports: dict[str, int] = {}
        self._link_generation = -1
        self._link_since_wall = 0.0
        self._verdict_logged = ""

    # -- heartbeats ------------------------------------------------------------------------------------------
    def on_heartbeat(self, req: Beat, generation: int, now: float,
                     spares: Callable[[], int]) -> ReplaceDecision | None:
        """Feeds one heartbeat's timing and scores a window that closed, all at once (for callers whose lock may
        be held that long; the coordinator uses :meth:`on_beat`, :meth:`score` and :meth:`apply_window`).

        Args:
            req: the heartbeat (validated).
            generation: the job's current generation.
            now: coordinator clock, seconds.
            spares: counts the spare nodes available now (called only when a slow node is up for replacement).
        """
        decision = self.on_beat(req, generation, now)
        snap = self.pop_window()
        if snap is not None:
            result = self.score(snap)
            if result is not None:
                decision = self.apply_window(result, now, spares) or decision
        return decision

    def on_beat(self, req: Beat, generation: int, now: float) -> ReplaceDecision | None:
        """The cheap part of a heartbeat (call under the coordinator's lock): measures a pending replacement's
        cost, adds the beat's timing to the open window (a window that closes waits in :meth:`pop_window`),
        takes link-probe results, and closes a hang collection that is due; returns a replacement that the hang
        collection decided, or None."""
        self._on_link_beat(req, generation, now)
        if req.generation == generation:
            cost = self.policy.progress(generation, req.last_step, now)
            if cost is not None:
                log.warning("fail-slow: a node-level restart cost %.1f s (decision to the job back at its step)",
                            cost)
            if req.timings:
                timings = [Timing(t.rank, req.node_id, t.step, t.step_s, t.wait_s, t.compute_s, t.steps)
                           for t in req.timings]
                snap = self.detector.collect(generation, timings, now)
                if snap is not None:
                    self._window = snap
        return self._maybe_finish(now)

    # -- slow links ------------------------------------------------------------------------------------------
    def _on_link_beat(self, req: Beat, generation: int, now: float) -> None:
        if req.link_probe_port > 0:
            self._probe_ports[req.node_id] = req.link_probe_port
        if generation != self._link_generation:
            self._link_generation = generation
            self.links.abort()
        before = self.links.last_outcome
        finding = self.links.on_results(req.link_results, now) if req.link_results else self.links.tick(now)
        if self.links.last_outcome != before:
            self._status = None
        if finding is not None:
            # No action yet: the finding goes out in every reply first, and the replace policy weighs it at the
            # next scored window, if the job is still slow then (one probe campaign alone never replaces a node).
            self._link_since_wall = self._wall()
            log.warning("fail-slow: %s", self.links.last_outcome)

    def _link_decision(self, now: float, spares: Callable[[], int] | None) -> ReplaceDecision | None:
        """Asks the replace policy about the node a link probe named (valued at the job's slowdown)."""
        f, res = self.links.finding, self.detector.last
        if f is None or res is None or spares is None or not res.job_step_s > 0 or not res.job_slowdown > 1:
            return None
        if not self._action.startswith("replace"):
            self._action = "report"
        excess = res.job_step_s * (1.0 - 1.0 / res.job_slowdown)
        node = SlowFinding(-1, f.node_id, f.ratio, excess, f.since, "link", res.job_slowdown)
        view = WindowResult(now, res.job_step_s, res.job_slowdown, {}, {}, (), (node,), (), res.generation,
                            res.epoch)
        d = self.policy.decide(view, now, spares())
        self._log_verdict()
        if d is None:
            return None
        return ReplaceDecision(d.node_id, f"slow links on node {f.node_id}: {self.links.last_outcome}; the job runs "
                                          f"{res.job_slowdown:.1f}x slower than its baseline; replacing saves "
                                          f"~{d.saved_s:.0f} s against a restart cost of {d.cost_s:.1f} s",
                               d.saved_s, d.cost_s)

    def _log_verdict(self) -> None:
        """Logs why the replace policy kept a slow node, once per node (the coordinator log then says why a drill
        or an operator saw a straggler reported but not replaced)."""
        v = self.policy.verdict
        key = v.split(":", 1)[0]
        if v and key != self._verdict_logged:
            log.warning("fail-slow: %s", v)
            self._status = None
        self._verdict_logged = key if v else ""

    def link_asks(self, node_id: str) -> tuple[LinkProbeAsk, ...]:
        """The link probe ``node_id`` should run now (for its heartbeat reply)."""
        return self.links.asks_for(node_id)

    @property
    def link_finding(self) -> LinkFinding | None:
        """The node the last link probe named, while the job stays slow."""
        return self.links.finding

    def pop_window(self) -> WindowSnapshot | None:
        """The window that closed since the last call, to :meth:`score` (outside the coordinator's lock)."""
        snap, self._window = self._window, None
        return snap

    def score(self, snap: WindowSnapshot) -> WindowResult | None:
        """Scores a closed window; needs no outside lock (None: stale, a new generation began since)."""
        return self.detector.score(snap)

    def apply_window(self, result: WindowResult, now: float, spares: Callable[[], int],
                     addresses: Callable[[], Mapping[str, str]] | None = None) -> ReplaceDecision | None:
        """Takes a scored window's findings (call under the coordinator's lock): logs new flags, refreshes the
        status, and asks the replace policy about a slow node. A result from before a reset (its generation
        ended while it was scored) is dropped.

        Args:
            result: from :meth:`score`.
            now: coordinator clock, seconds.
            spares: counts the spare nodes available now.
            addresses: node -> address of the nodes holding ranks now (for link probes; None: no probing).
        """
        if not self.detector.is_current(result):
            return None
        self._status = None
        if self._action.startswith("replace") and result.generation > self._replace_generation:
            # The replacement is done (a later generation runs): what it says was about another node and
            # another generation. Kept, every later straggler read "action: replace <a node gone long ago>".
            self._action = ""
        for f in result.newly_flagged:
            what = f"rank {f.rank} on node {f.node_id}" if f.rank >= 0 else f"node {f.node_id}"
            log.warning("fail-slow: %s is a straggler: own work %.2fx the others' median, the job loses "
                        "%.0f ms per %.0f ms step", what, f.ratio, f.excess_s * 1000, result.job_step_s * 1000)
            self._wall_of.setdefault(f.since, self._wall())
        decision = None
        if result.slow_nodes:
            decision = self.policy.decide(result, now, spares())
            if decision is None and not self._action.startswith("replace"):
                self._action = "report"
            self._log_verdict()
        if addresses is not None:
            addr = addresses()
            f = self.links.finding
            if f is not None and f.node_id not in addr:
                self.links.forget(f.node_id)  # replaced: it holds no ranks now
            endpoints = {n: (a, self._probe_ports.get(n, 0)) for n, a in addr.items()}
            # A rank whose flag is still persisting explains the slowdown as well as a flagged one: probing then
            # would say "no compute straggler" and spend the campaign cooldown on a compute problem.
            compute = bool(result.slow_ranks or result.slow_nodes or result.suspects)
            self.links.on_window(result.job_slowdown, compute, endpoints, now, ranks_compared=len(result.ratios) >= 2)
            if decision is None and self.links.finding is not None and not result.slow_nodes:
                decision = self._link_decision(now, spares)
        return decision

    def new_world(self, world_size: int) -> None:
        """A generation formed with ``world_size`` ranks (see :meth:`ReplacePolicy.new_world`); another size than
        before also restarts the ranks' own baselines (:meth:`StragglerDetector.forget_baselines`)."""
        if world_size != self.policy.world_size:
            self.detector.forget_baselines()
        self.policy.new_world(world_size)

    def applied(self, decision: ReplaceDecision, now: float, step: int, generation: int) -> None:
        """The coordinator replaced ``decision.node_id`` (cost measurement and cooldown start)."""
        self.policy.applied(decision, now, step, generation)
        self.links.forget(decision.node_id)
        self._action = f"replace {decision.node_id}"
        self._replace_generation = generation
        self._status = None
        log.warning("fail-slow: replacing node %s: %s", decision.node_id, decision.detail)

    # -- hangs -----------------------------------------------------------------------------------------------
    def on_report(self, req: FaultReport, generation: int, node_of: Mapping[int, str],
                  now: float) -> ReportOutcome:
        """Looks at a reported event: answers stack reports, opens a collection on a hang report.

        Args:
            req: the report (validated).
            generation: the job's current generation.
            node_of: rank -> node id of the current generation (every rank expected to answer).
            now: coordinator clock, seconds.
        """
        if req.kind == STACKS_KIND:
            col = self._collection
            if col is None or col.request_id != req.stack_request:
                return ReportOutcome(True, "no hang localisation is open for these stacks")
            new = col.add(req.node_id, req.stacks)
            done = self._maybe_finish(now)
            return ReportOutcome(True, f"{new} stack(s) received", done)
        if not is_hang_report(req.kind) or req.generation != generation or generation < 0:
            return ReportOutcome()
        col = self._collection
        if col is None or col.generation != generation:
            col = HangCollection(generation, uuid.uuid4().hex[:12], now, now + self.hang_collect_s,
                                 frozenset(node_of), node_of=dict(node_of))
            self._collection = col
            log.warning("fail-slow: %s reports a hang in generation %d; collecting every rank's stack",
                        req.node_id, generation)
        evidence = dict(req.stacks)
        if "stack" in evidence and req.rank >= 0:
            evidence.setdefault(f"stack.{req.rank}", evidence["stack"])
        col.add(req.node_id, evidence)
        return ReportOutcome(False, "", self._maybe_finish(now))

    def hang_blame(self, generation: int, rank: int) -> str:
        """What the finished localisation of ``generation``'s hang says of a report about ``rank``: "" when none
        finished or ``rank`` is among its outliers, else where the hang is (for the failure's description: the
        first rank found silent is often one waiting in a collective for the stuck one)."""
        h = self._hang
        if h is None or h.generation != generation or not h.outlier_ranks or rank in h.outlier_ranks:
            return ""
        # Short: it leads a description cut at MAX_DETAIL characters, which must keep the reporter's own text.
        return (f"hang localised to rank(s) {_few(h.outlier_ranks)} on {_few(h.outlier_nodes) or '?'} in "
                f"{(h.outlier_frame or '?')[:60]}; the other ranks wait in {(h.majority_frame or '?')[:40]}")

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
        self._hang = HangFinding(
            generation=col.generation, outlier_ranks=tuple(loc.outlier_ranks), outlier_nodes=tuple(loc.outlier_nodes),
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
    def status(self) -> FailSlowStatus:
        """The findings as shown to operators (cached until something changes)."""
        if self._status is not None:
            return self._status
        res = self.detector.last
        st = FailSlowStatus()
        if res is not None:
            # A finding's wall time is fixed the first time anyone sees it: a reply built while its window was being
            # scored (outside the lock) showed it with 0 and the next one with the time apply_window noted, and
            # every node's view, which tells findings apart by that time, raised the same straggler twice.
            first_seen = self._wall_of.setdefault
            slow = tuple(SlowRank(f.rank, f.node_id, f.ratio, f.excess_s, first_seen(f.since, self._wall()), f.basis,
                                  f.individual) for f in res.slow_ranks[: self.config.max_listed])
            lf = self.links.finding
            if lf is not None:
                excess = res.job_step_s * (1.0 - 1.0 / res.job_slowdown) if res.job_slowdown > 1 else 0.0
                slow = (SlowRank(-1, lf.node_id, lf.ratio, _finite(excess), self._link_since_wall, "link",
                                 _finite(res.job_slowdown)),) + slow[: self.config.max_listed - 1]
            action = message = ""
            if lf is not None and not (res.slow_ranks or res.slow_nodes):
                action = self._action or "report"
                message = (f"slow link: {self.links.last_outcome}; restart cost {self.policy.cost_s:.1f} s "
                           f"({'measured' if self.policy.measured else 'assumed'})")
            elif res.slow_ranks or res.slow_nodes:
                action = self._action or "report"
                nodes = ", ".join(f"{f.node_id} ({f.ratio:.2f}x)" for f in res.slow_nodes) or "-"
                message = (f"{len(res.slow_ranks)} slow rank(s); slow node(s): {nodes}; restart cost "
                           f"{self.policy.cost_s:.1f} s ({'measured' if self.policy.measured else 'assumed'})")
            if message and self.config.action == "replace" and self.policy.verdict:
                message += f"; {self.policy.verdict}"
            st = FailSlowStatus(slow=slow, job_step_s=_finite(res.job_step_s), job_slowdown=_finite(res.job_slowdown),
                                action=action, message=message, ranks_observed=len(res.ratios),
                                link_probe=self.links.last_outcome)
        elif self.links.last_outcome:
            st = FailSlowStatus(action=self._action, link_probe=self.links.last_outcome)
        if self._hang is not None and self._hang.ranks_seen:
            st = replace(st, hang=self._hang)
        self._status = st
        return st

    def reply_findings(self) -> FailSlowStatus | None:
        """What heartbeat replies carry: the findings, or None while there are none."""
        st = self.status()
        return None if st.empty else st

    def stack_request(self) -> StackAsk | None:
        """The open stack request while a hang is being localised, else None."""
        col = self._collection
        return StackAsk(col.request_id, col.generation) if col is not None else None


def _finite(x: float) -> float:
    """0.0 for NaN (not measured yet), else ``x``."""
    return x if x == x else 0.0
