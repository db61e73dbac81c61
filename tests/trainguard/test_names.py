"""The name rules end at the end of the string: ``$`` also matches before a final newline, and a coordinator
took ``"nl-node\\n"`` as a node id and stored it as a key, a daemon ``"fznl\\n"`` as a job (fuzzing review)."""

from __future__ import annotations

import pytest

from trainguard.agent.launcher_lock import LOCK_NAME_RE
from trainguard.names import JOB_NAME_RE, NODE_ID_RE
from trainguard.step_timer import StepTimer
from trainguard.errors import TrainguardError


@pytest.mark.parametrize("pattern,good", [(NODE_ID_RE, "nl-node"), (JOB_NAME_RE, "fznl"),
                                          (LOCK_NAME_RE, "job-123.lock")])
def test_a_trailing_newline_is_not_part_of_a_name(pattern, good: str) -> None:
    assert pattern.match(good)
    assert not pattern.match(good + "\n")
    assert not pattern.match(good + "\r")


def test_a_section_name_with_a_trailing_newline_is_refused() -> None:
    timer = StepTimer()
    with timer.section("forward"):
        pass
    with pytest.raises(TrainguardError):
        timer.section("forward\n")
