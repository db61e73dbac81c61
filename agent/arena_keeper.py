"""The node daemon keeps the jobs' in-memory checkpoint arenas: alive across launcher deaths, removed when done.

A job's memory tier is a folder of tmpfs files (``<root>/<job>/rank_NNNNN/``, :mod:`trainguard.checkpoint.arena`)
that outlives its writers by design, so a restarted worker restores from memory. Without a keeper, whoever ends
the job removes it; a ``trainguard run`` killed with SIGKILL never does, and the folder stays in /dev/shm until
the host reboots. With a daemon on the node, each launcher registers its job's arena (``AttachJob``); the
:class:`ArenaKeeper` then:

- keeps the arena while any launcher of the job lives, and for ``ttl_s`` after the last one died, so a
  restarted launcher (same job name) finds its snapshots and restores from memory;
- removes it at once when a launcher says the job is over (``DetachJob`` with ``ended``);
- removes it ``ttl_s`` after its last launcher is gone, but never while a process still holds a rank's writer
  lease (``owner.lock``, a POSIX record lock): a writer the daemon does not know of is never robbed;
- at daemon start, adopts the arenas already under its root (left by launchers that died while no daemon ran),
  with the TTL counted from then;
- made ``exclusive``, holds the root until closed (an ``flock`` on ``<root>/.trainguard-keeper.lock``, the pid in
  it): a second daemon given the same ``memory_tier.root`` is refused, naming the first's pid. Two keepers of one
  root adopted each other's jobs' arenas and removed them ``ttl_s`` later, under a running job.

One arena's states::

    HELD (a launcher lives) --last launcher gone--> ORPHANED --ttl_s passed, no lease held--> REMOVED
      ^                                               |
      '---------------- a launcher attaches ----------'
    HELD/ORPHANED --DetachJob(ended)--> REMOVED
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import os
import re
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from trainguard.agent.errors import AgentError
from trainguard.agent.pids import pid_alive
from trainguard.checkpoint.arena import LEASE_NAME

log = logging.getLogger(__name__)


class ArenaRootError(AgentError):
    """A launcher's arena root is not the daemon's (``memory_tier.root``), or another daemon keeps that root."""


#: The lock file a keeper holds in its root (not a folder, so never adopted as an arena).
KEEPER_LOCK_NAME = ".trainguard-keeper.lock"
# Roots this process keeps, by real path: [lock fd, keepers holding it]. flock conflicts between two open files of
# one process too, and a daemon restarted in the same process (tests) takes its own root again.
_HELD_ROOTS: dict[str, list[int]] = {}
_HELD_ROOTS_LOCK = threading.Lock()


def hold_root(root: str) -> bool:
    """Takes ``root`` for this process (see the module docstring), counting one more holder; creates it when
    missing, world-writable with the sticky bit as /dev/shm is, since launchers of any user make their jobs'
    folders there. Returns False when the lock cannot be made (logged: the root is then kept unguarded).

    Raises:
        ArenaRootError: another process keeps ``root`` (the message names its pid and the setting to change), or
            ``root`` is missing and cannot be created.
    """
    with _HELD_ROOTS_LOCK:
        if root in _HELD_ROOTS:
            _HELD_ROOTS[root][1] += 1
            return True
        path = os.path.join(root, KEEPER_LOCK_NAME)
        if not os.path.isdir(root):
            try:
                os.makedirs(root, exist_ok=True)
                os.chmod(root, 0o1777)
            except OSError as exc:
                # Refused at start, as an uncreatable state_dir is: the daemon said "ready" and kept no job's
                # in-memory checkpoints, with only a warning about detecting a second daemon.
                raise ArenaRootError(
                    f"memory_tier.root: cannot create {root} ({exc.strerror or exc}); give it a folder on a tmpfs "
                    f"the daemon may create (e.g. /dev/shm/trainguard)") from exc
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            # Not refused: a daemon that ran before with a root it cannot write keeps running, unguarded.
            log.warning("memory tier: cannot create %s (%s): a second daemon on %s would not be detected", path,
                        exc.strerror or exc, root)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                log.warning("memory tier: cannot lock %s (%s): a second daemon on %s would not be detected", path,
                            exc.strerror or exc, root)
                return False
            who = f"pid {holder}" if holder.isdigit() else "its pid unknown"
            raise ArenaRootError(
                f"another trainguard daemon ({who}, in its own pid namespace if in another container) keeps the "
                f"in-memory checkpoints under {root}: two daemons on one root remove each other's jobs' arenas; "
                f"stop that daemon, or give this one its own memory_tier.root (and its jobs the same "
                f"TRAINGUARD_CHECKPOINT_SHM_DIR)") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            # A full tmpfs: the lock holds without the pid (which only names this daemon to a second one); raised
            # here, it stopped the daemon with "cannot write the output (standard output)".
            log.warning("memory tier: cannot write this daemon's pid into %s (%s); %s is full, so jobs' in-memory "
                        "checkpoints will not fit there either", path, exc.strerror or exc, root)
        _HELD_ROOTS[root] = [fd, 1]
        return True


def drop_root(root: str) -> None:
    """One holder of ``root`` in this process lets go; the last one releases the lock."""
    with _HELD_ROOTS_LOCK:
        held = _HELD_ROOTS.get(root)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _HELD_ROOTS[root]
            os.close(held[0])


class ArenaState(enum.Enum):
    """Where a kept arena stands."""

    HELD = "held"
    ORPHANED = "orphaned"
    REMOVED = "removed"


_A = ArenaState
#: Allowed moves; anything else is a bug in this module.
TRANSITIONS: dict[ArenaState, frozenset[ArenaState]] = {
    _A.HELD: frozenset({_A.HELD, _A.ORPHANED, _A.REMOVED}),
    _A.ORPHANED: frozenset({_A.HELD, _A.ORPHANED, _A.REMOVED}),
    _A.REMOVED: frozenset(),
}


@dataclass
class KeptArena:
    """One job's arena as the keeper tracks it.

    Attributes:
        job: the job name (the arena is ``<root>/<job>``).
        launchers: keys of the live launchers of the job on this node (a lock file's name, or a pid).
        state: see :class:`ArenaState`.
        orphaned_at: when the last launcher was found gone (monotonic seconds); 0 while held.
    """

    job: str
    launchers: set[int | str] = field(default_factory=set)
    state: ArenaState = ArenaState.HELD
    orphaned_at: float = 0.0

    def move(self, new: ArenaState) -> None:
        """Changes the state, checking :data:`TRANSITIONS`."""
        if new not in TRANSITIONS[self.state]:
            raise AssertionError(f"arena {self.job}: {self.state.name} -> {new.name} is not allowed")
        self.state = new


#: Folders of a job's arena: a rank's snapshots (``rank_00003``, :mod:`trainguard.checkpoint.arena`) and the
#: copies it holds for other nodes (``replicas``, :mod:`trainguard.checkpoint.replica_store`).
_ARENA_ENTRY_RE = re.compile(r"^(rank_\d{5}|replicas)$")


def looks_like_arena(path: str) -> bool:
    """Whether the folder ``path`` holds a job's arena: a ``rank_NNNNN`` or ``replicas`` folder, and nothing that
    is not one (a folder of some other program's is never taken for an arena, so never removed)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    return bool(entries) and all(e.is_dir(follow_symlinks=False) and _ARENA_ENTRY_RE.match(e.name)
                                 for e in entries)


def _foreign(path: str) -> bool:
    """Whether ``path`` exists as something other than an arena or an empty folder (a file, a link, a folder of
    another program's)."""
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not os.path.isdir(path):
        return True
    try:
        empty = not os.listdir(path)
    except OSError:
        return True
    return not empty and not looks_like_arena(path)


def lease_held(arena_dir: str) -> bool:
    """Whether some process holds a rank's writer lease (``rank_*/owner.lock``) in ``arena_dir``.

    Probes each lock with a non-blocking exclusive record lock and releases it at once.
    """
    try:
        ranks = [e for e in os.scandir(arena_dir) if e.is_dir() and e.name.startswith("rank_")]
    except OSError:
        return False
    for entry in ranks:
        path = os.path.join(entry.path, LEASE_NAME)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.lockf(fd, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return True
        finally:
            os.close(fd)
    return False


class ArenaKeeper:
    """The daemon's table of kept arenas under one tmpfs root; thread-safe.

    Args:
        root: the daemon's ``memory_tier.root``.
        ttl_s: seconds an arena outlives its last launcher.
        clock: monotonic clock, seconds.
        alive: whether a launcher still runs, by its key (the daemon's tests a lock file or a pid; tests of the
            TTL pass their own). Default: by pid.
        exclusive: hold ``root`` (:func:`hold_root`) until :meth:`close`, refusing it to other processes' keepers.
            The daemon passes True and closes its keeper when it stops; False (default) for a keeper that only
            reads or tests the table, and for a daemon that does not close it (its root would stay held in its
            process after a stop in-process, refusing the next daemon on that root).

    Raises:
        ArenaRootError: ``exclusive`` and another process keeps ``root``.
    """

    def __init__(self, root: str, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 alive: Callable[[int | str], bool] = pid_alive, exclusive: bool = False) -> None:
        self.root = os.path.realpath(root)
        # Released by close(), or when the keeper is collected.
        self._release: weakref.finalize | None = None
        if exclusive and hold_root(self.root):
            self._release = weakref.finalize(self, drop_root, self.root)
        self.ttl_s = ttl_s
        self._clock = clock
        self._alive = alive
        self._lock = threading.Lock()
        self._arenas: dict[str, KeptArena] = {}

    def close(self) -> None:
        """Lets go of the root (idempotent): the daemon's stop calls it, so a daemon started next is not refused."""
        if self._release is not None:
            self._release()

    def arena_dir(self, job: str) -> str:
        """The arena folder of ``job``."""
        return os.path.join(self.root, job)

    def adopt_existing(self) -> list[str]:
        """Takes the arenas already under the root as orphans (TTL from now); returns their job names.

        Only folders laid out as arenas are taken (:func:`looks_like_arena`): the root may be a tmpfs other
        programs use too (``/dev/shm`` itself), and what is adopted is deleted, as root, ``ttl_s`` later.
        """
        try:
            names = sorted(e.name for e in os.scandir(self.root)
                           if e.is_dir(follow_symlinks=False) and looks_like_arena(e.path))
        except OSError:
            return []
        now = self._clock()
        with self._lock:
            for job in names:
                self._arenas.setdefault(job, KeptArena(job, state=ArenaState.ORPHANED, orphaned_at=now))
        if names:
            log.info("memory tier: adopted %d arena(s) left under %s (removed %.0f s after now unless a launcher "
                     "attaches): %s", len(names), self.root, self.ttl_s, ", ".join(names))
        return names

    def attach(self, job: str, root: str, launcher: int | str) -> bool:
        """Registers a launcher of ``job``.

        Args:
            job: the job name.
            root: the launcher's arena root (must be this keeper's).
            launcher: the launcher's key (its lock file's name, or its pid).

        Returns:
            True when the arena was already kept (a restarted launcher finds its snapshots).

        Raises:
            ArenaRootError: ``root`` is not this keeper's root, or ``job`` is not a plain folder name.
        """
        if not job or "/" in job or job in (".", ".."):
            raise ArenaRootError(f"job {job!r} is not a usable arena folder name")
        if os.path.realpath(root) != self.root:
            raise ArenaRootError(
                f"arena root {root} is not this daemon's memory_tier.root {self.root}: set "
                f"TRAINGUARD_CHECKPOINT_SHM_DIR={self.root} for the job (or change memory_tier.root)")
        if _foreign(self.arena_dir(job)):
            # The job's folder would be removed as its arena when it ends (the daemon runs as root): any user of
            # the socket could name an existing folder under the root (/dev/shm itself) and have it deleted.
            raise ArenaRootError(
                f"{self.arena_dir(job)} exists and holds files that are not a checkpoint arena's (rank_NNNNN/ or "
                f"replicas/ folders only); it is another program's: run the job under another name or give the "
                f"daemon another memory_tier.root")
        with self._lock:
            kept = self._arenas.get(job)
            had = kept is not None and os.path.isdir(self.arena_dir(job))
            if kept is None:
                kept = self._arenas[job] = KeptArena(job)
            if kept.state is ArenaState.ORPHANED:
                kept.move(ArenaState.HELD)
                kept.orphaned_at = 0.0
            kept.launchers.add(launcher)
        log.info("memory tier: job %s attached by launcher %s (%s)", job, launcher,
                 "its arena was kept" if had else "new arena")
        return had

    def detach(self, job: str, launcher: int | str, ended: bool) -> bool:
        """Launcher ``launcher`` (its key) leaves; with ``ended`` the job is over and its arena is removed now.

        Returns:
            True when the arena was removed.
        """
        with self._lock:
            kept = self._arenas.get(job)
            if kept is None:
                return False
            others = kept.launchers - {launcher}
            if ended and launcher not in kept.launchers:
                # Not one of the job's launchers: not its call (any user of the socket may send DetachJob, and the
                # daemon may remove files of every user's job). Nor when none lives: the arena of a SIGKILLed
                # launcher is kept for its restart, which attaches before it can end the job (a launcher that
                # outlived a daemon restart attaches again too); an orphan nobody claims ages out by the TTL.
                if others:
                    log.warning("memory tier: launcher %s, not one of job %s's, said the job ended; its arena "
                                "stays while launchers %s live", launcher, job,
                                ", ".join(map(str, sorted(others, key=str))))
                else:
                    log.warning("memory tier: launcher %s, which never attached job %s, said the job ended; its "
                                "kept arena stays (removed %.0f s after its last launcher left)", launcher, job,
                                self.ttl_s)
                return False
            kept.launchers.discard(launcher)
            if not ended:
                return False
            del self._arenas[job]
            kept.move(ArenaState.REMOVED)
        return self._remove(job, "the job ended")

    def sweep(self) -> list[str]:
        """Ages the arenas: orphans those whose launchers are all gone, removes orphans past the TTL.

        Returns:
            The jobs whose arenas were removed.
        """
        now = self._clock()
        due: list[str] = []
        with self._lock:
            for job, kept in list(self._arenas.items()):
                kept.launchers = {p for p in kept.launchers if self._alive(p)}
                if kept.launchers:
                    continue
                if kept.state is ArenaState.HELD:
                    kept.move(ArenaState.ORPHANED)
                    kept.orphaned_at = now
                    log.info("memory tier: every launcher of job %s is gone; keeping its arena %.0f s",
                             job, self.ttl_s)
                if now - kept.orphaned_at >= self.ttl_s:
                    if lease_held(self.arena_dir(job)):
                        continue  # a writer the daemon does not know of: never rob it
                    del self._arenas[job]
                    kept.move(ArenaState.REMOVED)
                    due.append(job)
        return [job for job in due if self._remove(job, f"no launcher for {self.ttl_s:.0f} s")]

    def kept(self) -> dict[str, KeptArena]:
        """A snapshot of the table."""
        with self._lock:
            return {j: KeptArena(k.job, set(k.launchers), k.state, k.orphaned_at) for j, k in self._arenas.items()}

    def _remove(self, job: str, why: str) -> bool:
        """Removes ``job``'s arena folder; returns whether it is gone (a failure is logged, naming the cause)."""
        failures: list[str] = []

        def note(path: str, exc: BaseException) -> None:
            if not isinstance(exc, FileNotFoundError):  # already gone is what we want
                failures.append(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")

        path = self.arena_dir(job)
        if _foreign(path):  # filled by another program since: not ours to delete
            log.warning("memory tier: not removing %s (%s): it holds files that are not a checkpoint arena's",
                        path, why)
            return False
        if sys.version_info >= (3, 12):  # onerror is deprecated from 3.12 on
            shutil.rmtree(path, onexc=lambda _func, where, exc: note(where, exc))
        else:
            shutil.rmtree(path, onerror=lambda _func, where, exc_info: note(where, exc_info[1]))
        if failures:
            # Left in the tmpfs: say so instead of claiming it removed. The usual cause is an arena its job's user
            # owns and a daemon without CAP_DAC_OVERRIDE/CAP_FOWNER (the shipped unit grants both).
            log.warning("memory tier: cannot remove the arena of job %s (%s): %s%s; it stays in %s until removed "
                        "by hand or adopted again at the daemon's next start", job, why, failures[0],
                        f" (and {len(failures) - 1} more)" if len(failures) > 1 else "", path)
            return False
        log.info("memory tier: removed the arena of job %s (%s)", job, why)
        return True


__all__ = ["ArenaKeeper", "ArenaRootError", "ArenaState", "KEEPER_LOCK_NAME", "KeptArena", "TRANSITIONS", "drop_root",
           "hold_root", "lease_held"]
