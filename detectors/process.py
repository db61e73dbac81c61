"""Process detector: liveness, exit codes and signals, uninterruptible sleep, memory growth and hangs of workers.

The agent feeds it through :class:`WorkerView`, returning one :class:`WorkerSnapshot` per local worker. Times in a
snapshot are ``time.monotonic()`` seconds of the agent's process (the detector runs in the same process).

A worker is **hung** when no step heartbeat arrived for longer than its bound::

    bound = max(hang_floor_s, hang_multiplier * max(recent_step_times))   after the first step time
    bound = startup_grace_s, counted from started_at                       before it
    no bound                                                               a worker that does not report

A worker that never speaks the hook (an unmodified torch script: no ``trainguard`` import, so no step
heartbeats, ever) cannot be judged by silence: with the start-up bound it was killed as hung after
``startup_grace_s`` however well it trained, and again after every restart until the job failed. The agent
says which workers report (``hooked``: this one reached the hook, or a worker of an earlier generation of the
job did); the others' hangs are left to torch's own collective timeouts, as under torchrun.

It is then reported once (``process.hung``, with the worker's stacks in the evidence, see
:mod:`trainguard.detectors.stackdump`) and cleared when heartbeats resume. The dump is taken in a helper thread
and the event leaves with the first sample after it completes (at most ``stack_timeout_s`` later), so a slow dump
never delays the exit reports of the other workers. An ended worker is reported once: from
``returncode`` when the agent reaped it, else from the exit status a zombie leaves in ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import collections
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from trainguard.detectors.base import Detector, DetectorConfig, DetectorState, Sample, register_detector
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.stackdump import STACK_DUMP_SIGNAL, dump_stack

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the agent knows about one local worker.

    Attributes:
        rank: global rank.
        pid: process id.
        started_at: ``time.monotonic()`` when the agent spawned it.
        last_step: last completed step reported by a heartbeat; -1 before the first.
        last_heartbeat: ``time.monotonic()`` of the latest step heartbeat; None before the first.
        recent_step_times: wall seconds of the latest steps (a few dozen, newest last).
        returncode: ``Popen.returncode`` once reaped (>= 0 exit code, < 0 killed by signal ``-N``); None while the
            agent has not reaped it.
        hooked: whether step heartbeats are to be expected from it (it reached the hook, or a worker of an
            earlier generation of its job did); False: a script that never reports, not judged by silence.
    """

    rank: int
    pid: int
    started_at: float
    last_step: int = -1
    last_heartbeat: float | None = None
    recent_step_times: Sequence[float] = ()
    returncode: int | None = None
    hooked: bool = True


@runtime_checkable
class WorkerView(Protocol):
    """Source of worker snapshots; the agent's supervisor implements it."""

    def workers(self) -> Sequence[WorkerSnapshot]:
        """The current local workers (ended ones included until the next generation)."""
        ...


@dataclass
class ProcessConfig(DetectorConfig):
    """Settings of the process detector.

    Attributes:
        interval_s: seconds between samples. Default 0.5 (a killed worker is reported within 1 s).
        hang_multiplier: hang bound as a multiple of the longest recent step time. Default 5.0.
        hang_floor_s: the hang bound is never below this, seconds. Default 60.0.
        startup_grace_s: seconds from spawn to first heartbeat before a worker counts as hung. Default 900.0.
        d_state_s: seconds a thread may sit in uninterruptible sleep (D) before it is reported. Default 30.0.
        d_state_check_s: seconds between scans of every thread's state (a torch worker has ~100). Default 10.0.
        memory_window_s: window over which RSS growth is measured, seconds, from a worker's first step (its
            start-up is not growth). Default 600.0.
        memory_growth_bytes: RSS growth within the window that is reported. Default 4 GiB.
        stack_dump: dump the stacks of a hung worker into the event. Default True.
        py_spy: use ``py-spy dump`` when installed (needs ptrace rights); else, or when it fails, the worker's
            faulthandler. Default True.
        stack_dir: directory of faulthandler dump files; empty means ``$TRAINGUARD_STACK_DIR`` or the temp dir.
        stack_timeout_s: seconds to wait for a stack dump. Default 2.0.
    """

    interval_s: float = 0.5
    hang_multiplier: float = 5.0
    hang_floor_s: float = 60.0
    startup_grace_s: float = 900.0
    d_state_s: float = 30.0
    d_state_check_s: float = 10.0
    memory_window_s: float = 600.0
    memory_growth_bytes: int = 4 << 30
    stack_dump: bool = True
    py_spy: bool = True
    stack_dir: str = ""
    stack_timeout_s: float = 2.0

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range.
        """
        super().validate()
        if self.hang_multiplier < 1:
            raise DetectorConfigError(f"process.hang_multiplier={self.hang_multiplier} must be >= 1")
        for name in ("hang_floor_s", "startup_grace_s", "d_state_s", "d_state_check_s", "memory_window_s",
                     "stack_timeout_s"):
            if not getattr(self, name) > 0:
                raise DetectorConfigError(f"process.{name}={getattr(self, name)} must be > 0 seconds")
        if self.memory_growth_bytes <= 0:
            raise DetectorConfigError(f"process.memory_growth_bytes={self.memory_growth_bytes} must be > 0")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the detector uses.

    Attributes:
        state: one-letter state (R, S, D, Z, T...).
        rss_bytes: resident set size.
        exit_code: wait status of a zombie (field 52), else 0.
    """

    state: str
    rss_bytes: int
    exit_code: int


def parse_proc_stat(text: str) -> ProcStat:
    """Parses ``/proc/<pid>/stat`` (proc(5)); the command name may hold spaces and parentheses.

    Args:
        text: the file's content.

    Returns:
        The parsed fields.

    Raises:
        ValueError: not in the proc(5) format.
    """
    _, sep, rest = text.rpartition(")")
    if not sep:
        raise ValueError("no ')' closing the command name")
    fields = rest.split()
    if len(fields) < 22:
        raise ValueError(f"{len(fields) + 2} fields, expected at least 24")
    exit_code = _stat_count(fields[49], "exit_code") if len(fields) > 49 else 0
    # A wait status (the kernel prints task->exit_code, an int): a larger one raised OverflowError out of the
    # sample in os.WIFSIGNALED().
    if exit_code > 0x7FFFFFFF:
        raise ValueError(f"field exit_code {exit_code} is no wait status")
    return ProcStat(state=fields[0], rss_bytes=_stat_count(fields[21], "rss") * _PAGE, exit_code=exit_code)


def _stat_count(text: str, name: str) -> int:
    """A non-negative field of ``/proc/<pid>/stat`` as the kernel prints it: int() also took '-5' (a negative
    RSS), '1_000' and, where the text was not decoded as ASCII, other scripts' digits."""
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise ValueError(f"field {name} {text[:40]!r} is not a count")
    return int(text)


def describe_returncode(code: int) -> str:
    """Human text of a ``Popen.returncode``.

    Args:
        code: >= 0 exit code, < 0 killed by signal ``-code``.

    Returns:
        E.g. ``"exit code 1"`` or ``"killed by SIGKILL"``.
    """
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def wait_status_to_returncode(status: int) -> int:
    """Converts a waitpid(2) status to ``Popen.returncode`` form.

    Args:
        status: raw wait status.

    Returns:
        Exit code, or minus the terminating signal.
    """
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class _PendingDump:
    """A hung worker's stack dump, taken in a helper thread; the hang event waits for it."""

    def __init__(self, message: str, evidence: dict[str, object]) -> None:
        self.message = message
        self.evidence = evidence
        self._thread: threading.Thread | None = None

    def start(self, pid: int, config: "ProcessConfig") -> None:
        """Starts the dump in a daemon thread.

        Args:
            pid: the hung worker.
            config: where and how long to dump.
        """

        def run() -> None:
            dump = dump_stack(pid, directory=config.stack_dir or None, signum=STACK_DUMP_SIGNAL,
                              timeout_s=config.stack_timeout_s, use_py_spy=config.py_spy,
                              proc_root=config.path("/proc"))
            self.evidence["stack_method"] = dump.method
            self.evidence["stack"] = dump.text

        self._thread = threading.Thread(target=run, name=f"trainguard-stackdump-{pid}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether the dump finished (or was never started because dumps are off)."""
        return self._thread is None or not self._thread.is_alive()


@register_detector
class ProcessDetector(Detector):
    """Watches the local training workers the agent supervises."""

    name: ClassVar[str] = "process"
    config_class: ClassVar[type[DetectorConfig]] = ProcessConfig
    default_interval_s: ClassVar[float] = 0.5
    accepts_worker_view: ClassVar[bool] = True

    def __init__(self, config: ProcessConfig | None = None, worker_view: WorkerView | None = None) -> None:
        """Creates the detector.

        Args:
            config: settings.
            worker_view: the agent's workers; attach later with :meth:`attach` if not known yet.
        """
        super().__init__(config)
        self.config: ProcessConfig
        self._view = worker_view
        self._ended: set[tuple[int, int]] = set()
        self._rss: dict[int, collections.deque[tuple[float, int]]] = {}
        self._d_since: dict[tuple[int, int], float] = {}
        self._dumps: dict[str, _PendingDump] = {}
        self._d_checked = 0.0

    def attach(self, worker_view: WorkerView | None) -> None:
        """Sets (or removes, with None) the source of worker snapshots.

        Args:
            worker_view: the agent's supervisor.
        """
        self._view = worker_view

    @staticmethod
    def hang_bound(snapshot: WorkerSnapshot, config: ProcessConfig) -> tuple[float, float]:
        """The heartbeat silence after which a worker counts as hung.

        Args:
            snapshot: the worker.
            config: detector settings.

        Returns:
            ``(bound_s, since)``: the bound in seconds and the monotonic time silence is counted from.
        """
        if snapshot.last_heartbeat is None:
            return (config.startup_grace_s if snapshot.hooked else math.inf), snapshot.started_at
        times = [t for t in snapshot.recent_step_times if t >= 0]
        if not times:
            return config.startup_grace_s, snapshot.last_heartbeat
        return max(config.hang_floor_s, config.hang_multiplier * max(times)), snapshot.last_heartbeat

    def sample(self) -> Sample:
        """Checks every worker once.

        Returns:
            Per-worker metrics, events for exits, hangs, D state and memory growth.
        """
        if self._view is None:
            return self.no_hardware("no worker view attached (the agent attaches one when it supervises workers)")
        cfg = self.config
        now = time.monotonic()
        s = Sample()
        workers = list(self._view.workers())
        alive = 0
        max_age = 0.0
        max_rss = 0
        scan_threads = now - self._d_checked >= cfg.d_state_check_s
        if scan_threads:
            self._d_checked = now
        pids = set()
        for w in workers:
            subject = f"rank:{w.rank}"
            pids.add(w.pid)
            code = w.returncode
            try:
                stat = self._stat(w.pid)
            except DetectorReadError as exc:
                if code is None:
                    # Neither alive nor ended as far as can be told: not judged this sample. Taken as gone, it was
                    # reported vanished (a restart asked for) and never judged again, hung or not.
                    s.error(exc)
                    continue
                stat = None
            if code is None and stat is not None and stat.state in ("Z", "X"):
                code = wait_status_to_returncode(stat.exit_code)
            if code is None and stat is None:
                self._report_end(s, w, None)
                self._clear_worker(w)
                s.worsen(DetectorState.FAILED, f"worker rank {w.rank} (pid {w.pid}) is gone")
                continue
            if code is not None:
                self._report_end(s, w, code)
                self._clear_worker(w)
                if code != 0:
                    s.worsen(DetectorState.FAILED, f"worker rank {w.rank} ended: {describe_returncode(code)}")
                continue
            alive += 1
            assert stat is not None
            max_rss = max(max_rss, stat.rss_bytes)
            s.metrics[f"rss_bytes[{subject}]"] = float(stat.rss_bytes)
            bound, since = self.hang_bound(w, cfg)
            age = now - since
            max_age = max(max_age, age)
            s.metrics[f"heartbeat_age_s[{subject}]"] = age
            if math.isfinite(bound):  # none for a worker that does not report
                s.metrics[f"hang_bound_s[{subject}]"] = bound
            self._check_hang(s, w, age, bound)
            if w.last_heartbeat is not None or not w.hooked:
                # Growth counts from the first step on: start-up (torch and CUDA libraries, a checkpoint loaded
                # to host memory) grew every worker by gigabytes within minutes, and each start raised
                # process.memory_growth and asked for a checkpoint. A worker that never reports is measured
                # from the start, as before.
                self._check_memory(s, w, stat.rss_bytes, now)
            if scan_threads:
                self._check_d_state(s, w, now)
        for pid in list(self._rss):
            if pid not in pids:
                del self._rss[pid]
        s.metrics.update(
            {"workers": float(len(workers)), "workers_alive": float(alive), "max_heartbeat_age_s": max_age,
             "max_rss_bytes": float(max_rss)}
        )
        if not workers:
            s.detail = "no workers"
        return s

    def _stat(self, pid: int) -> ProcStat | None:
        """The worker's ``/proc/<pid>/stat``; None when the process is gone (no such file, or ESRCH: reaped while
        read).

        Raises:
            DetectorReadError: it exists but cannot be read (permission denied, I/O error) or is not in the proc(5)
                format; the worker may well be alive, so this is no verdict on it.
        """
        path = self.config.path(f"/proc/{pid}/stat")
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return parse_proc_stat(f.read())
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError as exc:
            raise DetectorReadError(path, f"cannot read ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise DetectorReadError(path, f"not in the proc(5) format: {exc}") from exc

    def _report_end(self, s: Sample, w: WorkerSnapshot, code: int | None) -> None:
        key = (w.rank, w.pid)
        if key in self._ended:
            return
        # Reported once: one_off(), so a sample that raises after this still delivers it (see Detector.one_off).
        self._ended.add(key)
        subject = f"rank:{w.rank}"
        evidence = {"rank": w.rank, "pid": w.pid, "last_step": w.last_step}
        if code is None:
            self.one_off(s, self.event("process.vanished", Severity.ERROR, Action.RESTART_PROCESS,
                                       f"worker rank {w.rank} (pid {w.pid}) is gone and its exit status is unknown",
                                       subject, evidence))
        elif code == 0:
            self.one_off(s, self.event("process.exited", Severity.INFO, Action.NONE,
                                       f"worker rank {w.rank} (pid {w.pid}) exited cleanly", subject,
                                       {**evidence, "returncode": 0}))
        else:
            kind = "process.killed" if code < 0 else "process.failed"
            evidence["returncode"] = code
            if code < 0:
                evidence["signal"] = describe_returncode(code).removeprefix("killed by ")
            self.one_off(s, self.event(kind, Severity.ERROR, Action.RESTART_PROCESS,
                                       f"worker rank {w.rank} (pid {w.pid}) ended: {describe_returncode(code)}",
                                       subject, evidence))

    def _clear_worker(self, w: WorkerSnapshot) -> None:
        # An ended worker is not also hung or leaking; drop its open conditions silently.
        for key in [k for k in self._active if k.endswith(f"/{w.pid}")]:
            del self._active[key]
        for key in [k for k in self._dumps if k.endswith(f"/{w.pid}")]:
            del self._dumps[key]

    def _check_hang(self, s: Sample, w: WorkerSnapshot, age: float, bound: float) -> None:
        key = f"hung/{w.rank}/{w.pid}"
        hung = age > bound
        phase = "before its first step" if w.last_heartbeat is None else f"after step {w.last_step}"
        message = (f"worker rank {w.rank} (pid {w.pid}) sent no step heartbeat for {age:.1f} s {phase} "
                   f"(bound {bound:.1f} s)")
        if not hung:
            self._dumps.pop(key, None)  # heartbeats resumed before the dump finished: a transient, no event
            self.condition(s, key, False, "process.hung", Severity.ERROR, Action.RESTART_PROCESS, message,
                           f"rank:{w.rank}")
            return
        if key in self._active:
            s.worsen(DetectorState.FAILED, message)
            return
        pending = self._dumps.get(key)
        if pending is None:
            evidence: dict[str, object] = {
                "rank": w.rank, "pid": w.pid, "last_step": w.last_step, "silent_s": f"{age:.3f}",
                "bound_s": f"{bound:.3f}",
                "max_step_time_s": f"{max(w.recent_step_times):.3f}" if w.recent_step_times else "",
            }
            pending = _PendingDump(message, evidence)
            if self.config.stack_dump:
                # Dumping takes up to stack_timeout_s (py-spy, or waiting for the worker's file); do it aside so
                # that the other workers' exits are still reported within one interval.
                pending.start(w.pid, self.config)
            self._dumps[key] = pending
        s.worsen(DetectorState.FAILED, message)
        if not pending.done():
            return
        del self._dumps[key]
        self.condition(s, key, True, "process.hung", Severity.ERROR, Action.RESTART_PROCESS, pending.message,
                       f"rank:{w.rank}", pending.evidence)

    def _check_memory(self, s: Sample, w: WorkerSnapshot, rss: int, now: float) -> None:
        window = self._rss.setdefault(w.pid, collections.deque())
        # Growth over minutes needs no sub-second history: keep one point per 1/60 of the window.
        if not window or now - window[-1][0] >= self.config.memory_window_s / 60:
            window.append((now, rss))
        while window and now - window[0][0] > self.config.memory_window_s:
            window.popleft()
        growth = rss - min(min(v for _, v in window), rss)
        s.metrics[f"rss_growth_bytes[rank:{w.rank}]"] = float(growth)
        self.condition(s, f"memory/{w.rank}/{w.pid}", growth > self.config.memory_growth_bytes,
                       "process.memory_growth", Severity.WARNING, Action.CHECKPOINT_NOW,
                       f"worker rank {w.rank} (pid {w.pid}) grew by {growth / 2**20:.0f} MiB within "
                       f"{self.config.memory_window_s:.0f} s", f"rank:{w.rank}",
                       {"rss_bytes": rss, "growth_bytes": growth})

    def _check_d_state(self, s: Sample, w: WorkerSnapshot, now: float) -> None:
        task_dir = self.config.path(f"/proc/{w.pid}/task")
        stuck: list[str] = []
        seen = set()
        try:
            tids = os.listdir(task_dir)
        except OSError:
            tids = []
        for tid in tids:
            # Only thread ids: int() of any other entry raised ValueError out of the whole sample, and with it went
            # every other worker's report of that sample (a fake or overlaid /proc, a future kernel's entry).
            if not (tid.isascii() and tid.isdigit()):
                continue
            stat = self._stat_task(task_dir, tid)
            key = (w.pid, int(tid))
            if stat is None or stat.state != "D":
                continue
            seen.add(key)
            since = self._d_since.setdefault(key, now)
            if now - since >= self.config.d_state_s:
                stuck.append(tid)
        for key in [k for k in self._d_since if k[0] == w.pid and k not in seen]:
            del self._d_since[key]
        evidence: dict[str, object] = {"rank": w.rank, "pid": w.pid, "tids": ",".join(stuck)}
        for tid in stuck[:4]:
            for name in ("wchan", "stack"):
                try:
                    with open(os.path.join(task_dir, tid, name), encoding="ascii", errors="replace") as f:
                        evidence[f"{name}.{tid}"] = f.read()[-2000:]
                except OSError:
                    pass
        self.condition(s, f"dstate/{w.rank}/{w.pid}", bool(stuck), "process.uninterruptible", Severity.WARNING,
                       Action.WATCH, f"worker rank {w.rank} (pid {w.pid}) has {len(stuck)} thread(s) in "
                       f"uninterruptible sleep for over {self.config.d_state_s:.0f} s", f"rank:{w.rank}", evidence)

    @staticmethod
    def _stat_task(task_dir: str, tid: str) -> ProcStat | None:
        try:
            with open(os.path.join(task_dir, tid, "stat"), encoding="ascii", errors="replace") as f:
                return parse_proc_stat(f.read())
        except (OSError, ValueError):
            return None
