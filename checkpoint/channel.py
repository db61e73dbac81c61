"""How a Checkpointer hands snapshots to the persist process.

:class:`PersistChannel` is the contract. :class:`InlineChannel` persists in the calling thread (used when
``persist.service = "inline"``, by tests of the format and by tools). The service channel (see
:mod:`.service`) talks to a long-lived persist process over a unix socket; only small JSON requests travel,
tensors stay in shared memory.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

from trainguard.checkpoint.config import CheckpointConfig

Report = Callable[[dict[str, Any]], None]


class PersistChannel(ABC):
    """Delivers persist requests; outcomes come back through the ``report`` callback given at creation."""

    #: True when closing the channel ends the arena's owner, so the Checkpointer removes the arena itself.
    owns_memory: bool = True

    @abstractmethod
    def submit(self, request: dict[str, Any]) -> None:
        """Queues a persist request (see :mod:`.persist`).

        Raises:
            CheckpointError: the persist process cannot be reached.
        """

    @abstractmethod
    def alive(self) -> bool:
        """False once the persist process is gone (pending requests will never report)."""

    @abstractmethod
    def close(self) -> None:
        """Flushes queued requests and releases the channel; idempotent."""


class InlineChannel(PersistChannel):
    """Persists synchronously in the caller's thread (no background process), the remote upload included.

    An unreachable remote is backed off as in the persist process (see
    :class:`~trainguard.checkpoint.uploads.InlineUploads`): a save does not dial it while it backs off, so the
    caller waits out the connect timeout once per back-off period, not in every save; :meth:`close` uploads the
    newest step skipped meanwhile when the back-off is over by then.
    """

    def __init__(self, report: Report) -> None:
        from trainguard.checkpoint.uploads import InlineUploads

        self.report = report
        self._lock = threading.Lock()
        self._uploads = InlineUploads()

    def submit(self, request: dict[str, Any]) -> None:
        from trainguard.checkpoint.persist import persist_snapshot

        with self._lock:
            persist_snapshot(request, self.report, self._uploads)

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            self._uploads.finish()


INLINE = "inline"


def open_channel(config: CheckpointConfig, job: str, rank: int, report: Report) -> PersistChannel:
    """Opens the channel the configuration asks for.

    ``persist.service == "inline"`` persists in-process; a socket path (or ``$TRAINGUARD_CHECKPOINT_SERVICE``)
    connects to a running checkpoint service; otherwise a private persist process is started.

    Raises:
        CheckpointError: the service cannot be reached or started.
    """
    import os

    from trainguard.checkpoint.config import CHECKPOINT_SERVICE_ENV

    address = config.persist.service or os.environ.get(CHECKPOINT_SERVICE_ENV)
    if address == INLINE:
        return InlineChannel(report)
    from trainguard.checkpoint.service import ServiceChannel

    return ServiceChannel.connect_or_spawn(address, config, job, rank, report)
