"""Stopping workers: a SIGSTOPped worker still dies on SIGTERM (SIGCONT follows it), and one that ignores SIGTERM
is killed after the grace while the caller's tick keeps running (the agent renews its lease from it)."""

from __future__ import annotations

import os
import signal
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


def test_worker_ignoring_sigterm_is_killed_after_grace_while_ticking() -> None:
    g = _group("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
               "while True: time.sleep(0.05)")
    time.sleep(0.5)
    ticks: list[float] = []
    t = time.monotonic()
    g.stop(grace_s=1.0, tick=lambda: ticks.append(time.monotonic()))
    took = time.monotonic() - t
    assert 0.9 <= took < 4.0 and g.workers[0].proc.returncode == -signal.SIGKILL
    assert len(ticks) >= 5 and max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5
