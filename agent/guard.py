"""A sidecar that kills the workers' process groups when the launcher dies, however it dies.

``PR_SET_PDEATHSIG`` takes a worker down with the agent, but not what the worker forked (data-loader
processes, compilers, shells). The guard is a tiny separate process holding the read end of a pipe whose write
end only the agent holds: when the agent exits, even by SIGKILL, the pipe reaches EOF and the guard SIGKILLs
every process group it was told about. Under systemd, ``KillMode=control-group`` does the same job; the guard
covers ``trainguard run`` started by hand or by a batch scheduler.

A process that leaves its group (``setsid``, ``start_new_session=True``: a daemonised helper, a server a worker
starts) escaped the group kill and outlived the job, holding the launcher's output pipe. Every worker therefore
carries ``$TRAINGUARD_GUARD_TOKEN``, random per launcher, which its descendants inherit; after the group kill
the guard kills every process of its user whose environment holds the token (``/proc/<pid>/environ``). Only a
descendant that also clears its environment escapes both; a cgroup (systemd) catches that too.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading

#: Environment variable every worker carries (inherited by what it starts): the launcher's guard token.
TOKEN_ENV = "TRAINGUARD_GUARD_TOKEN"

_GUARD_CODE = r"""
import os, signal, sys
groups, token = set(), None
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "add":
        groups.add(int(arg))
    elif cmd == "del":
        groups.discard(int(arg))
    elif cmd == "token":
        token = ("\0%s=%s\0" % (sys.argv[1], arg)).encode()
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
# What left its group (setsid) but still carries the token; twice, for what a dying process forked meanwhile.
for _ in range(2 if token else 0):
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone, or another user's
        if token in b"\0" + env:
            try:
                os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass
"""


class ProcessGroupGuard:
    """Client side of the guard process; one per agent process, started lazily."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        #: Marks this launcher's workers and everything they start (see the module docstring).
        self.token = secrets.token_hex(16)

    def marked(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with this guard's token, for a worker (or standby) about to start."""
        return {**env, TOKEN_ENV: self.token}

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-c", _GUARD_CODE, TOKEN_ENV],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # signals aimed at the launcher's group must not reach the guard
                close_fds=True,
                text=True,
                env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},  # never a target of its own scan
            )
            self._proc.stdin.write(f"token {self.token}\n")
            self._proc.stdin.flush()
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

