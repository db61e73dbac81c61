"""Whether an attached launcher still lives, told by a lock it holds rather than by its pid.

A pid names a process only inside one pid namespace. In Kubernetes the node daemon and each ``trainguard run``
run in pods of their own, where both are usually pid 1: the daemon asked whether "pid 1" lives would always
answer yes (itself), so a launcher killed without ``DetachJob`` kept its job's arena in host memory and its
coordinator reported to until the daemon restarted. What the two sides do share, by construction, is the folder
of the daemon's unix socket (the launcher connects through it). So each launcher creates a file in
``<socket folder>/launchers/`` and holds an exclusive ``flock`` on it for its whole life; the kernel drops the
lock when the process dies, however it dies, and the daemon probes it with a non-blocking ``flock`` of its own
(flock locks belong to the inode, so they are seen through bind mounts and across containers).

Where the folder cannot be written (an older daemon, or a socket folder the launcher may only read), the
launcher sends no lock and the daemon falls back to the pid, right whenever both share a pid namespace (systemd).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Folder beside the daemon's socket that holds the launchers' lock files.
LAUNCHERS_DIR = "launchers"
#: What a lock file's name may be: the job, the launcher's pid in its own namespace, a random part.
LOCK_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.lock\Z")


def launchers_dir(socket_path: str) -> str:
    """The lock folder that belongs to the daemon socket at ``socket_path``."""
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), LAUNCHERS_DIR)


def prepare_launchers_dir(socket_path: str, socket_mode: int) -> str:
    """Creates the lock folder beside the daemon's socket (daemon side); returns its path.

    Whoever may connect to the socket (its ``socket_mode``'s owner and group bits) may create locks; the sticky
    bit keeps users from removing each other's.

    Raises:
        OSError: the folder cannot be created.
    """
    path = launchers_dir(socket_path)
    os.makedirs(path, exist_ok=True)
    mode = 0o1700 | (0o070 if socket_mode & 0o060 else 0)
    os.chmod(path, mode)
    return path


class LauncherLock:
    """The launcher's side: a lock file held until :meth:`release` or the process's death.

    Args:
        path: the lock file (created by :meth:`acquire`).
        fd: its open descriptor, holding the lock.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd

    @property
    def name(self) -> str:
        """The file's name, which the daemon resolves in its own view of the folder."""
        return os.path.basename(self.path)

    @classmethod
    def acquire(cls, socket_path: str, job: str) -> "LauncherLock | None":
        """Creates and locks a fresh lock file for ``job`` beside the daemon's socket.

        Returns:
            The held lock, or None when the folder is missing or not writable (the daemon then goes by pid).
        """
        folder = launchers_dir(socket_path)
        safe_job = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:120] or "job"
        path = os.path.join(folder, f"{safe_job}.{os.getpid()}.{secrets.token_hex(6)}.lock")
        try:
            # O_CLOEXEC: the workers (exec'd children) must not inherit the descriptor, or the lock would outlive
            # a launcher whose workers are still being reaped.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            log.debug("no launcher lock in %s (%s); the node daemon will go by this process's pid", folder, exc)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return cls(path, fd)

    def release(self) -> None:
        """Removes the file and drops the lock (the daemon then sees this launcher gone)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1


def lock_alive(folder: str, name: str) -> bool:
    """Whether the launcher holding lock ``name`` in ``folder`` still lives (daemon side).

    A lock that can be taken belongs to a dead launcher: it is released and its file removed. A name that is not
    a plain lock file name counts as dead.
    """
    if not LOCK_NAME_RE.match(name):
        return False
    path = os.path.join(folder, name)
    try:
        # O_NOFOLLOW: the folder is writable by the socket's users; a symlink planted there is never followed.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        return False
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def launcher_alive(folder: str | None) -> Callable[[int | str], bool]:
    """The daemon's liveness test of a launcher key: a lock file name (str) in ``folder``, else a pid (int)."""
    from trainguard.agent.pids import pid_alive

    def alive(key: int | str) -> bool:
        if isinstance(key, str):
            return folder is not None and lock_alive(folder, key)
        return pid_alive(key)

    return alive


__all__ = ["LAUNCHERS_DIR", "LOCK_NAME_RE", "LauncherLock", "launcher_alive", "launchers_dir", "lock_alive", "prepare_launchers_dir"]
