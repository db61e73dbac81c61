"""Recovery policy: levels per cause, escalation on repeats, spare/shrink/job choice, global budget and
backoff, one generation for simultaneous failures, and state round-trips."""

from __future__ import annotations

import pytest

from trainguard.recovery.errors import PolicyError
from trainguard.recovery.policy import (BASE_LEVEL, TRANSITIONS, Cause, Failure, Level, Phase, PolicyConfig,
                                        PolicyState, RecoveryPolicy, Trigger, transition)
from trainguard.recovery.ranks import NodeSpec, assign_ranks

MEMBERS = [NodeSpec(f"n{i}", "pod-a" if i < 2 else "pod-b", i, f"h{i}", 2, f"10.0.0.{i}") for i in range(4)]
LAYOUT = assign_ranks(MEMBERS)
SPARE_A = NodeSpec("spare-a", "pod-a", 9, "s1", 2, "10.0.1.1")
SPARE_B = NodeSpec("spare-b", "pod-b", 9, "s2", 2, "10.0.1.2")


def _running(**cfg) -> RecoveryPolicy:
    p = RecoveryPolicy(PolicyConfig(**cfg))
    p.formed(1)
    return p


def _fail(p: RecoveryPolicy, node: str, cause: Cause = Cause.WORKER_EXIT, gen: int | None = None, t: float = 0.0,
          spares=(), **kw) -> object:
    f = Failure(node, p.state.generation if gen is None else gen, cause, time_s=t, **kw)
    return p.on_failure(f, layout=LAYOUT, members=MEMBERS, spares=list(spares))


def _execute(p: RecoveryPolicy) -> None:
    plan = p.plan_started()
    assert plan.generation == p.state.generation
    p.started(plan.generation)


def test_transition_table_is_closed() -> None:
    assert transition(Phase.FORMING, Trigger.MEMBERS_READY) is Phase.RUNNING
    with pytest.raises(PolicyError, match="no transition from SUCCEEDED"):
        transition(Phase.SUCCEEDED, Trigger.FAILURE)
    assert all(isinstance(v, Phase) for v in TRANSITIONS.values())
    assert set(BASE_LEVEL) == set(Cause)


def test_worker_crash_is_process_level_and_costs_one_restart() -> None:
    p = _running(max_restarts=3)
    d = _fail(p, "n1", rank=3, exit_code=-9)
    assert d.level is Level.PROCESS and d.generation == 2 and not d.job_failed
    assert p.state.phase is Phase.RECOVERING and p.state.restart_count == 1
    assert "rank 3 on node n1 killed by SIGKILL" in d.message
    _execute(p)
    assert p.state.phase is Phase.RUNNING and p.state.generation == 2


def test_simultaneous_failures_give_one_generation() -> None:
    p = _running(max_restarts=5)
    first = _fail(p, "n1", Cause.NODE_CRITICAL, spares=[SPARE_A, SPARE_B])
    # Every other node reports too, about generation 1, before generation 2 starts.
    others = [_fail(p, "n3", Cause.NODE_LOST, gen=1, spares=[SPARE_A, SPARE_B]),
              _fail(p, "n0", Cause.WORKER_EXIT, gen=1, spares=[SPARE_A, SPARE_B]),
              _fail(p, "n2", Cause.WORKER_EXIT, gen=1, spares=[SPARE_A, SPARE_B])]
    assert first.generation == 2 and all(d.merged and d.generation == 2 for d in others)
    assert p.state.restart_count == 1
    plan = p.state.plan
    assert plan.level is Level.NODE and sorted(plan.cordon) == ["n1", "n3"]
    assert plan.replacements == {"n1": "spare-a", "n3": "spare-b"}  # same-pod spares
    _execute(p)
    late = _fail(p, "n2", Cause.WORKER_EXIT, gen=1)
    assert late.duplicate and late.level is Level.NONE and p.state.restart_count == 1


def test_repeated_crashes_on_one_node_escalate_to_node_level() -> None:
    p = _running(max_restarts=10, process_repeats_to_node=2)
    for t in (1.0, 2.0):
        assert _fail(p, "n2", t=t, spares=[SPARE_B]).level is Level.PROCESS
        _execute(p)
    d = _fail(p, "n2", t=3.0, spares=[SPARE_B])
    assert d.level is Level.NODE and p.state.plan.replacements == {"n2": "spare-b"}
    assert "escalated: node n2 failed 3 times" in d.message


def test_repeats_outside_the_window_do_not_escalate() -> None:
    p = _running(max_restarts=10, process_repeats_to_node=1, window_s=10)
    _fail(p, "n2", t=0.0)
    _execute(p)
    assert _fail(p, "n2", t=100.0).level is Level.PROCESS


def test_no_spare_and_no_shrink_goes_job_level() -> None:
    p = _running()
    d = _fail(p, "n1", Cause.NODE_LOST)
    assert d.level is Level.JOB and "slot 1 (was 'n1', pod 'pod-a') needs a node" in d.message
    assert p.state.plan.cordon == []  # a lost node may come back and reclaim its slot
    q = _running()
    assert _fail(q, "n1", Cause.NODE_CRITICAL).level is Level.JOB
    assert q.state.plan.cordon == ["n1"]  # one that said it is broken waits for a spare ...
    r = _running(hold_unhealthy=False)
    assert _fail(r, "n1", Cause.NODE_CRITICAL).level is Level.JOB
    assert r.state.plan.cordon == []  # ... unless there is no other capacity to wait for


def test_shrink_when_allowed_and_valid() -> None:
    p = _running(allow_shrink=True, min_nodes=3)
    d = _fail(p, "n1", Cause.NODE_CRITICAL)
    assert d.level is Level.NODE and p.state.plan.shrink and "shrinking" in d.message
    assert "; shrinking" in d.message and "replacing " not in d.message, d.message  # was "replacing  and shrinking"
    q = _running(allow_shrink=True, min_nodes=4)
    assert _fail(q, "n1", Cause.NODE_CRITICAL).level is Level.JOB


def test_repeated_node_failures_escalate_to_job() -> None:
    p = _running(max_restarts=10, node_repeats_to_job=1)
    assert _fail(p, "n1", Cause.NODE_CRITICAL, spares=[SPARE_A]).level is Level.NODE
    _execute(p)
    d = _fail(p, "n2", Cause.NODE_CRITICAL, spares=[SPARE_B])
    assert d.level is Level.JOB
    # The whole job restarts, but never with the node that just failed when a spare can take its slot.
    assert p.state.plan.cordon == ["n2"] and p.state.plan.replacements == {"n2": "spare-b"}
    _execute(p)
    # Without a spare a node that said it is broken stays cordoned (the job waits for capacity) ...
    d = _fail(p, "n3", Cause.NODE_CRITICAL, t=1.0)
    assert d.level is Level.JOB and p.state.plan.cordon == ["n3"] and p.state.plan.replacements == {}
    restored = PolicyState.from_dict(p.state.to_dict())
    assert restored.plan.unhealthy == ["n3"]
    _execute(p)
    # ... while a lost one stays in: it may come back and reclaim its slot.
    d = _fail(p, "n0", Cause.NODE_LOST, t=2.0)
    assert d.level is Level.JOB and p.state.plan.cordon == [] and p.state.plan.replacements == {}


def test_budget_is_global_and_exhaustion_names_rank_code_and_count() -> None:
    p = _running(max_restarts=2)
    for node in ("n0", "n3"):
        _fail(p, node)
        _execute(p)
    d = _fail(p, "n1", rank=2, exit_code=3)
    assert d.job_failed and p.state.phase is Phase.FAILED
    assert "rank 2 on node n1 exited with code 3" in d.message and "after 2 restarts (max 2)" in d.message
    assert _fail(p, "n1").duplicate


def test_backoff_doubles_without_progress_and_resets_on_progress() -> None:
    p = _running(max_restarts=10, backoff_initial_s=1.0, backoff_max_s=3.0, process_repeats_to_node=99)
    waits = []
    for t in range(4):
        _fail(p, "n0", t=100.0 * t)
        waits.append(p.state.plan.not_before_s - 100.0 * t)
        _execute(p)
    assert waits == [0.0, 1.0, 2.0, 3.0]
    p.progressed(50)
    _fail(p, "n0", t=1000.0)
    assert p.state.plan.not_before_s == 1000.0


def test_spare_failure_only_cordons_it_and_advisory_does_nothing() -> None:
    p = _running()
    d = _fail(p, "spare-a", Cause.NODE_CRITICAL)
    assert d.level is Level.NONE and p.state.cordoned == ["spare-a"] and p.state.restart_count == 0
    assert _fail(p, "n0", Cause.ADVISORY).level is Level.NONE and p.state.phase is Phase.RUNNING


def test_state_roundtrip_mid_recovery() -> None:
    p = _running(max_restarts=5)
    _fail(p, "n1", Cause.NODE_CRITICAL, spares=[SPARE_A], t=5.0)
    restored = RecoveryPolicy(p.config, PolicyState.from_dict(p.state.to_dict()))
    assert restored.state == p.state
    with pytest.raises(PolicyError, match="corrupt"):
        PolicyState.from_dict({"phase": "NOPE"})


def test_success_ends_the_job() -> None:
    p = _running()
    p.succeeded()
    assert p.state.phase is Phase.SUCCEEDED and "succeeded in generation 1" in p.state.message
