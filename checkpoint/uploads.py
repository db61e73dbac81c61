"""The persist process's remote uploads, off the path that frees staging slots.

An upload reads the step's local-disk copy, not its staging slot, so the slot is handed back as soon as the
memory and disk tiers are done. Uploads then run on one thread of their own: a remote that is slow, or hung
(an endpoint that accepts connections and never answers: s3fs retries its read timeouts for minutes), delays
only the remote tier. Before this, every slot waited for its upload and a hung remote stopped ``save()`` and
training with it.

Newest wins: for each (job, rank, remote URL) at most one upload waits. A newer step replacing one that has not
started drops it, reported as a failed remote outcome saying so: a remote slower than the save interval holds
the newest steps it can take, and the queue never grows with the backlog.

Back-off: an upload that cannot reach its remote (connection refused or reset, a connect or read timeout, an
unknown or unreachable host) marks that remote URL down for ``remote.retry_s`` seconds, doubled at each failure
in a row up to :data:`REMOTE_BACKOFF_CAP` times (the listings' back-off in the Checkpointer). While it is down an
upload is not dialed: the step is reported as not uploaded at once, quietly (one health event per outage, from
the failure that began it, not one per step; and one for each other rank the service uploads for, at its first
skipped step, since each rank's Session.errors and log are its own), and the newest such step of each rank is
kept aside. When the back-off is over that step is uploaded, so the remote catches up with the newest durable
step once it answers again (older skipped steps are not). Before, each save against a dead remote waited out the
connect timeout in the upload thread and sent its own health event.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


#: an unreachable remote's back-off grows up to this many times ``remote.retry_s`` (uploads and listings)
REMOTE_BACKOFF_CAP = 10

#: ``run()`` of an entry returns this when the remote could not be reached (anything else: it answered).
UNREACHABLE = "unreachable"


@dataclass
class _Entry:
    step: int
    run: Callable[[bool], object]
    drop: Callable[[int], None]
    #: reports the step as not uploaded because its remote is backing off (its arguments: seconds to the retry,
    #: and whether this is the first its rank hears of the outage: then it is reported as the outage, not quietly)
    defer: Callable[[float, bool], None] | None = None
    #: the upload to run once the back-off is over (it reports as a catch-up: the step was reported already)
    catch_up: Callable[[bool], object] | None = None
    remote: Hashable = None
    retry_s: float = 30.0
    #: order of the saves: the catch-up kept for a key is the latest save's, not the highest step's (a job that
    #: went back during an outage saves a lower step, and the higher one's disk copy is gone by then)
    seq: int = field(default_factory=lambda: next(_SEQ))


_SEQ = itertools.count()


@dataclass
class _Outage:
    retry_at: float  # monotonic time of the next try
    backoff: float
    parked: dict[Hashable, _Entry] = field(default_factory=dict)  # per key: the newest step to upload then
    #: keys (ranks) told of this outage: each rank's Session.errors and log shows it once, not only the rank
    #: whose upload found it first (a service shared by the node's ranks)
    told: set[Hashable] = field(default_factory=set)


class UploadQueue:
    """One upload thread; per key, the newest waiting upload only; per remote, a back-off while unreachable.

    Each entry is ``(step, run, drop)``: ``run(ongoing)`` uploads (and reports its outcome), returning
    :data:`UNREACHABLE` when the remote could not be reached (``ongoing``: it was unreachable already, so a
    failure is the same outage going on and says nothing new); ``drop(newer_step)`` reports that the entry was
    superseded before it started. With ``defer``, ``catch_up`` and ``remote``, an entry whose remote is backing
    off is not run: ``defer(seconds_to_retry, first)`` reports that (``first``: its key had not heard of the
    outage), and ``catch_up()`` runs once the back-off is over
    (for the newest such step of the key; also after a run found the remote unreachable), as ``catch_up(ongoing)``.
    None of them may raise (exceptions are logged).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[Hashable, _Entry] = {}
        self._running: dict[Hashable, int] = {}  # key -> step being uploaded
        self._down: dict[Hashable, _Outage] = {}  # remote -> its outage
        self._thread: threading.Thread | None = None

    def put(self, key: Hashable, step: int, run: Callable[[bool], object], drop: Callable[[int], None],
            defer: Callable[[float, bool], None] | None = None, catch_up: Callable[[bool], object] | None = None,
            remote: Hashable = None, retry_s: float = 30.0, down_for: float = 0.0, backoff: float = 0.0) -> None:
        """Queues the upload of ``step`` under ``key``, dropping a waiting older one of the same key.

        Args:
            key: uploads of one key replace each other while waiting (job, rank, remote URL).
            step: the step.
            run: the upload; returns :data:`UNREACHABLE` when the remote could not be reached.
            drop: reports that a newer step replaced this one before it started.
            defer: reports that the remote is backing off (see the class), as ``defer(seconds_to_retry, first)``:
                ``first`` when this key was not told of the outage yet (another key's upload found it
                unreachable); None: always run.
            catch_up: the upload of this step once the remote's back-off is over.
            remote: what the back-off applies to (the remote URL).
            retry_s: the first back-off after a failure to reach ``remote``, seconds.
            down_for: the caller knows ``remote`` unreachable for this many more seconds (the worker's listing
                found it so), with its current back-off ``backoff``: not dialed before.
        """
        with self._cond:
            if down_for > 0 and remote is not None:
                o = self._down.get(remote)
                if o is None:
                    self._down[remote] = o = _Outage(time.monotonic() + down_for, backoff or retry_s)
                elif o.retry_at < time.monotonic() + down_for and not o.parked:
                    o.retry_at, o.backoff = time.monotonic() + down_for, max(o.backoff, backoff)
                o.told.add(key)  # the worker found it down itself, and said so
            old = self._pending.pop(key, None)
            self._pending[key] = _Entry(step, run, drop, defer, catch_up, remote, retry_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="persist-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if old is not None:
            _safely(lambda: old.drop(step), "dropping a superseded upload")

    def idle(self) -> bool:
        """True when nothing waits and nothing runs (a catch-up waiting for a backing-off remote does not count:
        a drain or an exit must not wait for an outage to end)."""
        with self._cond:
            return not self._pending and not self._running

    def steps_of(self, job: object) -> set[int]:
        """Steps of ``job`` waiting for or in upload (keys start with the job), catch-ups included: the disk tier
        keeps them, as their uploads read its copies."""
        with self._cond:
            parked = [(key, e.step) for o in self._down.values() for key, e in o.parked.items()]
            return ({e.step for key, e in self._pending.items() if _job_of(key) == job}
                    | {step for key, step in self._running.items() if _job_of(key) == job}
                    | {step for key, step in parked if _job_of(key) == job})

    def backing_off(self, remote: Hashable) -> float:
        """Seconds until ``remote`` is tried again; 0 when it is not backing off."""
        with self._cond:
            o = self._down.get(remote)
            return max(0.0, o.retry_at - time.monotonic()) if o is not None else 0.0

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until :meth:`idle` (or ``timeout`` seconds); returns whether it is idle."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._running, timeout)

    def _next(self) -> tuple[Hashable, _Entry] | None:
        """The next entry to run, parking those whose remote backs off; None when nothing is due. Caller holds
        the lock; the ``defer`` callbacks it collects run after it is released."""
        now = time.monotonic()
        for remote, o in list(self._down.items()):
            if o.parked and now >= o.retry_at:
                for key, e in o.parked.items():  # due: tried again (a newer pending step of the key wins)
                    self._pending.setdefault(key, e)
                o.parked.clear()
        if not self._pending:
            return None
        key = next(iter(self._pending))  # oldest key first: keys take turns
        return key, self._pending.pop(key)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    item = self._next()
                    if item is not None:
                        break
                    due = [o.retry_at for o in self._down.values() if o.parked]
                    self._cond.wait(max(0.0, min(due) - time.monotonic()) + 0.01 if due else None)
                key, e = item
                o = self._down.get(e.remote) if e.defer is not None else None
                wait_s = o.retry_at - time.monotonic() if o is not None else 0.0
                # Ongoing for this key only when its rank was told already: another rank's failure began it.
                od = self._down.get(e.remote) if e.remote is not None else None
                ongoing = od is not None and key in od.told
                if wait_s <= 0:
                    self._running[key] = e.step
                elif o is not None:
                    o.told.add(key)
            if wait_s > 0:
                # Backing off: not dialed; reported at once, and the newest step kept for the catch-up.
                assert e.defer is not None and o is not None
                defer = e.defer
                _safely(lambda: defer(wait_s, not ongoing), "reporting a deferred upload")
                with self._cond:
                    self._park(o, key, e)
                    self._cond.notify_all()
                continue
            result: list[object] = [None]
            try:
                _safely(lambda: result.__setitem__(0, e.run(ongoing)), "an upload")
            finally:
                with self._cond:
                    del self._running[key]
                    if e.remote is not None:
                        self._after(key, e, result[0] == UNREACHABLE)
                    self._cond.notify_all()

    @staticmethod
    def _park(o: _Outage, key: Hashable, e: _Entry) -> None:
        """Keeps ``e``'s catch-up for the end of the outage, replacing an older step's of the same key."""
        if e.catch_up is None and e.defer is not None:
            return  # nothing to catch up with
        old = o.parked.get(key)
        if old is None or old.seq <= e.seq:
            # A catch-up entry runs itself again; a first run parks its catch-up.
            run = e.catch_up if e.catch_up is not None else e.run
            o.parked[key] = _Entry(e.step, run, e.drop, None, None, e.remote, e.retry_s, e.seq)

    def _after(self, key: Hashable, e: _Entry, unreachable: bool) -> None:
        """Updates ``e.remote``'s outage after an upload to it. Caller holds the lock."""
        o = self._down.get(e.remote)
        if not unreachable:
            if o is not None:
                del self._down[e.remote]
                log.info("remote %s answers again", e.remote)
                for k, parked in o.parked.items():  # other ranks' catch-ups, and a later save's: due now
                    if k != key or parked.seq > e.seq:
                        self._pending.setdefault(k, parked)
            return
        o = _failed_again(self._down, e)
        o.told.add(key)  # its failure said it (or was quiet because it had been said)
        if key not in self._pending:  # a newer step waiting would be the catch-up itself
            self._park(o, key, e)
        log.info("remote %s unreachable: uploads are not dialed for %g s", e.remote, o.backoff)


def _failed_again(down: dict[Hashable, _Outage], e: _Entry) -> _Outage:
    """The outage of ``e.remote`` after an upload found it unreachable: begun with ``e.retry_s``, or its back-off
    doubled (at most :data:`REMOTE_BACKOFF_CAP` times ``retry_s``); the next dial is that far off."""
    o = down.get(e.remote)
    if o is None:
        down[e.remote] = o = _Outage(0.0, e.retry_s)
    else:
        o.backoff = min(o.backoff * 2, e.retry_s * REMOTE_BACKOFF_CAP)
    o.retry_at = time.monotonic() + o.backoff
    return o


class InlineUploads:
    """The upload back-off of :class:`UploadQueue` without its thread, for ``persist.service = "inline"``: the
    upload runs in the caller's thread (the training step's ``save()``), before ``put`` returns.

    Before, each inline save against an unreachable remote dialed it and blocked the step for the connect timeout,
    and each sent its own health event. Now, as in the queue: a failure to reach the remote marks it down for
    ``retry_s`` (doubling per failure in a row, up to :data:`REMOTE_BACKOFF_CAP` times); while it is down an upload
    is not dialed (``defer`` reports it, quietly); the newest skipped step of each key is kept aside. There is no
    thread to catch up on its own: the next save after the back-off uploads its own, newer step (the skipped one
    is superseded), and :meth:`finish` (the channel's close) uploads the skipped step when the back-off is over by
    then, so a job whose last saves fell into an outage still leaves its newest step on the remote. Each dial
    still costs the caller up to the connect timeout: once per back-off period, not once per save.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[Hashable, _Outage] = {}

    def put(self, key: Hashable, step: int, run: Callable[[bool], object], drop: Callable[[int], None],
            defer: Callable[[float, bool], None] | None = None, catch_up: Callable[[bool], object] | None = None,
            remote: Hashable = None, retry_s: float = 30.0, down_for: float = 0.0, backoff: float = 0.0) -> None:
        """Uploads ``step`` now, or defers it while ``remote`` backs off (arguments as :meth:`UploadQueue.put`;
        ``drop`` is not called: nothing waits to be superseded)."""
        e = _Entry(step, run, drop, defer, catch_up, remote, retry_s)
        with self._lock:
            now = time.monotonic()
            o = self._down.get(remote) if remote is not None else None
            if down_for > 0 and remote is not None:
                if o is None:  # the worker's listing (or its constructor's probe) found it unreachable
                    self._down[remote] = o = _Outage(now + down_for, backoff or retry_s)
                elif o.retry_at < now + down_for and not o.parked:
                    o.retry_at, o.backoff = now + down_for, max(o.backoff, backoff)
            wait_s = o.retry_at - now if o is not None and defer is not None else 0.0
            if wait_s > 0:
                UploadQueue._park(o, key, e)
            elif o is not None:
                o.parked.pop(key, None)  # this newer step is the catch-up
            ongoing = o is not None
        if wait_s > 0:
            assert defer is not None
            _safely(lambda: defer(wait_s, False), "reporting a deferred upload")  # this rank was told: quiet
            return
        result: list[object] = [None]
        _safely(lambda: result.__setitem__(0, run(ongoing)), "an upload")
        if remote is not None:
            with self._lock:
                self._after(key, e, result[0] == UNREACHABLE)

    def _after(self, key: Hashable, e: _Entry, unreachable: bool) -> None:
        """Updates ``e.remote``'s outage after an upload to it. Caller holds the lock."""
        o = self._down.get(e.remote)
        if not unreachable:
            if o is not None:
                del self._down[e.remote]
                log.info("remote %s answers again", e.remote)
            return
        o = _failed_again(self._down, e)
        UploadQueue._park(o, key, e)
        log.info("remote %s unreachable: uploads are not dialed for %g s", e.remote, o.backoff)

    def backing_off(self, remote: Hashable) -> float:
        """Seconds until ``remote`` is dialed again; 0 when it is not backing off."""
        with self._lock:
            o = self._down.get(remote)
            return max(0.0, o.retry_at - time.monotonic()) if o is not None else 0.0

    def steps_of(self, job: object) -> set[int]:
        """Skipped steps of ``job`` kept for a catch-up: the disk tier keeps them, as the upload reads its copy."""
        with self._lock:
            return {e.step for o in self._down.values() for key, e in o.parked.items() if _job_of(key) == job}

    def finish(self) -> None:
        """Uploads the newest skipped step of each key whose remote's back-off is over (one dial each; a remote
        still backing off is not waited for: its skipped step stays on the local tiers only)."""
        with self._lock:
            now = time.monotonic()
            due = [(key, e) for o in self._down.values() if now >= o.retry_at for key, e in o.parked.items()]
            waiting = [(key, e.step, o.retry_at - now) for o in self._down.values() if now < o.retry_at
                       for key, e in o.parked.items()]
            for o in self._down.values():
                if now >= o.retry_at:
                    o.parked.clear()
        for key, step, left in waiting:
            log.warning("step %d (%s) was not uploaded: its remote is still backing off for %.1f s after failing "
                        "to answer; it stays on the local tiers", step, key, left)
        for key, e in due:
            result: list[object] = [None]
            run = e.run
            _safely(lambda: result.__setitem__(0, run(True)), "a catch-up upload")
            with self._lock:
                if result[0] != UNREACHABLE:
                    self._down.pop(e.remote, None)


def _job_of(key: Hashable) -> object:
    return key[0] if isinstance(key, tuple) and key else None


def _safely(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - one bad upload must not end the upload thread
        log.exception("persist process: %s failed", what)


__all__ = ["REMOTE_BACKOFF_CAP", "UNREACHABLE", "InlineUploads", "UploadQueue"]
