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
"""

from __future__ import annotations

import importlib
import logging
import threading
from datetime import timedelta

log = logging.getLogger(__name__)

_import_done = threading.Event()
_import_error: list[BaseException] = []


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

    threading.Thread(target=work, name="store-import", daemon=True).start()


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
            if self._closed:
                return
            try:
                self._listen(timeout_s)
            except StoreHostError as exc:
                on_error(exc)

        threading.Thread(target=later, name=f"store-{self.port}", daemon=True).start()
        return self

    def _listen(self, timeout_s: float) -> GenerationStore:
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
        return self

    def close(self) -> None:
        """Shuts the server down (torch stops it when the last reference goes)."""
        self._closed = True
        self._store = None
