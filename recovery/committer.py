"""Group commit: many concurrent writers, few durable store commits.

A durable store commit costs an fsync (SQLite, file) or a Raft round (etcd): a few milliseconds. When 12,500
node agents register at once, one commit each would take a minute. Writers instead :meth:`GroupCommitter.submit`
their puts and wait on the returned future; one thread drains everything queued so far into as few commits as
the store allows (``max_ops_per_commit``) and resolves the futures. Order is preserved: a batch submitted
after another is never durable before it, so a generation record is never on disk before the node records it
names.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from trainguard.recovery.errors import StoreError
from trainguard.recovery.store import CommitResult, Put, Store

log = logging.getLogger(__name__)

#: Seconds during which further failed commits of one kind are counted instead of logged (as refusals are: see
#: :mod:`~trainguard.recovery.refusal_log`).
FAIL_WINDOW_S = 30.0


class GroupCommitter:
    """Batches unconditional puts from many threads into few commits of one (usually fenced) store.

    Args:
        store: where to commit; a :class:`~trainguard.recovery.store.FencedStore` makes every batch fenced.
        max_batch: most puts per commit (capped by the store's ``max_ops_per_commit``); a batch also stops at the
            store's ``max_bytes_per_commit``.
        clock: monotonic seconds, for the failure log's window (tests pass their own).
    """

    def __init__(self, store: Store, max_batch: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._max = max(1, min(max_batch, store.max_ops_per_commit))
        self._max_bytes = store.max_bytes_per_commit  # closes a batch too (see _run)
        self._cond = threading.Condition()
        self._queue: list[tuple[list[Put], Future[CommitResult]]] = []
        self._closed = False
        self.commits = 0  # number of store commits made (for benchmarks and tests)
        self._clock = clock
        # The failing run of commits (see _failed): its first failure's time, the kind last logged and when,
        # failures since not logged, and failures in all.
        self._failing_since: float | None = None
        self._fail_kind = ""
        self._fail_said = 0.0
        self._fail_left_out = 0
        self._fail_count = 0
        self._thread = threading.Thread(target=self._run, name="trainguard-group-commit", daemon=True)
        self._thread.start()

    def submit(self, puts: Sequence[Put]) -> "Future[CommitResult]":
        """Queues puts for the next commit.

        Args:
            puts: writes (and deletes); kept together in one commit when they fit. Empty: the future tells only
                whether the store's preconditions (a fenced store's fence) still hold.

        Returns:
            A future resolved with the commit result once durable, or with the store's exception.

        Raises:
            StoreError: the committer is closed.
        """
        fut: Future[CommitResult] = Future()
        with self._cond:
            if self._closed:
                raise StoreError("the coordinator's store committer is closed: the coordinator is stopping")
            self._queue.append((list(puts), fut))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                batch: list[tuple[list[Put], Future[CommitResult]]] = []
                n = size = 0
                # Bounded by bytes too: a burst of registrations of nodes with many labels (~17 KB a record) was
                # one etcd transaction of ~2 MB, refused whole ("request is too large"), and so were its retries.
                while self._queue and (not batch or (n + len(self._queue[0][0]) <= self._max
                                                     and size + _size(self._queue[0][0]) <= self._max_bytes)):
                    item = self._queue.pop(0)
                    batch.append(item)
                    n += len(item[0])
                    size += _size(item[0])
            puts = [p for ps, _ in batch for p in ps]
            try:
                res = self._store.commit([], puts)  # no puts: a fenced store still checks its fence
                self.commits += 1
            except BaseException as exc:  # noqa: BLE001 - every waiter must learn about the failure
                self._failed(len(puts), exc)
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            if self._failing_since is not None:
                log.info("store commits succeed again after %d failed commit(s) over %.0f s",
                         self._fail_count, self._clock() - self._failing_since)
                self._failing_since = None
            for _, fut in batch:
                fut.set_result(res)

    def _failed(self, n: int, exc: BaseException) -> None:
        """Logs a failed commit: the first of a kind (exception class) at once at ERROR, the others within
        :data:`FAIL_WINDOW_S` at DEBUG, counted in the next line logged after the window (a WARNING).

        Why: a lasting failure (a full filesystem) fails the commit of every retried registration and heartbeat
        write, so one fault logged an ERROR several times a second, more with more nodes, and buried the first.
        """
        now, kind = self._clock(), type(exc).__name__
        if self._failing_since is None:
            self._failing_since, self._fail_count, self._fail_kind = now, 0, ""
        self._fail_count += 1
        if kind == self._fail_kind and now - self._fail_said < FAIL_WINDOW_S:
            self._fail_left_out += 1
            log.debug("store commit of %d writes failed: %s", n, exc)
            return
        if kind != self._fail_kind:
            self._fail_kind, self._fail_said, self._fail_left_out = kind, now, 0
            log.error("store commit of %d writes failed: %s", n, exc)
            return
        left_out, span = self._fail_left_out, now - self._fail_said
        self._fail_said, self._fail_left_out = now, 0
        log.warning("store commit of %d writes failed: %s (%d more failed commit(s) in the %.0f s before, not "
                    "logged; the store still refuses writes)", n, exc, left_out, span)

    def close(self) -> None:
        """Commits what is queued, then stops the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)


def _size(puts: Sequence[Put]) -> int:
    """Bytes of keys and values a submission carries (what a store's request limit counts)."""
    return sum(len(p.key) + (len(p.value) if p.value is not None else 0) for p in puts)
