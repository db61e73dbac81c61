"""The state machine under each part of the node agent: a current state, a transition table, a lock.

Each part (:mod:`~trainguard.agent.supervisor`, :mod:`~trainguard.agent.coordinator_link`,
:mod:`~trainguard.agent.node_health`) names its states and triggers in enums and spells its transitions out as a
``{(state, trigger): next_state}`` table, as :mod:`trainguard.recovery.policy` does for a job (both are looked
up by :func:`trainguard.lifecycle.next_state`). A trigger the table does not list for the current state is
refused with :class:`~trainguard.agent.errors.IllegalTransitionError`: the parts call :meth:`Lifecycle.fire`
where their code believes the move is legal, so a refusal is a bug, and a loud one.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Mapping
from typing import Generic, TypeVar

from trainguard.agent.errors import IllegalTransitionError
from trainguard.lifecycle import next_state

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T", bound=enum.Enum)


def lookup(table: Mapping[tuple[S, T], S], state: S, trigger: T, part: str) -> S:
    """The state ``trigger`` leads to from ``state`` in ``table``.

    Args:
        table: the part's transition table.
        state: current state.
        trigger: what happened.
        part: the part's name, for the error message.

    Returns:
        The next state.

    Raises:
        IllegalTransitionError: the table has no such transition.
    """
    return next_state(table, state, trigger, error=IllegalTransitionError, bug_of="trainguard", log="agent",
                      part=part)


class Lifecycle(Generic[S, T]):
    """The current state of one part and its moves through a transition table (thread-safe).

    Args:
        part: the part's name (in errors and logs).
        table: ``{(state, trigger): next_state}``.
        initial: the state it starts in.
    """

    def __init__(self, part: str, table: Mapping[tuple[S, T], S], initial: S) -> None:
        self.part = part
        self._table = dict(table)
        self._state = initial
        self._since = time.monotonic()
        self._lock = threading.Lock()

    @property
    def state(self) -> S:
        """The current state."""
        return self._state

    @property
    def since(self) -> float:
        """``time.monotonic()`` of the last transition (or of creation)."""
        return self._since

    def can(self, trigger: T) -> bool:
        """Whether ``trigger`` is a legal move from the current state."""
        return (self._state, trigger) in self._table

    def fire(self, trigger: T) -> S:
        """Moves to the state ``trigger`` leads to.

        Returns:
            The new state.

        Raises:
            IllegalTransitionError: the table has no transition from the current state on ``trigger``.
        """
        with self._lock:
            nxt = lookup(self._table, self._state, trigger, self.part)
            if nxt is not self._state:
                self._since = time.monotonic()
            self._state = nxt
            return nxt

    def fire_if(self, trigger: T) -> bool:
        """Moves on ``trigger`` when it is legal from the current state; returns whether it moved."""
        with self._lock:
            nxt = self._table.get((self._state, trigger))
            if nxt is None:
                return False
            if nxt is not self._state:
                self._since = time.monotonic()
            self._state = nxt
            return True
