"""Records the exception that ends a worker in ``$TORCHELASTIC_ERROR_FILE``, as torch's ``@record`` would.

Launchers (torchrun, ``trainguard run``) name a failed rank's exception in their summary only when the worker
wrote it there, and only scripts whose entry point carries ``@record`` do. A hook user whose ``restore()``
raised (a checkpoint of 2 ranks restored into a job shrunk to 1, generation after generation) saw only "exit code
1" for every fault of the job. A worker that called ``trainguard.init()`` records its uncaught exception the same
way; a file ``@record`` already wrote is left as it is.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from types import TracebackType

from trainguard.worker_env import ERROR_FILE_ENV

_installed = False
_lock = threading.Lock()


def record(exc: BaseException, path: str | None = None) -> bool:
    """Writes ``exc`` to ``path`` (default ``$TORCHELASTIC_ERROR_FILE``) in ``@record``'s format, unless the
    file exists already (``@record`` wrote it) or no path is set.

    Returns:
        Whether it wrote the file.
    """
    path = path if path is not None else os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return False
    body = {"message": {
        "message": f"{type(exc).__name__}: {_text(exc)}",
        "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                      "timestamp": str(int(time.time()))},
    }}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "x", encoding="utf-8") as f:  # "x": never over a file another writer made meanwhile
            json.dump(body, f)
    except OSError:
        return False  # the launcher then says "exit code 1", as before: nothing here may hide the real error
    return True


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what ``traceback`` prints for an exception whose ``__str__`` raises: the record must not
    replace the worker's own error with one of its own."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - any __str__ may raise anything
        return "<exception str() failed>"


def install() -> None:
    """Chains :func:`record` in front of ``sys.excepthook`` (idempotent): the uncaught exception that ends the
    process is recorded, then reported as before."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = sys.excepthook

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            try:
                if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    record(exc)
            except Exception:  # noqa: BLE001 - the previous hook must still report the worker's own error
                pass
            finally:
                previous(kind, exc, tb)

        sys.excepthook = hook
        _installed = True


__all__ = ["install", "record"]
