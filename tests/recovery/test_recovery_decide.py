"""The pure decision step (recovery/decide.py) and the planner (recovery/planner.py): no input is modified, every
state change comes with a Persist action, a vacancy is re-placed on each membership, and a plan that finds no
valid membership for ``membership_timeout_s`` fails the job through MEMBERSHIP_IMPOSSIBLE."""

from __future__ import annotations

from trainguard.recovery.decide import (FaultReported, GenerationFormed, MembershipChanged, Persist, Tick, decide)
from trainguard.recovery.planner import place
from trainguard.recovery.policy import Cause, Failure, Level, Phase, PolicyConfig, PolicyState, RecoveryPolicy
from trainguard.recovery.ranks import NodeSpec, assign_ranks

NODES = [NodeSpec(f"n{i}", "p1" if i < 2 else "p2", i, f"h{i}", 2) for i in range(4)]
LAYOUT = assign_ranks(NODES, group_size=4)
CFG = PolicyConfig(membership_timeout_s=60.0)


def _running() -> PolicyState:
    p = RecoveryPolicy(CFG)
    p.formed(1)
    return p.state


def test_fault_decision_is_pure_and_persisted() -> None:
    state = _running()
    before = state.to_dict()
    f = Failure("n3", 1, Cause.NODE_CRITICAL, time_s=10.0)
    other_pod = NodeSpec("s1", "p1", 9, "s1", 2)
    step = decide(CFG, state, FaultReported(f, LAYOUT, tuple(NODES), (other_pod,)))
    assert state.to_dict() == before  # the input state is untouched
    assert step.changed and isinstance(step.actions[0], Persist)
    # The p1 spare cannot take a p2 slot (ranks 4..7 would span pods): no replacement, job level, cordoned.
    assert step.decision.level is Level.JOB and step.state.plan.replacements == {}
    assert step.state.plan.cordon == ["n3"] and "in pod 'p2'" in step.decision.message


def test_membership_change_replans_and_the_timeout_fails_the_job() -> None:
    state = decide(CFG, _running(), FaultReported(Failure("n3", 1, Cause.NODE_CRITICAL, time_s=10.0), LAYOUT,
                                                  tuple(NODES))).state
    kept = tuple(n for n in NODES if n.node_id != "n3")
    waiting = place(LAYOUT, kept, (NodeSpec("s1", "p1", 9, "s1", 2),))
    assert waiting.layout is None and "slot 3 (was 'n3') needs a node of 2 device(s) in pod 'p2'" in waiting.waiting
    state = decide(CFG, state, MembershipChanged(waiting, 20.0)).state
    assert state.plan.waiting_since_s == 20.0
    assert decide(CFG, state, Tick(79.0)).state.phase is Phase.RECOVERING
    # A p2 spare arrives before the timeout: the placement uses it and the wait clock stops.
    ok = place(LAYOUT, kept, (NodeSpec("s1", "p1", 9, "s1", 2), NodeSpec("s2", "p2", 9, "s2", 2)))
    assert ok.layout is not None and ok.replacements == {"n3": "s2"}
    later = decide(CFG, state, MembershipChanged(ok, 30.0)).state
    assert later.plan.waiting_since_s == 0.0 and decide(CFG, later, Tick(1e9)).state.phase is Phase.RECOVERING
    formed = decide(CFG, later, GenerationFormed(2)).state
    assert formed.generation == 2 and formed.plan is None and formed.cordoned == ["n3"]
    # Nothing comes: after 60 s of waiting the job fails with the reason (MEMBERSHIP_IMPOSSIBLE).
    failed = decide(CFG, state, Tick(80.0))
    assert failed.state.phase is Phase.FAILED and failed.changed
    assert "no valid membership for 60 s" in failed.state.message and "pod 'p2'" in failed.state.message


def test_shrink_only_when_allowed_and_above_the_minimum() -> None:
    flat = assign_ranks(NODES)
    kept = tuple(NODES[:3])
    assert place(flat, kept, ()).layout is None
    shrunk = place(flat, kept, (), allow_shrink=True, min_nodes=3)
    assert shrunk.shrunk and shrunk.layout.node_ids == ("n0", "n1", "n2")
    assert "below the minimum 4" in place(flat, kept, (), allow_shrink=True, min_nodes=4).waiting
    # Why it waits suggests allowing shrinking only where it is not allowed (a shrunk job was told to allow it).
    assert place(flat, kept, ()).waiting.endswith("register a spare node in pod 'p2', or allow shrinking")
    assert "allow shrinking" not in place(flat, kept, (), allow_shrink=True, min_nodes=4).waiting
    # A spare that arrives before the plan forms is used instead of shrinking.
    spare = place(flat, kept, (NodeSpec("s", "p2", 9, "s", 2),), allow_shrink=True)
    assert not spare.shrunk and spare.layout.node_ids == ("n0", "n1", "n2", "s")


def test_first_generation_that_can_never_be_laid_out_fails_after_the_timeout() -> None:
    from trainguard.recovery.coordinator import JobCoordinator, JobSpec
    from trainguard.recovery.domain import Beat, Command, NodeRecord
    from trainguard.recovery.store import MemoryStore

    now = [100.0]
    core = JobCoordinator(JobSpec(job="j", nnodes=2, group_size=4, membership_timeout_s=30.0), store=MemoryStore(),
                          clock=lambda: now[0], wall=lambda: now[0])
    # Two nodes of 2 devices in different pods: group size 4 can never be satisfied by these two.
    leases = [core.register("j", NodeRecord(f"n{i}", f"p{i}", 0, f"h{i}", 2), 40000 + i)[0] for i in range(2)]
    beat = core.heartbeat(Beat("j", "n0", leases[0])).response
    assert beat.command is Command.WAIT and "cannot lay out ranks" in beat.message and "'p0'" in beat.message
    now[0] += 29.0
    assert core.heartbeat(Beat("j", "n0", leases[0])).response.phase is Phase.FORMING
    now[0] += 2.0
    final = core.heartbeat(Beat("j", "n0", leases[0])).response
    assert final.phase is Phase.FAILED and final.command is Command.STOP
    assert "first generation found no valid membership for 30 s" in final.message
    core.close()
