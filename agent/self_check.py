"""Whether the daemon's detector sampler still makes progress, for the watchdog self-check
(:meth:`~trainguard.agent.agentd.AgentDaemon._healthy`).

Progress is the runner's sample count changing, timed on a monotonic clock. The check used to subtract the
newest sample's wall-clock stamp from ``time.time()``: an NTP step forward made a working sampler look stalled
(the watchdog pings stopped and systemd restarted a healthy agent), a step back hid a stalled one for as long as
the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

#: A sampler that has not completed a sample for this many of its shortest intervals (plus the slack) is stalled.
STALL_INTERVALS = 3
#: Seconds added to the stall bound (a slow first read of sysfs, a loaded node).
STALL_SLACK_S = 10.0


class SamplerProgress:
    """Times how long the detector runner's sample count has stood still.

    Args:
        clock: seconds on a clock that never steps (default ``time.monotonic``; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._count = 0  # samples taken, all detectors together: none before the first
        self._since = clock()  # when the count last changed (the daemon's start before any sample)

    def observe(self, statuses: Sequence[Any]) -> None:
        """Takes the runner's statuses (:class:`~trainguard.detectors.runner.DetectorStatus`); a grown sample
        count is progress."""
        count = sum(s.samples for s in statuses)
        if count != self._count:
            self._count = count
            self._since = self._clock()

    def stalled(self, statuses: Sequence[Any], shortest_interval_s: float) -> bool:
        """Whether no detector completed a sample for ``STALL_INTERVALS`` of the shortest interval plus
        ``STALL_SLACK_S`` seconds (measured from the start before the first sample).

        Args:
            statuses: the runner's statuses now (observed first).
            shortest_interval_s: the shortest sampling interval of the runner's detectors, in seconds.
        """
        self.observe(statuses)
        if not statuses:
            return False
        return self._clock() - self._since > STALL_INTERVALS * shortest_interval_s + STALL_SLACK_S
