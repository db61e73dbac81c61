"""Turns monotonically increasing hardware counters into deltas and rates.

Counters reset when a driver reloads or a device resets; a value below the previous one is taken as a reset and
counted from zero, never as a negative delta.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CounterDelta:
    """Change of one counter since its previous reading.

    Attributes:
        delta: increase since the previous reading (0 on the first reading).
        rate: increase per second (0.0 on the first reading).
        first: True on the first reading of this counter.
        reset: True when the counter went backwards (taken as a reset).
    """

    delta: int
    rate: float
    first: bool
    reset: bool


class CounterTracker:
    """Remembers the last value of many named counters."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}

    def update(self, key: str, value: int, now: float | None = None) -> CounterDelta:
        """Records a new reading.

        Args:
            key: counter identity (device plus name).
            value: the raw counter value.
            now: monotonic time in seconds; ``time.monotonic()`` when None.

        Returns:
            The change since the previous reading.
        """
        now = time.monotonic() if now is None else now
        prev = self._last.get(key)
        self._last[key] = (value, now)
        if prev is None:
            return CounterDelta(0, 0.0, True, False)
        last_value, last_time = prev
        reset = value < last_value
        delta = value if reset else value - last_value
        elapsed = now - last_time
        return CounterDelta(delta, delta / elapsed if elapsed > 0 else 0.0, False, reset)

    def forget_missing(self, keep: set[str]) -> None:
        """Drops counters of devices that disappeared.

        Args:
            keep: keys still present.
        """
        for key in list(self._last):
            if key not in keep:
                del self._last[key]
