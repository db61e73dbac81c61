"""The workers' TCP store of one generation, hosted by the agent of rank 0's node (torchrun's agent store).

When rank 0 hosts the store itself, every other rank that reaches ``init_process_group`` first finds nothing
listening and retries with a growing backoff; after a restart, rank 0 is a fresh process that first has to
import torch, so the other ranks sit in that backoff for seconds. Hosting it in the agent before the workers
start removes the wait: every worker connects at once (``TORCHELASTIC_USE_AGENT_STORE=True`` makes all ranks
clients, exactly as under torchrun).

Each generation gets a new store on the new ``MASTER_PORT`` of its rank table and the previous one is closed
first, so nothing of an older generation can be read by a newer one (the cause of the hangs in pytorch#135712
was a store shared across restarts).

torch is imported in the agent only for this, in a background thread started with the agent
(:func:`preload`). The first generation does not wait for it: if the import is still running when its workers
start, the store comes up from that thread as soon as the import is done, and the workers, importing torch
themselves meanwhile, connect with the client's usual retries.

Those threads must not outlive the launcher: a job that ended before the import did (a short job, or a launcher
slowed by a loaded host) left a daemon thread inside torch's import while the interpreter finalised. CPython
before 3.14 ends such a thread with ``pthread_exit`` when it next takes the GIL; the forced unwind through
torch's C++ frames then aborted the process (``terminate called without an active exception``, exit -6) after
the job had succeeded. The console entry (:func:`trainguard.cli.entry`) exits without finalising while
:func:`busy`; an in-process caller that must not leave the thread running waits with :func:`settle`.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

log = logging.getLogger(__name__)

_import_done = threading.Event()
_import_error: list[BaseException] = []
_threads: list[threading.Thread] = []  # the import and any pending listen: joined by settle()
_threads_lock = threading.Lock()


def _start(target: Callable[[], None], name: str) -> None:
    t = threading.Thread(target=target, name=name, daemon=True)
    with _threads_lock:
        _threads[:] = [x for x in _threads if x.is_alive()]
        _threads.append(t)
    t.start()


def busy() -> bool:
    """True while the background import or a pending store start still runs."""
    with _threads_lock:
        return any(t.is_alive() for t in _threads)


def settle(timeout_s: float = 60.0) -> bool:
    """Waits up to ``timeout_s`` for the background import and any pending store start to finish.

    Returns:
        True when none is left running (the process may then exit safely); False when one still runs.
    """
    deadline = time.monotonic() + timeout_s
    with _threads_lock:
        pending = list(_threads)
    for t in pending:
        t.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in pending if t.is_alive()]
    if left:
        log.warning("background thread(s) %s still running after %.0f s; exiting anyway", ", ".join(left),
                    timeout_s)
    return not left


def preload() -> None:
    """Starts importing the store implementation in a background thread (idempotent)."""
    if _import_done.is_set() or getattr(preload, "_started", False):
        return
    preload._started = True  # type: ignore[attr-defined]

    def work() -> None:
        try:
            importlib.import_module("torch.distributed")
        except BaseException as exc:  # noqa: BLE001 - reported when a store is needed
            _import_error.append(exc)
        finally:
            _import_done.set()

    _start(work, "store-import")


class StoreHostError(RuntimeError):
    """The agent could not host the generation's store (port taken, torch missing)."""


class GenerationStore:
    """A TCPStore server for one generation's workers.

    Args:
        port: the generation's ``MASTER_PORT``.
        world_size: ranks that will connect (informational; the server does not wait for them).
    """

    def __init__(self, port: int, world_size: int) -> None:
        self.port = port
        self.world_size = world_size
        self._store = None
        self._closed = False
        # A start from the background thread and a close from the agent can cross: without the lock a store
        # created just after close() stayed up (its port and server thread) until the process exited.
        self._lock = threading.Lock()

    def start(self, timeout_s: float = 60.0) -> GenerationStore:
        """Listens on ``port`` (every interface, as torch's TCPStore server does).

        Raises:
            StoreHostError: torch is unusable or the port cannot be bound.
        """
        preload()
        _import_done.wait(timeout_s)
        return self._listen(timeout_s)

    def start_soon(self, on_error, timeout_s: float = 120.0) -> GenerationStore:
        """Listens now if torch is imported, else from a thread once it is; ``on_error(exc)`` is called (from
        that thread) when hosting fails there.

        Raises:
            StoreHostError: hosting failed right away.
        """
        preload()
        if _import_done.is_set():
            return self._listen(timeout_s)

        def later() -> None:
            _import_done.wait(timeout_s)
            try:
                self._listen(timeout_s)
            except StoreHostError as exc:
                if not self._closed:
                    on_error(exc)

        _start(later, f"store-{self.port}")
        return self

    def _listen(self, timeout_s: float) -> GenerationStore:
        with self._lock:
            if not self._closed:
                self._listen_locked(timeout_s)
        return self

    def _listen_locked(self, timeout_s: float) -> None:
        if _import_error or not _import_done.is_set():
            raise StoreHostError(f"cannot import torch.distributed to host the workers' store: "
                                 f"{_import_error[0] if _import_error else 'import timed out'}")
        import torch.distributed as dist

        try:
            self._store = dist.TCPStore("0.0.0.0", self.port, world_size=None, is_master=True,
                                        wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError, ValueError) as exc:
            raise StoreHostError(f"cannot host the workers' store on port {self.port}: {exc}") from exc
        log.debug("hosting the workers' store on port %d", self.port)

    def close(self) -> None:
        """Shuts the server down (torch stops it when the last reference goes); a start still pending is
        cancelled."""
        with self._lock:
            self._closed = True
            self._store = None
