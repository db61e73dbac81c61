"""Node-level faults as the node agent reports them: the hardware cause of a worker's death, once per generation.

A worker killed by a hardware fault (PCIe AER fatal, a GPU fallen off the bus) must not be restarted on the same
broken node. When a worker fails, :func:`hardware_cause` asks the hardware detectors for an out-of-schedule
sample (taken by the :class:`~trainguard.detectors.runner.DetectorRunner`'s own thread, waited for at most
:data:`HARDWARE_SAMPLE_WAIT_S`) and looks for a node-level event (action DRAIN_NODE or more) in, in this order:

1. events not yet handled by the agent's loop (that round's events land there too),
2. the start events of conditions still active (a lost device sends its event once, then stays lost),
3. the node-level report already made for the failed generation (an AER fatal handled a moment earlier).

:class:`NodeReportLedger` remembers the last node- or job-level report, so the same fault reaching the agent by
two paths (the worker's death, then the detector event itself; or a predictor drain after a hardware report)
gives one report per generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from trainguard.detectors.events import Action, HealthEvent
from trainguard.proto import coordinator_pb2

log = logging.getLogger(__name__)

#: Seconds a worker failure's report waits at most for the hardware detectors' out-of-schedule sample.
HARDWARE_SAMPLE_WAIT_S = 1.0


def recovery_level(ev: HealthEvent) -> int:
    """The proto ``RecoveryLevel`` a node-level event asks for: JOB for RESTART_JOB, else NODE."""
    if ev.action == Action.RESTART_JOB:
        return coordinator_pb2.RECOVERY_LEVEL_JOB
    return coordinator_pb2.RECOVERY_LEVEL_NODE


def hardware_detector_names(detectors: Iterable[Any]) -> tuple[str, ...]:
    """Names of the detectors that watch the node's hardware: all but those watching the workers (``process``)."""
    return tuple(d.name for d in detectors if not getattr(d, "accepts_worker_view", False))


class NodeReportLedger:
    """The last node- or job-level report this agent made: (generation, level, cause); thread-safe."""

    def __init__(self) -> None:
        """Creates an empty ledger."""
        self._lock = threading.Lock()
        self._last: tuple[int, int, HealthEvent] | None = None

    def record(self, ev: HealthEvent, generation: int) -> int:
        """Notes a report of ``ev`` about ``generation``.

        Returns:
            The recovery level to report (see :func:`recovery_level`).
        """
        level = recovery_level(ev)
        with self._lock:
            self._last = (generation, level, ev)
        return level

    def covers(self, ev: HealthEvent, generation: int) -> bool:
        """Whether a report of ``ev``'s level, or higher, already went out for ``generation``."""
        with self._lock:
            last = self._last
        return last is not None and last[0] == generation and last[1] >= recovery_level(ev)

    def reported_since(self, generation: int) -> int | None:
        """The generation of the last report if it is ``generation`` or later, else None."""
        with self._lock:
            last = self._last
        return last[0] if last is not None and last[0] >= generation else None

    def cause(self, generation: int) -> HealthEvent | None:
        """The event reported for ``generation``, if the last report was about it."""
        with self._lock:
            last = self._last
        return last[2] if last is not None and last[0] == generation else None


def hardware_cause(runner: Any, names: Sequence[str], pending: Callable[[], Sequence[HealthEvent]],
                   ledger: NodeReportLedger, generation: int, node_id: str,
                   wait_s: float = HARDWARE_SAMPLE_WAIT_S) -> HealthEvent | None:
    """The node-level hardware event explaining a worker failure of ``generation`` now, if there is one.

    Args:
        runner: the agent's :class:`~trainguard.detectors.runner.DetectorRunner`.
        names: the hardware detectors (see :func:`hardware_detector_names`); empty: returns None at once.
        pending: returns the detector events the agent has not handled yet (called after the sample).
        ledger: the agent's report ledger.
        generation: generation of the failed worker.
        node_id: stamped on an active condition's event.
        wait_s: seconds to wait at most for the out-of-schedule sample.

    Returns:
        The most severe node-level event (action DRAIN_NODE or more) of a hardware detector, or None.
    """
    if runner is None or not names:
        return None
    t0 = time.monotonic()
    if runner.sample_now(names, timeout_s=wait_s) is None:
        log.warning("hardware detectors %s did not finish a sample within %.1f s; judging the failure on what "
                    "they reported before", ",".join(names), wait_s)
    log.debug("out-of-schedule hardware sample took %.0f ms", (time.monotonic() - t0) * 1000)

    def node_level(ev: HealthEvent) -> bool:
        return ev.source in names and ev.action >= Action.DRAIN_NODE

    def worst(events: Iterable[HealthEvent]) -> HealthEvent | None:
        return max((ev for ev in events if node_level(ev)), key=lambda ev: (ev.action, ev.severity), default=None)

    found = worst(pending())
    if found is not None:
        return found
    for status in runner.statuses():
        found = worst(status.conditions)
        if found is not None:
            return found if found.node_id else found.with_node(node_id)
    reported = ledger.cause(generation)
    return reported if reported is not None and node_level(reported) else None
