"""Multi-level recovery policy: which level a failure gets, and the job's lifecycle, as state machines.

Job phases (:class:`Phase`, transitions in :data:`TRANSITIONS`)::

                 members ready                 every node runs the new generation
     FORMING ------------------> RUNNING <------------------------------------------ RECOVERING
        |                         |  |  \\  failure (budget left): new generation N+1     ^  |
        |                         |  |   `-----------------------------------------------'  |
        |  membership impossible  |  |  every rank exited 0                                  |  failure of N+1
        v                         |  v                                                       |  (budget left): N+2
      FAILED <--------------------'  SUCCEEDED                                    RECOVERING-'
                budget exhausted (from RUNNING or RECOVERING)

Recovery levels (:class:`Level`, equal to the proto's ``RecoveryLevel``), cheapest first. The level a failure
gets is its *cause's* base level (:data:`BASE_LEVEL`), raised to what the reporter proposed, then escalated by
the rules of :data:`ESCALATION`::

     PROCESS --(this node already had `process_repeats_to_node` process-level failures in the window)--> NODE
     NODE    --(the job already had `node_repeats_to_job` node-level failures in the window)-----------> JOB
     NODE    --(no spare of the right size, and shrinking not allowed or not valid)-------------------> JOB

- **process**: every node restarts its workers in place; same nodes, same ranks.
- **node**: the failed nodes are cordoned; each slot goes to a spare (one of the same pod first), or, if the
  job allows shrinking and the smaller layout is still valid, the slots are dropped.
- **job**: every node stops; the next generation starts when the membership can fill every slot again
  (a lost node may come back and reclaim its slot, a newcomer may take it; a node that reported itself broken
  stays cordoned, so the job waits for a spare rather than restart on it); workers restore from the last
  persisted checkpoint.

Budget and backoff are global and counted here, never per agent: every new generation caused by a failure
costs one restart; when ``max_restarts`` are spent the next failure fails the job. A new generation waits
``backoff_s`` before it starts: zero for the first failure since the last progress, then doubling.

Simultaneous failures: the first report of a fault in generation N opens generation N+1 (phase RECOVERING). A
report about generation N that arrives while N+1 has not started yet is *merged* into that same plan (its
node joins the cordon list, its level may raise the plan's level) and costs no budget; once N+1 runs, reports
about N are dropped as duplicates. So many nodes failing at once give one new generation.

Everything here is deterministic given its inputs (time is passed in), and the state is a plain dataclass the
coordinator serializes to its store (:meth:`PolicyState.to_dict`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.lifecycle import next_state
from trainguard.recovery.errors import PolicyError
from trainguard.recovery.planner import Placement, place
from trainguard.recovery.ranks import NodeSpec, RankLayout


class Phase(enum.Enum):
    """Lifecycle phase of a job (values equal the proto ``JobState`` numbers)."""

    FORMING = 1
    RUNNING = 2
    RECOVERING = 3
    SUCCEEDED = 4
    FAILED = 5


class Trigger(enum.Enum):
    """What moves a job from one phase to the next."""

    MEMBERS_READY = "members_ready"
    GENERATION_STARTED = "generation_started"
    FAILURE = "failure"
    ALL_SUCCEEDED = "all_succeeded"
    BUDGET_EXHAUSTED = "budget_exhausted"
    MEMBERSHIP_IMPOSSIBLE = "membership_impossible"


#: The allowed phase transitions; anything else is a :class:`PolicyError`.
TRANSITIONS: dict[tuple[Phase, Trigger], Phase] = {
    (Phase.FORMING, Trigger.MEMBERS_READY): Phase.RUNNING,
    (Phase.FORMING, Trigger.MEMBERSHIP_IMPOSSIBLE): Phase.FAILED,
    (Phase.FORMING, Trigger.FAILURE): Phase.FORMING,
    (Phase.RUNNING, Trigger.FAILURE): Phase.RECOVERING,
    (Phase.RUNNING, Trigger.ALL_SUCCEEDED): Phase.SUCCEEDED,
    (Phase.RUNNING, Trigger.BUDGET_EXHAUSTED): Phase.FAILED,
    (Phase.RECOVERING, Trigger.GENERATION_STARTED): Phase.RUNNING,
    (Phase.RECOVERING, Trigger.FAILURE): Phase.RECOVERING,
    (Phase.RECOVERING, Trigger.BUDGET_EXHAUSTED): Phase.FAILED,
    (Phase.RECOVERING, Trigger.MEMBERSHIP_IMPOSSIBLE): Phase.FAILED,
    (Phase.RECOVERING, Trigger.ALL_SUCCEEDED): Phase.SUCCEEDED,
}


def transition(phase: Phase, trigger: Trigger) -> Phase:
    """Looks a transition up in :data:`TRANSITIONS`.

    Args:
        phase: current phase.
        trigger: what happened.

    Returns:
        The next phase.

    Raises:
        PolicyError: the table has no such transition.
    """
    return next_state(TRANSITIONS, phase, trigger, error=PolicyError, bug_of="coordinator", log="coordinator")


class Level(enum.IntEnum):
    """Recovery level, cheapest first (values equal the proto ``RecoveryLevel``)."""

    NONE = 1
    PROCESS = 2
    NODE = 3
    JOB = 4


class Cause(enum.Enum):
    """Why a node reports trouble."""

    WORKER_EXIT = "worker_exit"          # a worker exited non-zero or was killed
    WORKER_HANG = "worker_hang"          # no step heartbeat within the learned bound
    NODE_CRITICAL = "node_critical"      # critical hardware/network event (link down, GPU lost, ECC, AER fatal)
    NODE_LOST = "node_lost"              # the node's lease expired: no heartbeat
    JOB_REQUEST = "job_request"          # the reporter asks for a whole-job restart
    ADVISORY = "advisory"                # a warning: nothing to restart


#: The level each cause gets before escalation.
BASE_LEVEL: dict[Cause, Level] = {
    Cause.WORKER_EXIT: Level.PROCESS,
    Cause.WORKER_HANG: Level.PROCESS,
    Cause.NODE_CRITICAL: Level.NODE,
    Cause.NODE_LOST: Level.NODE,
    Cause.JOB_REQUEST: Level.JOB,
    Cause.ADVISORY: Level.NONE,
}


class Escalation(enum.Enum):
    """Reasons a level is raised."""

    REPEATED_ON_NODE = "repeated_on_node"
    REPEATED_NODE_LEVEL = "repeated_node_level"
    NO_SPARE_NO_SHRINK = "no_spare_no_shrink"


#: (level, reason) -> escalated level.
ESCALATION: dict[tuple[Level, Escalation], Level] = {
    (Level.PROCESS, Escalation.REPEATED_ON_NODE): Level.NODE,
    (Level.NODE, Escalation.REPEATED_NODE_LEVEL): Level.JOB,
    (Level.NODE, Escalation.NO_SPARE_NO_SHRINK): Level.JOB,
}


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the recovery policy.

    Attributes:
        max_restarts: new generations after faults before the job fails (>= 0). Default 3.
        backoff_initial_s: wait before the second consecutive restart without progress, seconds. Default 1.0.
        backoff_max_s: cap of the doubling backoff, seconds. Default 30.0.
        process_repeats_to_node: process-level failures of one node within ``window_s`` after which its next
            failure is node-level (>= 1). Default 2.
        node_repeats_to_job: node-level failures of the job within ``window_s`` after which the next one is
            job-level (>= 1). Default 3.
        window_s: how far back repeats count, seconds. Default 600.
        allow_shrink: a node-level failure with no spare may drop the failed slots. Default False.
        min_nodes: the fewest nodes a shrunk job may run on (>= 1). Default 1.
        hold_unhealthy: a job-level plan keeps nodes that reported themselves broken cordoned even without a
            spare (the generation waits for capacity). False restarts on them, for a job that has no other
            capacity to wait for (``trainguard run`` on one node). Default True.
        membership_timeout_s: how long a recovery may wait for a valid membership (a spare of the right pod,
            a lost node coming back) before the job fails with MEMBERSHIP_IMPOSSIBLE, seconds. Default 600.
    """

    max_restarts: int = 3
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    process_repeats_to_node: int = 2
    node_repeats_to_job: int = 3
    window_s: float = 600.0
    allow_shrink: bool = False
    min_nodes: int = 1
    hold_unhealthy: bool = True
    membership_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise PolicyError(f"max_restarts={self.max_restarts} is invalid: use 0 or more")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise PolicyError("backoff must satisfy 0 <= backoff_initial_s <= backoff_max_s")
        if self.process_repeats_to_node < 1 or self.node_repeats_to_job < 1 or self.min_nodes < 1:
            raise PolicyError("process_repeats_to_node, node_repeats_to_job and min_nodes must be >= 1")
        if self.window_s <= 0:
            raise PolicyError(f"window_s={self.window_s} is invalid: use a positive number of seconds")
        if not self.membership_timeout_s > 0:
            raise PolicyError(f"membership_timeout_s={self.membership_timeout_s} is invalid: use a positive "
                              "number of seconds")


#: Characters of a reporter's detail a failure's description keeps. The description is stored in the job state
#: for every cordoned node (rewritten whole at each change): a node daemon's fatal reason may be 4 KB, and a few
#: hundred such reports, for any node ids, made a state record past etcd's 1.5 MiB request limit.
MAX_DETAIL = 240


@dataclass(frozen=True)
class Failure:
    """One failure report, as the policy sees it.

    Attributes:
        node_id: the reporting (or lost) node.
        generation: generation the failure happened in (-1: the node ran no workers).
        cause: why.
        proposed: level the reporter proposes (NONE when it has no opinion).
        rank: failing global rank, -1 when not about one rank.
        exit_code: the worker's exit code; negative for a signal (``-9`` is SIGKILL), 0 when not applicable.
        detail: one line from the reporter.
        time_s: when the coordinator received it, seconds on the coordinator's clock.
    """

    node_id: str
    generation: int
    cause: Cause
    proposed: Level = Level.NONE
    rank: int = -1
    exit_code: int = 0
    detail: str = ""
    time_s: float = 0.0

    def describe(self) -> str:
        """One line naming the rank, node, exit code or signal, and the detail."""
        import signal as _signal

        who = f"rank {self.rank} on node {self.node_id}" if self.rank >= 0 else f"node {self.node_id}"
        if self.exit_code < 0:
            try:
                how = f"killed by {_signal.Signals(-self.exit_code).name}"
            except ValueError:
                how = f"killed by signal {-self.exit_code}"
        elif self.exit_code > 0:
            how = f"exited with code {self.exit_code}"
        else:
            how = self.cause.value.replace("_", " ")
        detail = self.detail if len(self.detail) <= MAX_DETAIL else self.detail[:MAX_DETAIL - 3] + "..."
        return f"{who} {how}" + (f" ({detail})" if detail else "")


@dataclass
class Plan:
    """The recovery being prepared for one new generation.

    Attributes:
        generation: the generation being formed.
        level: its recovery level.
        failed_nodes: nodes whose failure it handles.
        cordon: nodes excluded from the job from now on.
        replacements: failed node id -> node taking its slot, as last planned (re-planned on every membership
            change: see :mod:`~trainguard.recovery.planner`).
        shrink: the last placement drops slots nobody can fill.
        not_before_s: earliest start (backoff), coordinator clock seconds.
        reason: the first failure's description.
        unhealthy: nodes that reported themselves broken (``NODE_CRITICAL``); a job-level plan keeps them
            cordoned even without a spare, so the next generation waits for capacity instead of restarting on a
            node that said it cannot train.
        waiting: why the last placement found no valid layout ("" when it found one).
        waiting_since_s: when the plan started waiting for a valid layout (0: not waiting), wall seconds.
    """

    generation: int
    level: Level
    failed_nodes: list[str] = field(default_factory=list)
    cordon: list[str] = field(default_factory=list)
    replacements: dict[str, str] = field(default_factory=dict)
    shrink: bool = False
    not_before_s: float = 0.0
    reason: str = ""
    unhealthy: list[str] = field(default_factory=list)
    waiting: str = ""
    waiting_since_s: float = 0.0

    def placement_text(self) -> str:
        """``replacing a->b, c->d``, ``... and shrinking`` or ``shrinking`` (a shrink with no replacement read
        "replacing  and shrinking"); "" when the placement changes nothing."""
        replacing = ", ".join(f"{o}->{n}" for o, n in self.replacements.items())
        return " and ".join(filter(None, (f"replacing {replacing}" if replacing else "",
                                          "shrinking" if self.shrink else "")))


@dataclass
class PolicyState:
    """Everything the policy remembers; serialized to the coordinator's store.

    Attributes:
        phase: the job phase.
        generation: current generation (0 before the first one forms).
        restart_count: restarts spent so far.
        consecutive: failures since the last progress (drives the backoff).
        progress_step: the highest step seen when the last generation started.
        process_failures: node id -> times (s) of its process-level failures in the window.
        node_failures: times (s) of node-level failures in the window.
        cordoned: nodes excluded from the job.
        cordon_why: node id -> the failure that cordoned it (or will, once the plan forms), for the node's own
            heartbeat answer and the wait message of a plan that cannot be placed.
        plan: the recovery being prepared, None when none.
        message: last human-readable reason (failure, recovery, success).
        forming_waiting: why the first generation cannot be laid out although enough nodes registered ("").
        forming_since_s: since when (wall seconds; 0: not waiting).
        cordon_daemon: node id -> the node daemon instance last heard from the node when it was cordoned ("":
            none). A healthy report from another instance (the daemon was restarted, as an operator does once
            the machine is repaired) returns the node to service (:meth:`RecoveryPolicy.uncordon`), as an
            operator can (``trainguard uncordon``).
    """

    phase: Phase = Phase.FORMING
    generation: int = 0
    restart_count: int = 0
    consecutive: int = 0
    progress_step: int = -1
    process_failures: dict[str, list[float]] = field(default_factory=dict)
    node_failures: list[float] = field(default_factory=list)
    cordoned: list[str] = field(default_factory=list)
    plan: Plan | None = None
    message: str = ""
    forming_waiting: str = ""
    forming_since_s: float = 0.0
    cordon_why: dict[str, str] = field(default_factory=dict)
    cordon_daemon: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly form (inverse of :meth:`from_dict`)."""
        d: dict[str, object] = {
            "phase": self.phase.name, "generation": self.generation, "restart_count": self.restart_count,
            "consecutive": self.consecutive, "progress_step": self.progress_step,
            "process_failures": self.process_failures, "node_failures": self.node_failures,
            "cordoned": self.cordoned, "message": self.message, "plan": None,
            "forming_waiting": self.forming_waiting, "forming_since_s": self.forming_since_s,
            "cordon_why": self.cordon_why, "cordon_daemon": self.cordon_daemon,
        }
        if self.plan is not None:
            p = self.plan
            d["plan"] = {"generation": p.generation, "level": p.level.name, "failed_nodes": p.failed_nodes,
                         "cordon": p.cordon, "replacements": p.replacements, "shrink": p.shrink,
                         "not_before_s": p.not_before_s, "reason": p.reason, "unhealthy": p.unhealthy,
                         "waiting": p.waiting, "waiting_since_s": p.waiting_since_s}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "PolicyState":
        """Rebuilds a state from :meth:`to_dict` output.

        Args:
            d: the mapping.

        Returns:
            The state.

        Raises:
            PolicyError: the mapping is malformed.
        """
        try:
            plan = None
            pd = d.get("plan")
            if pd:
                plan = Plan(int(pd["generation"]), Level[pd["level"]], list(pd["failed_nodes"]),  # type: ignore
                            list(pd["cordon"]), dict(pd["replacements"]), bool(pd["shrink"]),  # type: ignore
                            float(pd["not_before_s"]), str(pd["reason"]),  # type: ignore
                            [str(n) for n in pd.get("unhealthy", [])],  # type: ignore
                            str(pd.get("waiting", "")), float(pd.get("waiting_since_s", 0.0)))  # type: ignore
            return cls(Phase[str(d["phase"])], int(d["generation"]), int(d["restart_count"]),  # type: ignore
                       int(d["consecutive"]), int(d["progress_step"]),  # type: ignore
                       {str(k): [float(t) for t in v] for k, v in dict(d["process_failures"]).items()},  # type: ignore
                       [float(t) for t in d["node_failures"]], [str(n) for n in d["cordoned"]],  # type: ignore
                       plan, str(d.get("message", "")), str(d.get("forming_waiting", "")),  # type: ignore
                       float(d.get("forming_since_s", 0.0)),  # type: ignore
                       {str(k): str(v) for k, v in dict(d.get("cordon_why") or {}).items()},  # type: ignore
                       {str(k): str(v) for k, v in dict(d.get("cordon_daemon") or {}).items()})  # type: ignore
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PolicyError(f"stored policy state is malformed ({exc}): the store is corrupt") from exc


@dataclass(frozen=True)
class Decision:
    """What the coordinator must do about one failure report.

    Attributes:
        level: the decided level (NONE for duplicates and advisories).
        generation: the generation to move to (the current one when nothing changes).
        duplicate: the report was about an older generation and changed nothing.
        merged: the report was folded into the recovery already being prepared.
        job_failed: the restart budget is exhausted; the job is FAILED.
        message: one line for logs and agents.
    """

    level: Level
    generation: int
    duplicate: bool = False
    merged: bool = False
    job_failed: bool = False
    message: str = ""


class RecoveryPolicy:
    """Applies the rules of the module docstring to a :class:`PolicyState` it owns.

    Args:
        config: the knobs.
        state: a state restored from the store, or None for a new job.
    """

    def __init__(self, config: PolicyConfig, state: PolicyState | None = None) -> None:
        self.config = config
        self.state = state if state is not None else PolicyState()

    # -- lifecycle
    def _move(self, trigger: Trigger) -> None:
        self.state.phase = transition(self.state.phase, trigger)

    def formed(self, generation: int, step: int = -1) -> None:
        """The first generation (or a recovery's generation) has a rank table and its nodes got START.

        Args:
            generation: the generation now current.
            step: the highest step known, for progress tracking.

        Raises:
            PolicyError: not FORMING or RECOVERING.
        """
        st = self.state
        if st.phase is Phase.FORMING:
            self._move(Trigger.MEMBERS_READY)
        elif st.phase is not Phase.RECOVERING:
            raise PolicyError(f"cannot form generation {generation} while {st.phase.name}")
        st.generation = generation
        st.progress_step = max(st.progress_step, step)

    def waiting_for(self, node_id: str) -> bool:
        """Whether the pending plan cordons ``node_id`` and waits, finding no node for a vacancy (no spare)."""
        plan = self.state.plan
        return plan is not None and node_id in plan.cordon and plan.waiting_since_s > 0

    def uncordon(self, node_id: str, why: str) -> bool:
        """Returns a cordoned node to service (a spare, or a vacancy's filler). A node the pending plan is about to
        cordon stays out while that plan can form (its failure is being handled now); when the plan waits for a
        spare nobody has, the node takes its slot back (without that, the repaired node could not end the wait).

        Args:
            node_id: the node.
            why: what vouches for it, for the job's message (a restarted daemon's report, an operator).

        Returns:
            Whether the node was uncordoned.
        """
        st = self.state
        planned = st.plan is not None and node_id in st.plan.cordon
        if planned and not self.waiting_for(node_id):
            return False
        if node_id not in st.cordoned and not planned:
            return False
        if planned:
            st.plan.cordon.remove(node_id)  # type: ignore[union-attr]
        was = st.cordon_why.pop(node_id, "")
        if node_id in st.cordoned:
            st.cordoned.remove(node_id)
        st.cordon_daemon.pop(node_id, None)
        st.message = f"node {node_id} back in service: {why}" + (f" (cordoned for: {was})" if was else "")
        return True

    def started(self, generation: int) -> None:
        """Every node of ``generation`` reported its workers running: RECOVERING becomes RUNNING.

        Args:
            generation: the generation that runs.
        """
        st = self.state
        if st.phase is Phase.RECOVERING and st.plan is None and generation == st.generation:
            self._move(Trigger.GENERATION_STARTED)

    def progressed(self, step: int) -> None:
        """A step beyond the one at the last start completed: the backoff starts over.

        Args:
            step: the highest completed step reported.
        """
        if step > self.state.progress_step >= -1 and self.state.phase is Phase.RUNNING:
            self.state.progress_step = step
            self.state.consecutive = 0

    def succeeded(self) -> None:
        """Every rank of the current generation exited 0.

        Raises:
            PolicyError: not RUNNING or RECOVERING.
        """
        self._move(Trigger.ALL_SUCCEEDED)
        n = self.state.restart_count
        self.state.message = f"succeeded in generation {self.state.generation} after {n} restart{'' if n == 1 else 's'}"

    def impossible(self, why: str) -> None:
        """The membership can never form a valid layout: the job fails.

        Args:
            why: the layout error.
        """
        self._move(Trigger.MEMBERSHIP_IMPOSSIBLE)
        self.state.plan = None
        self.state.message = why

    def plan_started(self) -> Plan:
        """The prepared plan's generation got its rank table: it becomes current, its cordon list final.

        Returns:
            The plan that was executed.

        Raises:
            PolicyError: no plan is pending.
        """
        st = self.state
        if st.plan is None:
            raise PolicyError("no recovery plan is pending")
        plan, st.plan = st.plan, None
        st.generation = plan.generation
        for n in plan.cordon:
            if n not in st.cordoned:
                st.cordoned.append(n)
        return plan

    def replanned(self, placement: Placement, now_s: float) -> bool:
        """Records the pending plan's latest placement (made on a membership change) and starts or stops the
        clock of :attr:`PolicyConfig.membership_timeout_s`.

        Args:
            placement: what :func:`~trainguard.recovery.planner.place` found for the membership now.
            now_s: wall clock, seconds.

        Returns:
            Whether the plan changed (the caller persists it).
        """
        plan = self.state.plan
        if plan is None or plan.level < Level.NODE:
            return False
        before = (dict(plan.replacements), plan.shrink, plan.waiting, plan.waiting_since_s)
        plan.replacements = dict(placement.replacements)
        plan.shrink = placement.shrunk
        plan.waiting = placement.waiting
        if placement.layout is not None:
            plan.waiting_since_s = 0.0
        elif not plan.waiting_since_s:
            plan.waiting_since_s = now_s
        return before != (plan.replacements, plan.shrink, plan.waiting, plan.waiting_since_s)

    def forming_checked(self, why: str, now_s: float) -> None:
        """Records whether the first generation's membership can be laid out (enough nodes registered).

        Args:
            why: the layout error ("" when the layout is valid, or when nodes are still missing).
            now_s: wall clock, seconds.
        """
        st = self.state
        if st.phase is not Phase.FORMING:
            return
        if not why:
            st.forming_waiting, st.forming_since_s = "", 0.0
            return
        st.forming_waiting = why
        if not st.forming_since_s:
            st.forming_since_s = now_s

    def check_membership(self, now_s: float) -> bool:
        """Fails the job (MEMBERSHIP_IMPOSSIBLE) when the pending plan, or the first generation, has waited
        longer than :attr:`PolicyConfig.membership_timeout_s` for a valid membership.

        Args:
            now_s: wall clock, seconds.

        Returns:
            Whether the job failed now.
        """
        st, timeout = self.state, self.config.membership_timeout_s
        if st.phase is Phase.FORMING and st.forming_since_s and now_s - st.forming_since_s >= timeout:
            self.impossible(f"job failed: the first generation found no valid membership for {timeout:g} s: "
                            f"{st.forming_waiting}")
            return True
        plan = st.plan
        if plan is None or not plan.waiting_since_s or now_s - plan.waiting_since_s < timeout:
            return False
        self.impossible(f"job failed: generation {plan.generation} found no valid membership for {timeout:g} s "
                        f"({plan.reason}): {plan.waiting}")
        return True

    # -- decisions
    def _prune(self, now: float) -> None:
        lo = now - self.config.window_s
        st = self.state
        st.node_failures = [t for t in st.node_failures if t >= lo]
        st.process_failures = {n: kept for n, ts in st.process_failures.items() if (kept := [t for t in ts if t >= lo])}

    def _level_for(self, f: Failure) -> tuple[Level, list[str]]:
        cfg, st = self.config, self.state
        level = max(BASE_LEVEL[f.cause], f.proposed)
        why: list[str] = []
        if level is Level.PROCESS and len(st.process_failures.get(f.node_id, [])) >= cfg.process_repeats_to_node:
            level = ESCALATION[(level, Escalation.REPEATED_ON_NODE)]
            why.append(f"node {f.node_id} failed {len(st.process_failures[f.node_id]) + 1} times")
        if level is Level.NODE and len(st.node_failures) >= cfg.node_repeats_to_job:
            level = ESCALATION[(level, Escalation.REPEATED_NODE_LEVEL)]
            why.append(f"{len(st.node_failures) + 1} node-level failures within {cfg.window_s:g} s")
        return Level(level), why

    def _backoff(self) -> float:
        n = self.state.consecutive
        if n <= 1:
            return 0.0
        return min(self.config.backoff_initial_s * 2 ** (n - 2), self.config.backoff_max_s)

    def _place_nodes(self, plan: Plan, layout: RankLayout | None, members: Sequence[NodeSpec],
                     spares: Sequence[NodeSpec]) -> list[str]:
        """Plans the failed slots of a node- or job-level plan with :func:`~trainguard.recovery.planner.place`.

        The placement is tentative: the coordinator places again on every membership change until the
        generation forms. A job-level plan escalated from node faults still swaps its cordoned nodes for spares
        where there are some: restarting the whole job must not put the node that just failed back into it.

        Returns:
            Escalation reasons (node level only: no valid placement, i.e. no usable spare and no valid shrink).
        """
        if plan.level < Level.NODE or layout is None:
            return []
        gone = set(plan.cordon)
        kept = [m for m in members if m.node_id not in gone]
        free = [s for s in spares if s.node_id not in gone]
        node_level = plan.level is Level.NODE
        placement = place(layout, kept, free, allow_shrink=node_level and self.config.allow_shrink,
                          min_nodes=self.config.min_nodes)
        plan.replacements = dict(placement.replacements)
        plan.shrink = placement.shrunk
        if not node_level or placement.layout is not None:
            return []
        return [placement.waiting]

    def on_failure(self, f: Failure, *, layout: RankLayout | None = None, members: Sequence[NodeSpec] = (),
                   spares: Sequence[NodeSpec] = ()) -> Decision:
        """Decides what to do about one failure report, updating the state.

        Args:
            f: the failure.
            layout: the current generation's rank layout (None before the first one forms).
            members: nodes holding slots (for shrink validation).
            spares: healthy spare nodes available now.

        Returns:
            The decision; when it opens or changes a plan, :attr:`PolicyState.plan` holds what to execute.
        """
        st, cfg = self.state, self.config
        if st.phase in (Phase.SUCCEEDED, Phase.FAILED):
            return Decision(Level.NONE, st.generation, duplicate=True, message=f"job is over: {st.message}")
        base = max(BASE_LEVEL[f.cause], f.proposed)
        if base is Level.NONE:
            return Decision(Level.NONE, st.generation, message=f"advisory noted: {f.describe()}")
        if st.phase is Phase.FORMING:
            # No generation runs: a failing node simply does not get a rank.
            if f.node_id not in st.cordoned and base >= Level.NODE:
                st.cordoned.append(f.node_id)
                st.cordon_why[f.node_id] = f.describe()
            return Decision(Level.NONE, st.generation, message=f"before the first generation: {f.describe()}")
        if layout is not None and layout.slot_of(f.node_id) is None:
            # A spare (or a node the layout no longer holds) runs no ranks: no generation to replace.
            if base >= Level.NODE and f.node_id not in st.cordoned:
                st.cordoned.append(f.node_id)
                st.cordon_why[f.node_id] = f.describe()
                return Decision(Level.NONE, st.generation, message=f"spare cordoned: {f.describe()}")
            return Decision(Level.NONE, st.generation, message=f"no ranks on that node: {f.describe()}")
        self._prune(f.time_s)
        is_old = 0 <= f.generation < st.generation
        if st.plan is not None and (is_old or f.generation == st.generation):
            return self._merge(f, layout, members, spares)
        if is_old:
            return Decision(Level.NONE, st.generation, duplicate=True,
                            message=f"duplicate: generation {f.generation} was already replaced by {st.generation}")
        # A new fault of the current generation (or of a node running nothing, e.g. a spare or a lost node).
        level, why = self._level_for(f)
        if st.restart_count >= cfg.max_restarts:
            trig = Trigger.BUDGET_EXHAUSTED
            self._move(trig)
            st.plan = None
            st.message = (f"job failed: {f.describe()}; restart budget exhausted after {st.restart_count} "
                          f"restart{'' if st.restart_count == 1 else 's'} (max {cfg.max_restarts})")
            return Decision(level, st.generation, job_failed=True, message=st.message)
        self._move(Trigger.FAILURE)
        st.restart_count += 1
        st.consecutive += 1
        plan = Plan(st.generation + 1, level, reason=f.describe(), not_before_s=f.time_s + self._backoff())
        st.plan = plan
        self._record(f, level)
        self._add_failed(plan, f, level)
        if level >= Level.NODE:
            st.cordon_why[f.node_id] = f.describe()
        reasons = self._place_nodes(plan, layout, members, spares)
        if reasons:
            plan.level = ESCALATION[(Level.NODE, Escalation.NO_SPARE_NO_SHRINK)]
            why += reasons
        if plan.level is Level.JOB:
            self._job_cordon(plan)
        st.message = self._describe_plan(plan, why)
        return Decision(plan.level, plan.generation, message=st.message)

    def _record(self, f: Failure, level: Level) -> None:
        st = self.state
        if level is Level.PROCESS:
            st.process_failures.setdefault(f.node_id, []).append(f.time_s)
        elif level is Level.NODE:
            st.node_failures.append(f.time_s)

    @staticmethod
    def _add_failed(plan: Plan, f: Failure, level: Level) -> None:
        if f.node_id not in plan.failed_nodes:
            plan.failed_nodes.append(f.node_id)
        if level >= Level.NODE and f.node_id not in plan.cordon:
            plan.cordon.append(f.node_id)
        if f.cause is Cause.NODE_CRITICAL and f.node_id not in plan.unhealthy:
            plan.unhealthy.append(f.node_id)

    def _job_cordon(self, plan: Plan) -> None:
        """A job-level plan cordons the replaced nodes and (with ``hold_unhealthy``) those that reported
        themselves broken; a lost node without a spare stays in, as it may come back and reclaim its slot."""
        held = plan.unhealthy if self.config.hold_unhealthy else []
        plan.cordon = [n for n in plan.cordon if n in plan.replacements or n in held]

    def _merge(self, f: Failure, layout: RankLayout | None, members: Sequence[NodeSpec],
               spares: Sequence[NodeSpec]) -> Decision:
        st = self.state
        plan = st.plan
        assert plan is not None
        before = (plan.level, tuple(plan.failed_nodes), tuple(plan.cordon))
        level, why = self._level_for(f)
        plan.level = max(plan.level, level)
        # Workers of healthy nodes die too when a peer fails (their collectives break): merged process-level
        # reports are consequences, so only node-level ones count towards escalation.
        if level >= Level.NODE:
            self._record(f, level)
        self._add_failed(plan, f, level)
        if level >= Level.NODE:
            st.cordon_why[f.node_id] = f.describe()
        if plan.level >= Level.NODE:
            reasons = self._place_nodes(plan, layout, members, spares)
            if reasons:
                plan.level = ESCALATION[(Level.NODE, Escalation.NO_SPARE_NO_SHRINK)]
                why += reasons
        if plan.level is Level.JOB:
            self._job_cordon(plan)
        if before != (plan.level, tuple(plan.failed_nodes), tuple(plan.cordon)):
            st.message = self._describe_plan(plan, why)
        return Decision(plan.level, plan.generation, merged=True,
                        message=f"merged into generation {plan.generation}: {st.message}")

    def _describe_plan(self, plan: Plan, why: Sequence[str]) -> str:
        st, cfg = self.state, self.config
        what = {Level.PROCESS: "restarting every worker in place",
                Level.NODE: plan.placement_text() or "replacing nodes",
                Level.JOB: "restarting the whole job from the last persisted checkpoint"}.get(plan.level, "")
        esc = f" (escalated: {'; '.join(why)})" if why else ""
        return (f"restart {st.restart_count}/{cfg.max_restarts}, {plan.level.name.lower()} level, generation "
                f"{plan.generation}: {plan.reason}; {what}{esc}")
