"""Process detector on real worker subprocesses: kill -9, clean exit, hang with a stack dump, D-state parsing."""

from __future__ import annotations

import math
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from trainguard.detectors.base import DetectorState
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.process import (
    ProcessConfig,
    ProcessDetector,
    WorkerSnapshot,
    WorkerView,
    parse_proc_stat,
)
from trainguard.detectors.runner import DetectorRunner

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from trainguard.detectors.stackdump import install_stack_dump_handler
    install_stack_dump_handler(sys.argv[1])
    steps, step_s = int(sys.argv[2]), float(sys.argv[3])

    def stuck_in_collective():
        while True:
            time.sleep(3600)

    for step in range(steps):
        t = time.monotonic()
        time.sleep(step_s)
        print(f"step {step} {time.monotonic() - t:.4f}", flush=True)
    if sys.argv[4] == "hang":
        stuck_in_collective()
    """
)


class PipeWorkers:
    """A WorkerView over real subprocesses whose heartbeats are lines on their stdout."""

    def __init__(self, reap: bool) -> None:
        self.reap = reap
        self.procs: list[subprocess.Popen[str]] = []
        self.snaps: dict[int, WorkerSnapshot] = {}
        self.lock = threading.Lock()

    def spawn(self, rank: int, tmp: str, steps: int, step_s: float, mode: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-c", WORKER, tmp, str(steps), str(step_s), mode],
            stdout=subprocess.PIPE, text=True,
        )
        self.procs.append(p)
        with self.lock:
            self.snaps[rank] = WorkerSnapshot(rank=rank, pid=p.pid, started_at=time.monotonic())
        threading.Thread(target=self._read, args=(rank, p), daemon=True).start()
        return p

    def _read(self, rank: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            _, step, dt = line.split()
            with self.lock:
                s = self.snaps[rank]
                times = (tuple(s.recent_step_times) + (float(dt),))[-20:]
                self.snaps[rank] = replace(s, last_step=int(step), last_heartbeat=time.monotonic(),
                                           recent_step_times=times)

    def workers(self) -> list[WorkerSnapshot]:
        with self.lock:
            out = []
            for rank, s in self.snaps.items():
                p = next(p for p in self.procs if p.pid == s.pid)
                code = p.poll() if self.reap else None
                out.append(replace(s, returncode=code))
            return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)


@pytest.fixture
def workers_factory(tmp_path) -> Iterator:
    made: list[PipeWorkers] = []

    def make(reap: bool) -> PipeWorkers:
        w = PipeWorkers(reap)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def wait_for(q: "queue.Queue[HealthEvent]", kind: str, timeout: float) -> HealthEvent:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind} event within {timeout} s")
        try:
            ev = q.get(timeout=left)
        except queue.Empty:
            continue
        if ev.kind == kind:
            return ev


def test_worker_view_protocol_is_satisfied_by_a_plain_class() -> None:
    assert isinstance(PipeWorkers(reap=True), WorkerView)


@pytest.mark.parametrize("reap", [False, True], ids=["zombie", "reaped"])
def test_killed_worker_is_reported_once_with_its_signal(workers_factory, tmp_path, reap: bool) -> None:
    # Latency (one 0.2 s sample) is measured in bench/bench_detectors.py; here only a bound a loaded CI box keeps.
    view = workers_factory(reap)
    p = view.spawn(0, str(tmp_path), 100000, 0.05, "run")
    q: queue.Queue[HealthEvent] = queue.Queue()
    det = ProcessDetector(ProcessConfig(interval_s=0.2), worker_view=view)
    with DetectorRunner([det], on_event=q.put) as runner:
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        ev = wait_for(q, "process.killed", 5.0)
        latency = time.monotonic() - killed_at
        assert latency < 5.0, f"kill reported after {latency:.3f} s"
        assert ev.severity == Severity.ERROR and ev.action == Action.RESTART_PROCESS
        assert ev.evidence["signal"] == "SIGKILL" and ev.evidence["returncode"] == "-9"
        assert ev.subject == "rank:0"
        time.sleep(0.3)
        status = runner.statuses()[0]
        assert status.state == DetectorState.FAILED
        assert runner.latest_metrics()["process.workers_alive"] == 0.0
    # Reported once, not on every sample.
    assert all(e.kind != "process.killed" for e in list(q.queue))


def test_clean_exit_is_info(workers_factory, tmp_path) -> None:
    view = workers_factory(True)
    p = view.spawn(3, str(tmp_path), 2, 0.01, "run")
    p.wait(20)
    det = ProcessDetector(ProcessConfig(), worker_view=view)
    s = det.sample()
    assert [e.kind for e in s.events] == ["process.exited"]
    assert s.events[0].severity == Severity.INFO and s.state == DetectorState.OK


def test_hung_worker_reported_after_its_learned_bound_with_stack(workers_factory, tmp_path) -> None:
    view = workers_factory(True)
    # Steps of ~0.1 s: bound = max(floor 0.6, 4 x ~0.1) = 0.6 s.
    view.spawn(1, str(tmp_path), 8, 0.1, "hang")
    cfg = ProcessConfig(interval_s=0.1, hang_multiplier=4.0, hang_floor_s=0.6, startup_grace_s=30.0,
                        stack_dir=str(tmp_path))
    q: queue.Queue[HealthEvent] = queue.Queue()
    with DetectorRunner([ProcessDetector(cfg, worker_view=view)], on_event=q.put):
        ev = wait_for(q, "process.hung", 30.0)
    last_hb = view.workers()[0].last_heartbeat
    assert last_hb is not None
    bound = float(ev.evidence["bound_s"])
    silent = float(ev.evidence["silent_s"])
    # Loaded CI boxes oversleep the worker's 0.1 s steps and delay the 0.1 s sampler: the bound and the report
    # must follow the rule (floor, after the bound), not this machine's idle timing.
    assert bound >= 0.6
    assert bound < silent < bound + 5.0, f"hang reported after {silent:.2f} s, bound {bound:.2f} s"
    assert ev.evidence["last_step"] == "7"
    assert ev.evidence["stack_method"] in ("faulthandler", "py-spy")
    assert "stuck_in_collective" in ev.evidence["stack"], ev.evidence["stack"]


def test_hang_clears_when_heartbeats_resume() -> None:
    class View:
        snap = WorkerSnapshot(rank=0, pid=os.getpid(), started_at=time.monotonic() - 10, last_step=5,
                              last_heartbeat=time.monotonic() - 5, recent_step_times=(0.1, 0.2))

        def workers(self):
            return [self.snap]

    view = View()
    det = ProcessDetector(ProcessConfig(hang_floor_s=1.0, hang_multiplier=2.0, stack_dump=False), worker_view=view)
    s = det.sample()
    assert [e.kind for e in s.events] == ["process.hung"] and s.state == DetectorState.FAILED
    assert s.metrics["hang_bound_s[rank:0]"] == 1.0
    assert det.sample().events == []  # edge-triggered
    view.snap = replace(view.snap, last_step=6, last_heartbeat=time.monotonic())
    s = det.sample()
    assert [e.kind for e in s.events] == ["process.hung.cleared"] and s.state == DetectorState.OK


def test_startup_grace_applies_before_first_heartbeat() -> None:
    snap = WorkerSnapshot(rank=0, pid=os.getpid(), started_at=time.monotonic() - 5)
    cfg = ProcessConfig(startup_grace_s=10.0, hang_floor_s=1.0, stack_dump=False)
    assert ProcessDetector.hang_bound(snap, cfg) == (10.0, snap.started_at)
    withsteps = replace(snap, last_heartbeat=1.0, recent_step_times=(3.0, 2.0))
    assert ProcessDetector.hang_bound(withsteps, replace(cfg, hang_multiplier=5.0)) == (15.0, 1.0)
    # a worker that does not report (a script without the hook) has no bound: silence says nothing about it
    assert ProcessDetector.hang_bound(replace(snap, hooked=False), cfg) == (math.inf, snap.started_at)


def test_memory_growth_reported() -> None:
    class View:
        def workers(self):
            return [WorkerSnapshot(rank=2, pid=child.pid, started_at=time.monotonic(), last_step=1,
                                   last_heartbeat=time.monotonic(), recent_step_times=(0.5,))]

    child = subprocess.Popen([sys.executable, "-c",
                              "import sys,time\nb=[]\nfor l in sys.stdin:\n b.append(bytearray(32<<20))\n"
                              " print('ok',flush=True)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        det = ProcessDetector(ProcessConfig(memory_growth_bytes=48 << 20, stack_dump=False), worker_view=View())
        assert det.sample().events == []
        for _ in range(3):
            child.stdin.write("x\n")
            child.stdin.flush()
            child.stdout.readline()
        s = det.sample()
        assert [e.kind for e in s.events] == ["process.memory_growth"]
        assert int(s.events[0].evidence["growth_bytes"]) > 48 << 20
        assert s.state == DetectorState.DEGRADED
    finally:
        child.kill()
        child.wait()


def test_start_up_memory_is_no_growth_only_what_comes_after_the_first_step() -> None:
    """A worker grows by gigabytes while it starts (torch and CUDA libraries, a checkpoint read into host memory):
    counted as growth, every start raised process.memory_growth and asked for a checkpoint. Growth now counts
    from the first step heartbeat on."""
    heartbeat: list[float | None] = [None]

    class View:
        def workers(self):
            return [WorkerSnapshot(rank=2, pid=child.pid, started_at=t0, last_heartbeat=heartbeat[0],
                                   last_step=-1 if heartbeat[0] is None else 1, recent_step_times=(0.5,))]

    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys,time\nb=[]\nfor l in sys.stdin:\n b.append(bytearray(32<<20))\n"
                              " print('ok',flush=True)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def grow(chunks: int) -> None:
        for _ in range(chunks):
            child.stdin.write("x\n")
            child.stdin.flush()
            child.stdout.readline()

    try:
        det = ProcessDetector(ProcessConfig(memory_growth_bytes=48 << 20, stack_dump=False), worker_view=View())
        assert det.sample().events == []
        grow(3)  # 96 MiB while starting
        s = det.sample()
        assert s.events == [] and s.state == DetectorState.OK, [e.message for e in s.events]
        heartbeat[0] = time.monotonic()  # the first step
        assert det.sample().events == []
        grow(3)  # 96 MiB after it: growth
        assert [e.kind for e in det.sample().events] == ["process.memory_growth"]
    finally:
        child.kill()
        child.wait()


def test_no_view_means_no_hardware() -> None:
    s = ProcessDetector().sample()
    assert s.state == DetectorState.NO_HARDWARE and "worker view" in s.detail


def test_parse_proc_stat_handles_odd_command_names_and_zombies() -> None:
    fields = ["Z"] + ["0"] * 20 + ["100"] + ["0"] * 27 + ["9"]
    st = parse_proc_stat("1234 (a ) b (c)) " + " ".join(fields))
    assert st.state == "Z" and st.rss_bytes == 100 * os.sysconf("SC_PAGE_SIZE") and st.exit_code == 9
    with pytest.raises(ValueError):
        parse_proc_stat("1234 (truncated")
    with pytest.raises(ValueError):
        parse_proc_stat("1234 (x) S 1 2")


def test_d_state_thread_reported_with_fake_proc(tmp_path) -> None:
    pid = 4242
    task = tmp_path / "proc" / str(pid) / "task"
    for tid, state in ((4242, "S"), (4250, "D")):
        d = task / str(tid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{tid} (python3) {state} " + " ".join(["0"] * 49) + "\n")
        (d / "wchan").write_text("nfs_wait_on_request")
    (tmp_path / "proc" / str(pid) / "stat").write_text(f"{pid} (python3) S " + " ".join(["0"] * 49) + "\n")

    class View:
        def workers(self):
            return [WorkerSnapshot(rank=0, pid=pid, started_at=time.monotonic())]

    det = ProcessDetector(ProcessConfig(root=str(tmp_path), d_state_s=0.05, d_state_check_s=0.01,
                                        stack_dump=False), worker_view=View())
    assert det.sample().events == []
    time.sleep(0.1)
    s = det.sample()
    assert [e.kind for e in s.events] == ["process.uninterruptible"]
    assert s.events[0].evidence["tids"] == "4250"
    assert s.events[0].evidence["wchan.4250"] == "nfs_wait_on_request"


def test_an_entry_of_the_task_folder_that_is_no_thread_id_is_skipped(tmp_path) -> None:
    """``/proc/<pid>/task`` holds one folder per thread id. The thread scan took int() of every entry: anything
    else there (a fake or overlaid /proc) raised ValueError out of the sample, and the D-state thread beside it,
    and every other worker's report, went unreported. Now such an entry is skipped."""
    pid = 4242
    task = tmp_path / "proc" / str(pid) / "task"
    for tid, state in ((4242, "S"), (4250, "D")):
        d = task / str(tid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{tid} (python3) {state} " + " ".join(["0"] * 49) + "\n")
    for stray in ("x", "4250.old", "\u0664\u0662"):  # not thread ids; the last is Arabic-Indic digits
        (task / stray).mkdir()
    (tmp_path / "proc" / str(pid) / "stat").write_text(f"{pid} (python3) S " + " ".join(["0"] * 49) + "\n")

    class View:
        def workers(self):
            return [WorkerSnapshot(rank=0, pid=pid, started_at=time.monotonic())]

    det = ProcessDetector(ProcessConfig(root=str(tmp_path), d_state_s=0.05, d_state_check_s=0.01,
                                        stack_dump=False), worker_view=View())
    deadline = time.monotonic() + 5
    events: list[HealthEvent] = []
    while not events and time.monotonic() < deadline:
        s = det.sample()
        assert s.errors == [] and s.state != DetectorState.ERROR, s.detail
        events = s.events
        time.sleep(0.02)
    assert [e.kind for e in events] == ["process.uninterruptible"]
    assert events[0].evidence["tids"] == "4250"


@pytest.mark.parametrize("bad", [
    "4242 (python3 S 1 2 3",  # truncated: no ')' closing the command name
    "4242 (python3) Z " + " ".join(["0"] * 48) + " 99999999999999999999",  # a zombie's exit status past an int
])
def test_a_stat_file_that_cannot_be_read_is_a_read_error_not_a_vanished_worker(tmp_path, bad: str) -> None:
    """A worker's /proc/<pid>/stat that exists but is not in the proc(5) format was taken for a process that is
    gone: process.vanished (a restart asked for), and the worker never judged again. A zombie's exit status past
    an int raised OverflowError out of the sample. Both are read errors naming the file now, and the worker is
    judged once its file reads again."""
    pid = 4242
    stat = tmp_path / "proc" / str(pid) / "stat"
    stat.parent.mkdir(parents=True)
    stat.write_text(bad + "\n")

    class View:
        def workers(self):
            return [WorkerSnapshot(rank=0, pid=pid, started_at=time.monotonic())]

    det = ProcessDetector(ProcessConfig(root=str(tmp_path), stack_dump=False), worker_view=View())
    runner = DetectorRunner([det])
    events = runner.run_once()
    assert [(e.kind, e.subject) for e in events] == [("detector.error", str(stat))], [e.message for e in events]
    assert runner.statuses()[0].state == DetectorState.ERROR
    stat.write_text(f"{pid} (python3) Z " + " ".join(["0"] * 48) + f" {9 << 8}\n")  # exited with code 9
    events = runner.run_once()
    assert [e.kind for e in events] == ["process.failed", "detector.error.cleared"]
    assert events[0].evidence["returncode"] == "9"


def test_slow_stack_dump_does_not_delay_another_workers_kill_report(tmp_path) -> None:
    # Rank 0 catches the dump signal but never writes a dump: the dump waits its full timeout (3 s).
    silent = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                               "signal.signal(signal.SIGUSR2, lambda *a: None)\nprint('ready', flush=True)\n"
                               "time.sleep(3600)"], stdout=subprocess.PIPE, text=True)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        assert silent.stdout.readline().strip() == "ready"
        t0 = time.monotonic()

        class View:
            def workers(self):
                return [WorkerSnapshot(rank=0, pid=silent.pid, started_at=t0 - 10),
                        WorkerSnapshot(rank=1, pid=victim.pid, started_at=t0, returncode=victim.poll())]

        q: queue.Queue[HealthEvent] = queue.Queue()
        cfg = ProcessConfig(interval_s=0.1, startup_grace_s=5.0, stack_timeout_s=3.0, stack_dir=str(tmp_path),
                            py_spy=False)
        with DetectorRunner([ProcessDetector(cfg, worker_view=View())], on_event=q.put):
            time.sleep(0.3)  # rank 0 is past its grace: its dump has started
            killed_at = time.monotonic()
            victim.kill()
            wait_for(q, "process.killed", 5.0)
            # not stuck behind rank 0's dump, which gives up only after its 3 s stack_timeout_s (slack for load)
            assert time.monotonic() - killed_at < 2.5
            hung = wait_for(q, "process.hung", 10.0)
        assert hung.evidence["stack_method"] == "none" and "did not write" in hung.evidence["stack"]
    finally:
        for p in (silent, victim):
            p.kill()
            p.wait()
