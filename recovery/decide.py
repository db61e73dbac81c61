"""Decide, then apply: the coordinator's recovery decisions as one pure step, ``state + event -> state + actions``.

The shape is torch elastic's rendezvous (a state, an event, the next state and what to do): every decision about
the job's lifecycle goes through :func:`decide`, over plain domain types (:class:`~.policy.PolicyState`,
:class:`~.policy.Failure`, :class:`~.ranks.RankLayout`, :class:`~.ranks.NodeSpec`,
:class:`~.planner.Placement`); nothing here touches the store, the network or protobuf, and the input state is
never modified. The coordinator (:mod:`~trainguard.recovery.coordinator`) is the effect layer: it turns requests
and timers into events, keeps the returned state as its own, and applies the actions (commit to the store,
log); agents learn their commands from that state on their next heartbeat.

Events::

    FaultReported      a node (or the lease reaper) reports a fault       -> level, budget, plan (or FAILED)
    MembershipChanged  the pending plan was placed on the membership now  -> plan updated, wait clock
    FormingChecked     the first generation's membership was laid out     -> wait clock (invalid layout only)
    Tick               time passed                                        -> MEMBERSHIP_IMPOSSIBLE after the timeout
    GenerationFormed   a generation got its rank table                    -> FORMING/plan -> current generation
    GenerationRunning  every node of the current generation runs it      -> RECOVERING -> RUNNING
    AllSucceeded       every rank of the current generation exited 0      -> SUCCEEDED
    Progressed         a step beyond the last start completed             -> backoff starts over
    NodeDisqualified   a node without a slot failed its pre-flight check  -> cordoned, with the reason
    DaemonHealthy      a restarted node daemon reports a cordoned node healthy -> uncordoned (a spare again)
    OperatorUncordon   an operator returns a cordoned node to service     -> uncordoned (a spare again)
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass

from trainguard.recovery.planner import Placement
from trainguard.recovery.policy import Decision, Failure, Phase, PolicyConfig, PolicyState, RecoveryPolicy
from trainguard.recovery.ranks import NodeSpec, RankLayout


@dataclass(frozen=True)
class FaultReported:
    """A fault report (or a lost lease) with the membership it happened in."""

    failure: Failure
    layout: RankLayout | None
    holders: tuple[NodeSpec, ...] = ()
    free: tuple[NodeSpec, ...] = ()


@dataclass(frozen=True)
class MembershipChanged:
    """The pending plan's placement on the membership now (made by :func:`~.planner.place`)."""

    placement: Placement
    now_s: float


@dataclass(frozen=True)
class FormingChecked:
    """Whether the first generation can be laid out: ``why`` is the layout error, "" when valid (or nodes are
    still missing, which is not a membership problem)."""

    why: str
    now_s: float


@dataclass(frozen=True)
class Tick:
    """Time passed (wall clock seconds): drives the membership timeout."""

    now_s: float


@dataclass(frozen=True)
class GenerationFormed:
    """The first generation, or the pending plan's, got its rank table."""

    generation: int
    step: int = -1


@dataclass(frozen=True)
class GenerationRunning:
    """Every node of ``generation`` reported its workers running."""

    generation: int


@dataclass(frozen=True)
class AllSucceeded:
    """Every rank of the current generation exited 0."""


@dataclass(frozen=True)
class Progressed:
    """A step beyond the one at the last start completed."""

    step: int


@dataclass(frozen=True)
class NodeDisqualified:
    """A node holding no slot failed its pre-flight qualification (:mod:`~.qualification`); ``reason`` says why."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class DaemonHealthy:
    """A node daemon reports its node HEALTHY; ``instance`` is the daemon process's id. The coordinator sends it
    only for a cordoned node that holds no slot and was not refused by its pre-flight check."""

    node_id: str
    instance: str


@dataclass(frozen=True)
class OperatorUncordon:
    """An operator vouches for a cordoned node (``trainguard uncordon``); ``reason`` is their one line."""

    node_id: str
    reason: str = ""


Event = (FaultReported | MembershipChanged | FormingChecked | Tick | GenerationFormed | GenerationRunning
         | AllSucceeded | Progressed | NodeDisqualified | DaemonHealthy | OperatorUncordon)


class Severity(enum.Enum):
    """How loudly an :class:`Announce` action is logged."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class Persist:
    """Commit the new state to the store before any answer that depends on it."""


@dataclass(frozen=True)
class Announce:
    """Log one line about the job."""

    severity: Severity
    text: str


Action = Persist | Announce


@dataclass(frozen=True)
class Step:
    """What :func:`decide` returns.

    Attributes:
        state: the next state (a new object; the input is untouched).
        actions: what the effect layer must do, in order.
        decision: the decision about a :class:`FaultReported` event (None for other events).
    """

    state: PolicyState
    actions: tuple[Action, ...] = ()
    decision: Decision | None = None

    @property
    def changed(self) -> bool:
        """Whether the state changed (a :class:`Persist` is among the actions)."""
        return any(isinstance(a, Persist) for a in self.actions)


def decide(config: PolicyConfig, state: PolicyState, event: Event) -> Step:
    """The pure decision step: applies one event to a copy of ``state`` with the rules of :mod:`~.policy`.

    Args:
        config: the policy's knobs.
        state: the current state (not modified).
        event: what happened.

    Returns:
        The next state and the actions to apply.

    Raises:
        PolicyError: the event is not allowed in the state's phase (a coordinator bug).
    """
    policy = RecoveryPolicy(config, copy.deepcopy(state))
    actions: list[Action] = []
    decision = None
    if isinstance(event, FaultReported):
        decision = policy.on_failure(event.failure, layout=event.layout, members=event.holders, spares=event.free)
    elif isinstance(event, MembershipChanged):
        policy.replanned(event.placement, event.now_s)
    elif isinstance(event, FormingChecked):
        policy.forming_checked(event.why, event.now_s)
    elif isinstance(event, Tick):
        if policy.check_membership(event.now_s):
            actions.append(Announce(Severity.ERROR, policy.state.message))
    elif isinstance(event, GenerationFormed):
        if policy.state.plan is not None and policy.state.phase is not Phase.FORMING:
            plan = policy.plan_started()
            if plan.replacements:
                actions.append(Announce(Severity.WARNING, f"generation {plan.generation}: {plan.placement_text()}"))
        else:
            policy.formed(event.generation, event.step)
    elif isinstance(event, GenerationRunning):
        policy.started(event.generation)
    elif isinstance(event, AllSucceeded):
        policy.succeeded()
        actions.append(Announce(Severity.INFO, policy.state.message))
    elif isinstance(event, Progressed):
        policy.progressed(event.step)
    elif isinstance(event, NodeDisqualified):
        # Holding no slot, the node needs no recovery: it only joins the cordon list, which keeps it out of the
        # first generation and of every placement of spares (costs no restart and no budget).
        st = policy.state
        if event.node_id not in st.cordoned:
            st.cordoned.append(event.node_id)
            st.cordon_why[event.node_id] = event.reason
            st.message = f"node {event.node_id} cordoned: {event.reason}"
            actions.append(Announce(Severity.WARNING, st.message))
    elif isinstance(event, DaemonHealthy):
        # Only another daemon process than the one heard at the cordon vouches for a repair: the one that saw the
        # fault (or a slow, crashing or lost node it did not see) says healthy all along.
        seen = policy.state.cordon_daemon.get(event.node_id, "")
        if event.instance and event.instance != seen and policy.uncordon(
                event.node_id, "its node daemon was restarted and reports it healthy"):
            actions.append(Announce(Severity.WARNING, policy.state.message))
    elif isinstance(event, OperatorUncordon):
        if policy.uncordon(event.node_id, "an operator returned it to service"
                           + (f": {event.reason}" if event.reason else "")):
            actions.append(Announce(Severity.WARNING, policy.state.message))
    new = policy.state
    if new.to_dict() != state.to_dict():
        actions.insert(0, Persist())
        if decision is not None:
            sev = Severity.ERROR if decision.job_failed else Severity.DEBUG if decision.merged else Severity.WARNING
            actions.append(Announce(sev, decision.message))
    return Step(new, tuple(actions), decision)
