"""The one transition-table lookup behind every state machine: the node agent's parts and the job policy.

Stateful parts name their states and triggers in enums and spell their moves out as a
``{(state, trigger): next_state}`` table (:data:`trainguard.recovery.policy.TRANSITIONS`,
:mod:`trainguard.agent.parts`). Code fires a trigger only where it believes the move is legal, so a move the
table lacks is a bug in trainguard; each caller raises it as its own error type (``PolicyError`` in the
coordinator, ``IllegalTransitionError`` in the agent) so its callers keep catching what they catch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)


def next_state(table: Mapping[tuple[S, T], S], state: S, trigger: T, *, error: type[Exception], bug_of: str,
               log: str, part: str = "") -> S:
    """The state ``trigger`` leads to from ``state`` in ``table``.

    Args:
        table: the transition table.
        state: current state.
        trigger: what happened.
        error: the exception type raised when ``table`` has no such move.
        bug_of / log: in the message, whose bug the refusal is and which log to report it with.
        part: the state machine's name, a prefix of the message (none when empty).

    Returns:
        The next state.

    Raises:
        error: the table has no transition from ``state`` on ``trigger``.
    """
    try:
        return table[(state, trigger)]
    except KeyError:
        prefix = f"{part}: " if part else ""
        raise error(f"{prefix}no transition from {state.name} on {trigger.name.lower()}: this is a {bug_of} bug, "
                    f"please report it with the {log} log") from None


__all__ = ["next_state"]
