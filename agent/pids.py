"""Whether a process is alive, the one test shared by the daemon's arena keeper and the run registry."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not).

    A process of another user counts as alive (``kill`` refuses with EPERM, but it exists). A zombie (exited,
    not reaped: e.g. a launcher its caller has not waited for) is gone: it holds no socket and writes nothing.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


__all__ = ["pid_alive"]
