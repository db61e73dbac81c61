"""The launcher's private run folder (``<tmp>/tg-XXXXXXXX``: its sockets, the workers' error files), and the
removal of those left by launchers that died.

A ``trainguard run`` removes its folder when it ends, but one killed with SIGKILL cannot: its workers and its
persist process die with it (PR_SET_PDEATHSIG, the guard), the folder stays. One node accumulated 765 of them
across test sessions. A new launcher removes the ones whose launcher is provably gone: the folder holds the
launcher's gRPC socket (``agent.sock``), and a socket whose server died refuses connections (ECONNREFUSED),
while a live launcher's accepts them. Folders without that socket (a launcher still starting, or anything
else named ``tg-*``) and folders of other users are left alone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import time

log = logging.getLogger(__name__)

#: ``tempfile.mkdtemp(prefix="tg-")``: the prefix and 8 random characters (drill folders have longer names).
RUNDIR_RE = re.compile(r"^tg-[a-z0-9_]{8}$")
#: A folder younger than this is never removed (its launcher may not listen yet).
MIN_AGE_S = 60.0
#: The launcher's socket inside its run folder.
SOCKET_NAME = "agent.sock"


def make_rundir() -> str:
    """Creates this launcher's run folder (private to the user)."""
    return tempfile.mkdtemp(prefix="tg-")


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
            sock = os.path.join(e.path, SOCKET_NAME)
            if not os.path.exists(sock) or not socket_dead(sock):
                continue
            shutil.rmtree(e.path)
            removed.append(e.path)
        except OSError as exc:
            log.debug("stale run folder %s not removed: %s", e.path, exc)
    if removed:
        log.info("removed %d run folder(s) of launchers that died without cleaning up (%s%s)", len(removed),
                 ", ".join(os.path.basename(p) for p in removed[:3]), ", ..." if len(removed) > 3 else "")
    return removed


__all__ = ["MIN_AGE_S", "RUNDIR_RE", "SOCKET_NAME", "make_rundir", "reap_stale_rundirs", "socket_dead"]
