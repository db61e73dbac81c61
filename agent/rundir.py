"""The launcher's private run folder (``<tmp>/tg-`` plus 8 random characters: its sockets, the workers' error
files), and the removal of those left by launchers that died.

A ``trainguard run`` removes its folder when it ends, but one killed with SIGKILL cannot: its workers and its
persist process die with it (PR_SET_PDEATHSIG, the guard), the folder stays. One node accumulated 765 of them
across test sessions. A new launcher removes the ones whose launcher is provably gone: each launcher holds an
exclusive ``flock`` on ``owner.lock`` in its folder for its whole life (the kernel drops it however the process
ends), so a folder whose lock can be taken has no owner. The lock, not the launcher's socket, decides: the
socket stops answering while a launcher still drains its persist process at the end, and removing the folder
then would cut the drain short. Folders of older versions (no lock) go only when their ``agent.sock`` refuses
connections and they are a day old. Folders of other users and other ``tg-*`` names are left alone.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import tempfile
import time

log = logging.getLogger(__name__)

#: ``tempfile.mkdtemp(prefix="tg-")``: the prefix and 8 random characters (drill folders have longer names).
RUNDIR_RE = re.compile(r"^tg-[a-z0-9_]{8}\Z")
#: No folder younger than this is removed (its owner may be between creating it and locking it).
MIN_AGE_S = 10.0
#: A folder of an older version (no owner lock) younger than this is never removed.
LEGACY_MIN_AGE_S = 86400.0
#: The launcher's socket inside its run folder.
SOCKET_NAME = "agent.sock"
#: The lock its owner holds for life.
LOCK_NAME = "owner.lock"

_held: dict[str, int] = {}  # this process's owner locks (folder -> descriptor): held until removed


def make_rundir() -> str:
    """Creates this launcher's run folder (private to the user) and takes its owner lock for the process's
    life (the descriptor is not inherited by the workers)."""
    path = tempfile.mkdtemp(prefix="tg-")
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[path] = fd
    return path


def remove_rundir(path: str) -> None:
    """Removes this launcher's run folder, then drops its owner lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def owner_gone(folder: str) -> bool | None:
    """Whether the owner of ``folder`` is gone: True (its lock is free), False (held), None (no lock)."""
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def socket_dead(path: str) -> bool:
    """True when the unix socket at ``path`` exists and nobody listens on it (its server is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError as exc:
            return exc.errno == errno.ECONNREFUSED
        return False


def reap_stale_rundirs(tmp: str | None = None, now: float | None = None) -> list[str]:
    """Removes the run folders of dead launchers of this user under ``tmp`` (default the temp directory).

    Returns:
        The folders removed. Errors are logged, never raised: this is housekeeping.
    """
    tmp = tmp or tempfile.gettempdir()
    now = time.time() if now is None else now
    uid = os.getuid()
    removed: list[str] = []
    try:
        entries = list(os.scandir(tmp))
    except OSError as exc:
        log.debug("cannot list %s for stale run folders: %s", tmp, exc)
        return removed
    for e in entries:
        if not RUNDIR_RE.match(e.name):
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if not e.is_dir(follow_symlinks=False) or st.st_uid != uid or now - st.st_mtime < MIN_AGE_S:
                continue
            gone = owner_gone(e.path)
            if gone is None:  # an older version's folder: its socket and its age decide
                sock = os.path.join(e.path, SOCKET_NAME)
                gone = (now - st.st_mtime >= LEGACY_MIN_AGE_S and os.path.exists(sock) and socket_dead(sock))
            if not gone:
                continue
            shutil.rmtree(e.path)
            removed.append(e.path)
        except OSError as exc:
            log.debug("stale run folder %s not removed: %s", e.path, exc)
    if removed:
        log.info("removed %d run folder(s) of launchers that died without cleaning up (%s%s)", len(removed),
                 ", ".join(os.path.basename(p) for p in removed[:3]), ", ..." if len(removed) > 3 else "")
    return removed


__all__ = ["LEGACY_MIN_AGE_S", "LOCK_NAME", "MIN_AGE_S", "RUNDIR_RE", "SOCKET_NAME", "make_rundir", "owner_gone",
           "reap_stale_rundirs", "remove_rundir", "socket_dead"]
