"""Where ``trainguard status`` finds the agent to ask, without flags.

A ``trainguard run`` serves its node agent on a unix socket in a private temporary directory, which no operator
can guess. Each run therefore leaves a small record ``<pid>.json`` (job, pid, socket, start time) in
:func:`registry_dir` (``$XDG_RUNTIME_DIR/trainguard/runs``, else ``/tmp/trainguard-<uid>/runs``, mode 0700)
and removes it when it ends. :func:`default_socket` picks, in order:

1. ``$TRAINGUARD_AGENT_SOCKET_PATH`` (the daemon's override);
2. ``$TRAINGUARD_AGENT_SOCKET`` (set inside a worker of ``trainguard run``: a shell in the job sees its agent);
3. the daemon's socket ``/run/trainguard/agent.sock`` when it exists;
4. the newest record of a ``trainguard run`` whose process still runs (records of dead processes are removed).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass

from trainguard.agent.pids import pid_alive
from trainguard.worker_env import AGENT_SOCKET_ENV

log = logging.getLogger(__name__)

#: The daemon's socket override (same name as :data:`trainguard.agent.config.SOCKET_ENV`).
DAEMON_SOCKET_ENV = "TRAINGUARD_AGENT_SOCKET_PATH"
#: The socket variable every worker of ``trainguard run`` gets (owned by :mod:`trainguard.worker_env`).
WORKER_SOCKET_ENV = AGENT_SOCKET_ENV
#: The daemon's default socket.
DAEMON_SOCKET = "/run/trainguard/agent.sock"
#: Overrides the directory of run records (tests, or several users sharing a runtime dir).
REGISTRY_DIR_ENV = "TRAINGUARD_RUN_REGISTRY"


@dataclass(frozen=True)
class RunRecord:
    """One running ``trainguard run`` as its record describes it."""

    job: str
    pid: int
    socket: str
    started: float


def registry_dir() -> str:
    """The directory holding run records (created lazily by :func:`register`)."""
    if os.environ.get(REGISTRY_DIR_ENV):
        return os.environ[REGISTRY_DIR_ENV]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "trainguard", "runs")
    return os.path.join(tempfile.gettempdir(), f"trainguard-{os.getuid()}", "runs")


def _untrusted(d: str) -> str | None:
    """Why the records under ``d`` cannot be trusted (None when they can).

    ``d`` and, unless :data:`REGISTRY_DIR_ENV` chose it, its parent must be this user's and writable by no one
    else: whoever can rename entries in a folder above the records can swap them, and ``trainguard status``
    would then ask (and show the answer of) a socket of theirs. ``/tmp/trainguard-<uid>`` is a name anyone can
    create first.
    """
    chain = [d] if os.environ.get(REGISTRY_DIR_ENV) else [d, os.path.dirname(d)]
    for path in chain:
        try:
            st = os.lstat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        if st.st_uid != os.getuid():
            return f"{path} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022:
            return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def register(job: str, socket_path: str) -> str | None:
    """Writes this process's record; returns its path (None when the directory is unusable: status then needs
    ``--socket``, nothing else is lost)."""
    d = registry_dir()
    try:
        if not os.environ.get(REGISTRY_DIR_ENV):
            os.makedirs(os.path.dirname(d), mode=0o700, exist_ok=True)  # makedirs' mode is the leaf's only
        os.makedirs(d, mode=0o700, exist_ok=True)
        why = _untrusted(d)
        if why:
            log.warning("not registering the run for `trainguard status`: %s", why)
            return None
        path = os.path.join(d, f"{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"job": job, "pid": os.getpid(), "socket": socket_path, "started": time.time()}, fh)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        log.warning("not registering the run for `trainguard status` (%s)", exc)
        return None


def unregister(path: str) -> None:
    """Removes a record written by :func:`register` (missing is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def live_runs() -> list[RunRecord]:
    """Records of runs whose process still lives and whose socket exists, newest first; stale ones are removed."""
    d = registry_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return []
    why = _untrusted(d)
    if why:
        log.warning("ignoring the run records in %s: %s", d, why)
        return []
    runs = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(d, name)
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
            rec = RunRecord(str(raw["job"]), int(raw["pid"]), str(raw["socket"]), float(raw["started"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(rec.pid) or not os.path.exists(rec.socket):
            unregister(path)
            continue
        runs.append(rec)
    return sorted(runs, key=lambda r: r.started, reverse=True)


def default_socket() -> tuple[str, str]:
    """The socket ``trainguard status`` asks when given none, and why that one (for messages).

    Returns:
        ``(path, origin)``.
    """
    for var in (DAEMON_SOCKET_ENV, WORKER_SOCKET_ENV):
        if os.environ.get(var):
            return os.environ[var], f"${var}"
    if os.path.exists(DAEMON_SOCKET):
        return DAEMON_SOCKET, "the node agent daemon"
    runs = live_runs()
    if runs:
        r = runs[0]
        more = f"; {len(runs) - 1} other run(s) on this host, pick one with --socket" if len(runs) > 1 else ""
        return r.socket, f"trainguard run of job {r.job!r} (pid {r.pid}){more}"
    return DAEMON_SOCKET, "the daemon's default (no trainguard run found on this host)"


__all__ = ["DAEMON_SOCKET", "REGISTRY_DIR_ENV", "RunRecord", "default_socket", "live_runs", "register",
           "registry_dir", "unregister"]
