"""Keeps a node's coordinator lease alive while the agent's loop is busy with a slow, synchronous step.

The agent renews its lease from its main loop; a step that blocks that loop for longer than the lease (starting
the detectors and the predictor, which import their libraries; spawning a generation's workers) loses the lease,
and a node that holds ranks is then declared lost and replaced, taking a spare it never needed. On a loaded
machine this happens: with 8 CPU burners on 2 cores the replace drill's agents went 3.2-3.4 s without a
heartbeat right after registering (lease 3 s) while their detectors started and torch was imported in the
background, and the coordinator gave n0's slot to the spare at start-up, leaving none for the straggler later.

:func:`keep_lease` runs the agent's keep-alive (a heartbeat when one is due; the reply's commands are left to
the loop, which gets them again) on a helper thread for the duration of such a step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def keep_lease(tick: Callable[[], None], interval_s: float, what: str = "") -> Iterator[None]:
    """Calls ``tick()`` every ``interval_s`` seconds on a helper thread until the block ends.

    Args:
        tick: the keep-alive (it must itself skip a heartbeat that is not due, and never raise for an
            unreachable coordinator; anything it raises is logged and the thread goes on).
        interval_s: seconds between two calls (the heartbeat interval).
        what: the step, for the thread's name and the log.
    """
    stop = threading.Event()
    period = max(0.05, interval_s)

    def run() -> None:
        while not stop.wait(period):
            try:
                tick()
            except Exception as exc:  # noqa: BLE001 - a keep-alive must never end the step it guards
                log.debug("keep-alive during %s failed: %s", what or "a slow step", exc)

    t = threading.Thread(target=run, name=f"lease-keeper-{what or 'step'}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5.0)
