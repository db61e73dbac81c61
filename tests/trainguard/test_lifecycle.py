"""The shared transition lookup: each caller keeps its own error type and message (the job policy's PolicyError,
the agent parts' IllegalTransitionError), and a legal move returns the table's next state."""

from __future__ import annotations

import enum

import pytest

from trainguard.agent.errors import IllegalTransitionError
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.parts import SUPERVISOR_TRANSITIONS, SupervisorState, SupervisorTrigger
from trainguard.lifecycle import next_state
from trainguard.recovery.errors import PolicyError
from trainguard.recovery.policy import Phase, Trigger, transition


class _S(enum.Enum):
    A = "a"
    B = "b"


class _T(enum.Enum):
    GO = "go"
    BACK = "back"


def test_legal_move_and_refusal_with_the_callers_error() -> None:
    table = {(_S.A, _T.GO): _S.B}
    assert next_state(table, _S.A, _T.GO, error=ValueError, bug_of="x", log="y") is _S.B
    with pytest.raises(KeyError) as info:  # any exception type the caller names
        next_state(table, _S.B, _T.BACK, error=KeyError, bug_of="x", log="y", part="p")
    assert info.value.args == ("p: no transition from B on back: this is a x bug, please report it with the y log",)


def test_policy_refusal_is_a_policy_error_with_its_message() -> None:
    assert transition(Phase.FORMING, Trigger.MEMBERS_READY) is Phase.RUNNING
    with pytest.raises(PolicyError) as info:
        transition(Phase.SUCCEEDED, Trigger.FAILURE)
    assert str(info.value) == ("no transition from SUCCEEDED on failure: this is a coordinator bug, please report it "
                               "with the coordinator log")


def test_agent_refusal_is_an_illegal_transition_with_its_message() -> None:
    lc = Lifecycle("supervisor", SUPERVISOR_TRANSITIONS, SupervisorState.INIT)
    with pytest.raises(IllegalTransitionError) as info:
        lc.fire(SupervisorTrigger.STOPPED)
    assert str(info.value) == ("supervisor: no transition from INIT on stopped: this is a trainguard bug, please "
                               "report it with the agent log")
    assert lc.state is SupervisorState.INIT
