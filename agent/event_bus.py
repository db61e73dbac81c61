"""A small in-process publish/subscribe hub for health events, with a ring of recent ones.

Detectors, the worker supervisor and the predictor publish; the gRPC ``WatchEvents`` streams, the metrics and
the coordinator client subscribe. A slow subscriber never blocks a publisher: its queue is bounded and the
oldest events are dropped (and counted) when it falls behind.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable

from trainguard.detectors.events import HealthEvent


class Subscription:
    """One subscriber's bounded queue.

    Attributes:
        dropped: events dropped because the subscriber fell behind.
    """

    def __init__(self, bus: "EventBus", maxsize: int) -> None:
        self._bus = bus
        self._q: queue.Queue[HealthEvent] = queue.Queue(maxsize=maxsize)
        self.dropped = 0

    def _offer(self, event: HealthEvent) -> None:
        while True:
            try:
                self._q.put_nowait(event)
                return
            except queue.Full:
                try:
                    self._q.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def get(self, timeout: float | None = None) -> HealthEvent | None:
        """Next event, or None after ``timeout`` seconds."""
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stops receiving events."""
        self._bus._unsubscribe(self)


class EventBus:
    """Fan-out of health events to subscribers and callbacks.

    Args:
        recent: how many recent events to keep for replay.
    """

    def __init__(self, recent: int = 256) -> None:
        self._lock = threading.Lock()
        self._recent: collections.deque[HealthEvent] = collections.deque(maxlen=recent)
        self._subs: list[Subscription] = []
        self._callbacks: list[Callable[[HealthEvent], None]] = []
        self.published = collections.Counter()

    def publish(self, event: HealthEvent) -> None:
        """Delivers ``event`` to every subscriber and callback; callback errors are swallowed (never raise)."""
        with self._lock:
            self._recent.append(event)
            self.published[event.kind] += 1
            subs = list(self._subs)
            callbacks = list(self._callbacks)
        for s in subs:
            s._offer(event)
        for cb in callbacks:
            try:
                cb(event)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the others
                import logging

                logging.getLogger(__name__).exception("event callback %r failed", cb)

    def subscribe(self, maxsize: int = 1024) -> Subscription:
        """A new subscription receiving events published from now on."""
        s = Subscription(self, maxsize)
        with self._lock:
            self._subs.append(s)
        return s

    def add_callback(self, cb: Callable[[HealthEvent], None]) -> None:
        """Calls ``cb(event)`` synchronously for every published event."""
        with self._lock:
            self._callbacks.append(cb)

    def _unsubscribe(self, s: Subscription) -> None:
        with self._lock:
            if s in self._subs:
                self._subs.remove(s)

    def recent(self, n: int) -> list[HealthEvent]:
        """The last ``n`` events, oldest first."""
        with self._lock:
            return list(self._recent)[-n:] if n > 0 else []
