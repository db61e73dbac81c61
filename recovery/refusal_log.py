"""A log of refused gRPC calls (the coordinator's, and every token check's), at most one line per kind and window.

Every refused call used to log a WARNING. A node refused for a lasting reason (a stale lease, a fenced coordinator,
a store that is down) is refused again at every heartbeat, so one fault made a line per node every two seconds: at
a thousand nodes, hundreds of lines a second, and the first line, the one that says what happened, scrolled away.
Now the first refusal of a kind (method, status code, cause: an error class, a missing token) is logged at once,
later ones of that kind within :data:`WINDOW_S` are counted (each still at DEBUG), and the next one logged after
the window says how many were left out. The kinds are few (methods x codes x causes), so the table stays small.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds during which further refusals of one kind are counted instead of logged.
WINDOW_S = 30.0


@dataclass
class _Kind:
    since: float  # when the last logged refusal of this kind was logged
    left_out: int = 0


class RefusalLog:
    """Logs refused calls, the first of each kind at WARNING and then at most one per ``window_s``.

    Args:
        logger: where the lines go.
        window_s: the window, seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, logger: logging.Logger, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: dict[tuple[str, str, str], _Kind] = {}

    def refused(self, method: str, code: str, cause: str, message: str) -> None:
        """Records one refused call of ``method``, answered with status ``code`` because of ``cause`` (an error
        class, a missing token: what makes two refusals the same kind), logging ``message`` (the whole line)."""
        key = (method, code, cause)
        now = self._clock()
        with self._lock:
            kind = self._kinds.get(key)
            if kind is not None and now - kind.since < self._window_s:
                kind.left_out += 1
                left_out = -1
            else:
                left_out = kind.left_out if kind is not None else 0
                span = now - kind.since if kind is not None else 0.0
                self._kinds[key] = _Kind(since=now)
        if left_out < 0:
            self._log.debug("%s", message)
            return
        more = (f" ({left_out} more {method} call(s) refused with {code} for {cause} in the {span:.0f} s before, "
                "not logged)") if left_out else ""
        self._log.warning("%s%s", message, more)
