"""Stopping workers: a SIGSTOPped worker still dies on SIGTERM (SIGCONT follows it), and one that ignores SIGTERM
is killed after the grace while the caller's tick keeps running (the agent renews its lease from it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainguard.agent.workers import WorkerGroup, WorkerSpec


def _group(code: str) -> WorkerGroup:
    g = WorkerGroup([WorkerSpec(rank=0, local_rank=0, argv=[sys.executable, "-c", code], env=dict(os.environ))])
    g.start()
    return g


def test_stopped_worker_gets_sigterm_at_once() -> None:
    g = _group("import time\nwhile True: time.sleep(0.05)")
    time.sleep(0.3)
    pid = g.workers[0].pid
    os.kill(pid, signal.SIGSTOP)
    t = time.monotonic()
    g.stop(grace_s=10.0)
    assert time.monotonic() - t < 5.0  # SIGTERM acted on without waiting for the 10 s grace
    assert g.workers[0].proc.returncode == -signal.SIGTERM


def test_worker_ignoring_sigterm_is_killed_after_grace_while_ticking(tmp_path) -> None:
    ready = tmp_path / "ready"
    g = _group("import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               f"pathlib.Path({str(ready)!r}).touch()\nwhile True: time.sleep(0.05)")
    deadline = time.monotonic() + 30  # an interpreter starts in seconds on a loaded box, not in 0.5 s
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), "the worker never started"
    ticks: list[float] = []
    t = time.monotonic()
    g.stop(grace_s=1.0, tick=lambda: ticks.append(time.monotonic()))
    took = time.monotonic() - t
    assert 0.9 <= took < 4.0 and g.workers[0].proc.returncode == -signal.SIGKILL
    assert len(ticks) >= 5 and max(b - a for a, b in zip(ticks, ticks[1:])) < 2.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_die_with_an_agent_that_is_sigkilled(tmp_path) -> None:
    """A worker leads its own session, so no signal of the agent's end reaches it by itself: the guard process
    (agent/guard.py) and PR_SET_PDEATHSIG take it down. A surviving worker would hold its GPU and rank against
    the restarted agent. Behaviour only; the next test pins the death signal alone."""
    agent = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, threading, time\n"
         "from trainguard.agent.workers import WorkerGroup, WorkerSpec\n"
         "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a threaded agent\n"
         "g = WorkerGroup([WorkerSpec(0, 0, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)'],"
         " dict(os.environ))])\n"
         "g.start()\nprint(g.workers[0].pid, flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    worker = 0
    try:
        worker = int(agent.stdout.readline())
        assert _alive(worker)
        agent.kill()
        agent.wait(30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(worker), "the worker outlived its SIGKILLed agent"
    finally:
        agent.kill()
        agent.wait(30)
        agent.stdout.close()
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_is_started_with_sigkill_as_its_parent_death_signal() -> None:
    """The guard process above kills a dead agent's process groups; PR_SET_PDEATHSIG is the second line, for a
    guard that is gone too. It is set between fork and exec from a prctl looked up before the fork."""
    from trainguard.agent.workers import child_setup

    code = ("import ctypes, sys\n"
            "sig = ctypes.c_int(-1)\n"
            "ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG\n"
            "print(sig.value)\n")
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=child_setup, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == signal.SIGKILL
