"""A sidecar that kills the workers' process groups when the launcher dies, however it dies.

``PR_SET_PDEATHSIG`` takes a worker down with the agent, but not what the worker forked (data-loader
processes, compilers, shells). The guard is a tiny separate process holding the read end of a pipe whose write
end only the agent holds: when the agent exits, even by SIGKILL, the pipe reaches EOF and the guard SIGKILLs
every process group it was told about. Under systemd, ``KillMode=control-group`` does the same job; the guard
covers ``trainguard run`` started by hand or by a batch scheduler.
"""

from __future__ import annotations

import subprocess
import sys
import threading

_GUARD_CODE = r"""
import os, signal, sys
groups = set()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "add":
        groups.add(int(arg))
    elif cmd == "del":
        groups.discard(int(arg))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class ProcessGroupGuard:
    """Client side of the guard process; one per agent process, started lazily."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-c", _GUARD_CODE],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # signals aimed at the launcher's group must not reach the guard
                close_fds=True,
                text=True,
            )
        return self._proc

    def _send(self, line: str) -> None:
        with self._lock:
            proc = self._ensure()
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._proc = None

    def watch(self, pgid: int) -> None:
        """Asks the guard to kill process group ``pgid`` if this process dies."""
        self._send(f"add {pgid}")

    def forget(self, pgid: int) -> None:
        """The group ended normally; the guard need not (and must not, pgids are reused) kill it."""
        self._send(f"del {pgid}")

    def close(self) -> None:
        """Stops the guard (it kills any group still registered)."""
        with self._lock:
            if self._proc is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
                self._proc.wait(timeout=5)
                self._proc = None


_GUARD = ProcessGroupGuard()


def guard() -> ProcessGroupGuard:
    """The process-wide guard."""
    return _GUARD

