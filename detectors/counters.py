"""Turns monotonically increasing hardware counters into deltas and rates.

Counters reset when a driver reloads or a device resets; a value below the previous one is taken as a reset and
counted from zero, never as a negative delta.
"""

from __future__ import annotations

import collections
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
        implausible: the increase was beyond ``max_rate`` (delta and rate read 0; the new value is the baseline).
    """

    delta: int
    rate: float
    first: bool
    reset: bool
    implausible: bool = False


class CounterTracker:
    """Remembers the last value of many named counters."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}

    def update(self, key: str, value: int, now: float | None = None, max_rate: float | None = None) -> CounterDelta:
        """Records a new reading.

        Args:
            key: counter identity (device plus name).
            value: the raw counter value.
            now: monotonic time in seconds; ``time.monotonic()`` when None.
            max_rate: the most the counter can rise per second (per second of at least one second elapsed); a
                larger increase is no count but a misread or garbage value (a 64-bit counter reading 0 then
                near 2**64), returned as ``implausible`` with no delta, and the new value becomes the baseline.

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
        if max_rate is not None and delta > max_rate * max(elapsed, 1.0):
            return CounterDelta(0, 0.0, False, reset, implausible=True)
        return CounterDelta(delta, delta / elapsed if elapsed > 0 else 0.0, False, reset)

    def restart(self, prefix: str) -> None:
        """Takes the counters whose key starts with ``prefix`` as counting from zero since their last reading: their
        device was removed and made anew (a driver reload, a reset), which starts its counters at zero. Compared
        with the old values instead, its new errors went unseen until the counts passed the old ones.

        Args:
            prefix: the key prefix of the device's counters.
        """
        for key, (_, when) in list(self._last.items()):
            if key.startswith(prefix):
                self._last[key] = (0, when)

    def forget_missing(self, keep: set[str]) -> None:
        """Drops counters of devices that disappeared.

        Args:
            keep: keys still present.
        """
        for key in list(self._last):
            if key not in keep:
                del self._last[key]


class RecentCounts:
    """Increases of counters within a trailing window, summed per key: a threshold "per hour" is judged on what
    the last hour counted, not on one sampling interval's rate scaled to an hour (one error in 30 s is 120/hour).
    Before a whole window has passed it sums what the time since the start counted.

    Args:
        window_s: length of the window, seconds.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self._seen: dict[str, collections.deque[tuple[float, int]]] = {}

    def add(self, key: str, delta: int, now: float | None = None) -> int:
        """Records an increase of ``key`` (0: none) and returns the sum within the window ending ``now``.

        Args:
            key: counter identity.
            delta: increase since the previous reading.
            now: monotonic time in seconds; ``time.monotonic()`` when None.

        Returns:
            The increases of ``key`` within the last ``window_s`` seconds, this one included.
        """
        now = time.monotonic() if now is None else now
        recent = self._seen.setdefault(key, collections.deque())
        if delta > 0:
            recent.append((now, delta))
        while recent and now - recent[0][0] > self.window_s:
            recent.popleft()
        return sum(n for _, n in recent)

    def span_s(self, now: float | None = None) -> float:
        """The seconds the sums cover now: the window, or less since the start."""
        now = time.monotonic() if now is None else now
        return min(self.window_s, now - self.started)

    def span_text(self, now: float | None = None) -> str:
        """The span the sums cover, for a message: ``"the last hour"``, ``"the last 12 min"``, ``"the last 40 s"``."""
        span = self.span_s(now)
        if span >= self.window_s and self.window_s == 3600:
            return "the last hour"
        return f"the last {span / 60:.0f} min" if span >= 120 else f"the last {span:.0f} s"

    def forget(self, key: str) -> None:
        """Drops the history of ``key`` (its device went away)."""
        self._seen.pop(key, None)
