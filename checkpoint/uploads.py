"""The persist process's remote uploads, off the path that frees staging slots.

An upload reads the step's local-disk copy, not its staging slot, so the slot is handed back as soon as the
memory and disk tiers are done. Uploads then run on one thread of their own: a remote that is slow, or hung
(an endpoint that accepts connections and never answers: s3fs retries its read timeouts for minutes), delays
only the remote tier. Before this, every slot waited for its upload and a hung remote stopped ``save()`` and
training with it.

Newest wins: for each (job, rank, remote URL) at most one upload waits. A newer step replacing one that has not
started drops it, reported as a failed remote outcome saying so: a remote slower than the save interval holds
the newest steps it can take, and the queue never grows with the backlog.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)


class UploadQueue:
    """One upload thread; per key, the newest waiting upload only.

    Each entry is ``(step, run, drop)``: ``run()`` uploads (and reports its outcome); ``drop(newer_step)``
    reports that the entry was superseded before it started. Neither may raise (exceptions are logged).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[Hashable, tuple[int, Callable[[], None], Callable[[int], None]]] = {}
        self._running: dict[Hashable, int] = {}  # key -> step being uploaded
        self._thread: threading.Thread | None = None

    def put(self, key: Hashable, step: int, run: Callable[[], None], drop: Callable[[int], None]) -> None:
        """Queues the upload of ``step`` under ``key``, dropping a waiting older one of the same key."""
        with self._cond:
            old = self._pending.pop(key, None)
            self._pending[key] = (step, run, drop)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="persist-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if old is not None:
            _safely(lambda: old[2](step), "dropping a superseded upload")

    def idle(self) -> bool:
        """True when nothing waits and nothing runs."""
        with self._cond:
            return not self._pending and not self._running

    def steps_of(self, job: object) -> set[int]:
        """Steps of ``job`` waiting for or in upload (keys start with the job): the disk tier keeps them, as
        their uploads read its copies."""
        with self._cond:
            return ({step for key, (step, _r, _d) in self._pending.items() if _job_of(key) == job}
                    | {step for key, step in self._running.items() if _job_of(key) == job})

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until :meth:`idle` (or ``timeout`` seconds); returns whether it is idle."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._running, timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                key = next(iter(self._pending))  # oldest key first: keys take turns
                step, run, _drop = self._pending.pop(key)
                self._running[key] = step
            try:
                _safely(run, "an upload")
            finally:
                with self._cond:
                    del self._running[key]
                    self._cond.notify_all()


def _job_of(key: Hashable) -> object:
    return key[0] if isinstance(key, tuple) and key else None


def _safely(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - one bad upload must not end the upload thread
        log.exception("persist process: %s failed", what)


__all__ = ["UploadQueue"]
