"""The coordinator's last store write of each key, so that a write lost to a store outage is made again.

A write the coordinator depends on (a node's record, the job state, the committed checkpoint step) is submitted
to the group committer and its caller is answered UNAVAILABLE, "retry shortly", when the store fails. The
in-memory state has moved on already, and nothing wrote it again: after an outage during formation every
heartbeat waited on the failed generation write and was refused for good, and a registration retried by the
same agent was acknowledged although its record never reached the store. :class:`WriteLedger` remembers the
last write of each key; the coordinator asks it which failed and writes their *current* values again.

It is not thread-safe on its own: :class:`~trainguard.recovery.coordinator.JobCoordinator` calls every method
with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

from trainguard.recovery.errors import FencedError, StoreError
from trainguard.recovery.store import Put


def lost(fut: Future | None) -> bool:
    """Whether a write failed in a way writing it again can mend (a store error, not being fenced off)."""
    if fut is None or not fut.done() or fut.cancelled():
        return False
    exc = fut.exception()
    return isinstance(exc, StoreError) and not isinstance(exc, FencedError)


class WriteLedger:
    """The last write of each store key (call with the coordinator's lock held).

    Args:
        submit: queues puts for a durable commit and returns its future (the group committer's ``submit``).
    """

    def __init__(self, submit: Callable[[Sequence[Put]], Future]) -> None:
        self._submit = submit
        self._last: dict[str, Future] = {}

    def submit(self, puts: Sequence[Put]) -> Future:
        """Queues puts and remembers the write as the last one of each key it names."""
        fut = self._submit(puts)
        for p in puts:
            self._last[p.key] = fut
        return fut

    def last(self, key: str) -> Future | None:
        """The last write of ``key`` unless it landed (pending or failed), else None."""
        fut = self._last.get(key)
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            del self._last[key]
            return None
        return fut

    def lost_keys(self) -> list[str]:
        """Keys whose last write failed and can be written again; forgets the writes that landed."""
        keys = []
        for key, fut in list(self._last.items()):
            if lost(fut):
                keys.append(key)
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                del self._last[key]
        return keys
