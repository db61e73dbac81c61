"""Starting, watching and stopping the local training workers of one generation.

A :class:`WorkerGroup` owns the processes of one generation on one node. Each worker runs in its own process
session (so the whole tree it forks can be signalled at once) and gets ``PR_SET_PDEATHSIG`` so it dies with the
agent even when the agent is SIGKILLed: a launcher must never leave orphans holding accelerators.

Worker lifecycle (one per rank; the group as a whole is the supervisor's, see :mod:`trainguard.agent.parts`)::

    spawned                first report through the hook,
    -------> STARTING ---- or alive for the supervisor's running_after_s ----> RUNNING --exit 0--> SUCCEEDED
                |                                                              |  |----exit != 0 / signal--> FAILED
                '--exit / stop() (as from RUNNING)                             |  '----stop()--------------> STOPPED
                                                                               '--process detector: hang--> HUNG
    HUNG --stop()--> STOPPED
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.agent.errors import WorkerStartError
from trainguard.agent.guard import guard

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class WorkerState(enum.IntEnum):
    """Lifecycle of one worker (values equal ``trainguard.v1.WorkerState``)."""

    STARTING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    STOPPED = 5
    HUNG = 6


@dataclass
class WorkerSpec:
    """What to run for one local rank.

    Attributes:
        rank: global rank.
        local_rank: index of the worker on this node (device index).
        argv: the full command line.
        env: the complete environment of the process.
    """

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]


@dataclass
class Worker:
    """A started worker and what the agent knows about it."""

    spec: WorkerSpec
    proc: subprocess.Popen
    started_at: float
    state: WorkerState = WorkerState.STARTING  # RUNNING once it reports through the hook, or has lived a while
    exit_code: int | None = None
    ended_at: float | None = None
    last_step: int = -1
    last_heartbeat: float | None = None  # time.monotonic() of the last step report
    hooked: bool = False  # it reported through the hook (a step, or the hook's hello at start)
    step_times: deque = field(default_factory=lambda: deque(maxlen=64))
    finished: bool = False  # the worker said its training loop is over

    @property
    def pid(self) -> int:
        """Process id of the worker."""
        return self.proc.pid


def describe_exit(code: int | None) -> str:
    """Human text for a Popen return code: ``exit code 3`` or ``signal SIGKILL (9)``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"signal {name} ({-code})"
    return f"exit code {code}"


def child_setup() -> None:
    """``preexec_fn`` of every agent child: die with the agent (PR_SET_PDEATHSIG), whatever kills it."""
    _child_setup()


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once, here: the child of a fork runs _child_setup while the agent's other threads (gRPC, detectors,
# the lease keeper) may have held locks at the fork, so it makes one foreign call and nothing else; loading
# libc there ran dlopen/dlsym, which take the loader's lock.
_PRCTL = _load_prctl()
_SIGKILL = int(signal.SIGKILL)


def _child_setup() -> None:
    # Runs in the child between fork and exec: die with the agent, whatever kills it.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)


class WorkerGroup:
    """The worker processes of one generation on this node.

    Args:
        specs: one spec per local rank.
        log_dir: if set, each worker's stdout/stderr go to ``<log_dir>/rank<R>.log``; else they are inherited.
    """

    def __init__(self, specs: Sequence[WorkerSpec], log_dir: str | None = None,
                 streams: Mapping[int, object] | None = None, role: str = "default") -> None:
        self._specs = list(specs)
        self._log_dir = log_dir
        self._streams = dict(streams or {})
        # -r/-t named some rank's streams: the others stay on the console, as under torchrun (the one-file-per-rank
        # layout of a bare --log-dir took them too, and rank 0's output vanished into rank0.log)
        self._redirected = any(getattr(st, name, "console") in ("file", "tee")
                               for st in self._streams.values() for name in ("stdout", "stderr"))
        self._role = role
        self._workers: list[Worker] = []
        self._lock = threading.Lock()
        self._tee_threads: list[threading.Thread] = []

    def _targets(self, spec: WorkerSpec) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
        """(kind, path) for stdout and stderr: kind is console, null, file or tee (see
        :func:`trainguard.agent.run_torchrun.stream_specs`); ``both`` marks the one shared log file."""
        st = self._streams.get(spec.local_rank)
        out_kind = getattr(st, "stdout", "console")
        err_kind = getattr(st, "stderr", "console")
        if self._log_dir and not self._redirected and out_kind in ("console", "null") and \
                err_kind in ("console", "null"):
            # --log-dir without -r/-t: one file per rank with both streams (trainguard's layout).
            path = os.path.join(self._log_dir, f"rank{spec.rank}.log")
            return ("both", path), ("both", path)
        targets = []
        for kind, name in ((out_kind, "stdout"), (err_kind, "stderr")):
            path = os.path.join(self._log_dir, f"rank{spec.rank}.{name}.log") if kind in ("file", "tee") else None
            targets.append((kind, path))
        return targets[0], targets[1]

    def start(self, standbys: dict[int, subprocess.Popen] | None = None) -> None:
        """Spawns every worker, turning warm standby processes into workers where available.

        Args:
            standbys: local rank -> standby process (see :mod:`trainguard.agent.standby`); used ones are
                removed from the dict, the caller disposes of the rest.

        Raises:
            WorkerStartError: a process could not be spawned; the ones already started are stopped.
        """
        from trainguard.agent.standby import activate, script_argv

        for spec in self._specs:
            standby = (standbys or {}).pop(spec.local_rank, None)
            argv = script_argv(spec.argv)
            out, err = self._targets(spec)
            if self._log_dir:
                os.makedirs(self._log_dir, exist_ok=True)
            # A tee'd stream is a pipe the agent reads; a standby's streams are fixed at its spawn.
            teed = "tee" in (out[0], err[0])
            if standby is not None and argv is not None and not teed \
                    and activate(standby, argv, spec.env, _standby_path(out), _standby_path(err)):
                with self._lock:
                    self._workers.append(Worker(spec=spec, proc=standby, started_at=time.time()))
                continue
            if standby is not None:
                _reap(standby)
            files = []
            try:
                stdout = _popen_target(out, files)
                stderr = subprocess.STDOUT if out[0] == "both" else _popen_target(err, files)
                proc = subprocess.Popen(
                    spec.argv,
                    env=guard().marked(spec.env),  # what it starts in sessions of its own is found by this
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                    preexec_fn=_child_setup,
                )
            except OSError as exc:
                self.stop()
                raise WorkerStartError(f"cannot start rank {spec.rank} ({spec.argv[:2]}): {exc}") from exc
            finally:
                for f in files:
                    f.close()
            guard().watch(proc.pid)  # the worker leads its own session: pgid == pid
            prefix = f"[{self._role}{spec.local_rank}]:".encode()
            for kind_path, pipe, console in ((out, proc.stdout, sys.stdout), (err, proc.stderr, sys.stderr)):
                if kind_path[0] == "tee" and pipe is not None:
                    t = threading.Thread(target=_tee, args=(pipe, kind_path[1], console, prefix), daemon=True,
                                         name=f"tee-rank{spec.rank}")
                    t.start()
                    self._tee_threads.append(t)
            with self._lock:
                self._workers.append(Worker(spec=spec, proc=proc, started_at=time.time()))
        log.debug("started %d workers: pids %s", len(self._workers), [w.pid for w in self._workers])

    @property
    def workers(self) -> list[Worker]:
        """The started workers (a copy of the list; the Worker objects are live)."""
        with self._lock:
            return list(self._workers)

    def by_rank(self, rank: int) -> Worker | None:
        """The worker of global ``rank``, if it runs here."""
        for w in self.workers:
            if w.spec.rank == rank:
                return w
        return None

    def poll(self) -> list[Worker]:
        """Reaps finished workers and updates their states.

        Returns:
            Workers that ended since the previous call, in the order they were noticed.
        """
        ended = []
        for w in self.workers:
            if w.exit_code is not None:
                continue
            code = w.proc.poll()
            if code is None:
                continue
            w.exit_code = code
            w.ended_at = time.time()
            if w.state != WorkerState.STOPPED:
                w.state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
            ended.append(w)
        return ended

    def running(self) -> int:
        """Number of workers still alive."""
        return sum(1 for w in self.workers if w.proc.poll() is None)

    def all_succeeded(self) -> bool:
        """True when every worker exited with code 0."""
        ws = self.workers
        return bool(ws) and all(w.proc.poll() == 0 for w in ws)

    def stop(self, grace_s: float = 3.0, tick: Callable[[], None] | None = None) -> None:
        """Stops every worker: SIGTERM (then SIGCONT) to its process group, SIGKILL after ``grace_s`` seconds.

        A stopped (SIGSTOPped, or traced) worker only acts on SIGTERM once continued, so SIGCONT follows, as
        systemd does. Safe to call repeatedly and on a partly started group. Returns once every process is reaped.

        Args:
            grace_s: seconds between SIGTERM and SIGKILL.
            tick: called about every 0.1 s while waiting (the agent keeps its coordinator lease alive with it:
                a hung worker ignoring SIGTERM must not make the whole node look lost).
        """
        ws = self.workers
        for w in ws:
            if w.proc.poll() is None:
                w.state = WorkerState.STOPPED
                _signal_group(w.proc.pid, signal.SIGTERM)
                _signal_group(w.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for w in ws:
            while True:
                remaining = max(0.0, deadline - time.monotonic())
                try:
                    w.proc.wait(timeout=min(remaining, 0.1))
                    break
                except subprocess.TimeoutExpired:
                    if remaining <= 0.1:
                        _signal_group(w.proc.pid, signal.SIGKILL)
                        w.proc.wait()
                        break
                    if tick is not None:
                        tick()
            # Children the worker forked into its session (data loader processes...) go too.
            _signal_group(w.proc.pid, signal.SIGKILL)
            guard().forget(w.proc.pid)
        self.poll()

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Sends ``sig`` to the worker of ``rank`` only (fault injection, drills).

        Returns:
            The pid signalled.

        Raises:
            KeyError: no live worker with that rank here.
        """
        w = self.by_rank(rank)
        if w is None or w.proc.poll() is not None:
            raise KeyError(f"no live worker with rank {rank}")
        os.kill(w.pid, sig)
        return w.pid


def _standby_path(target: tuple[str, str | None]) -> str | None:
    """Where a standby sends a stream: a file, /dev/null, or None to keep the agent's console."""
    kind, path = target
    if kind == "null":
        return os.devnull
    return path if kind in ("file", "both") else None


def _popen_target(target: tuple[str, str | None], files: list):
    kind, path = target
    if kind == "null":
        return subprocess.DEVNULL
    if kind == "tee":
        return subprocess.PIPE
    if kind in ("file", "both") and path:
        f = open(path, "ab")
        files.append(f)
        return f
    return None


def _tee(pipe, path: str, console, prefix: bytes) -> None:
    """Copies a worker's stream line by line to its log file and, prefixed like torchrun's, to the console."""
    out = getattr(console, "buffer", None)
    with pipe, open(path, "ab", buffering=0) as f:
        for line in iter(pipe.readline, b""):
            f.write(line)
            if out is not None:
                try:
                    out.write(prefix + line)
                    out.flush()
                except (OSError, ValueError):
                    out = None  # the console went away; keep writing the file


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    guard().forget(proc.pid)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def python_argv(script: str, args: Sequence[str], module: bool = False, python: str | None = None) -> list[str]:
    """The command line of a worker running ``script`` (or ``-m module``) with ``python`` (default: this
    interpreter, the only one warm standbys can stand in for)."""
    exe = python or sys.executable
    if module:
        return [exe, "-u", "-m", script, *args]
    return [exe, "-u", script, *args]
