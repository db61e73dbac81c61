"""Silence and hangs under `trainguard run`: a worker that reports through the hook and then falls silent
before its first step is hung after ``startup_grace_s``; an unmodified script (no trainguard import, so no step
heartbeats ever) is never judged by silence, however long it runs (it was killed as hung after
``startup_grace_s``, 15 min by default, and again after each restart until the job failed); a long phase
between steps inside ``session.pause_hang_detection()`` is not a hang, and silence after it is judged again.

Real processes: the launcher, its embedded coordinator, the worker, with the process detector on the real /proc.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from tg_testutil import run_cli

GRACE_S = 2.0

PLAIN = """
import time
print("plain worker starts", flush=True)
time.sleep({run_s})  # trains without ever reporting a step
print("plain worker done", flush=True)
"""

HOOKED_SILENT = """
import time
import trainguard
session = trainguard.init()
print("hooked worker reached the hook", flush=True)
time.sleep(60)  # e.g. a rendezvous that never completes: no first step
"""


BETWEEN_STEPS = """
import time
import trainguard
session = trainguard.init()
for step in range(3):
    time.sleep(0.05)
    session.step_done(step)
{block}
for step in range({after}, {after} + 3):
    time.sleep(0.05)
    session.step_done(step)
session.close()
print("worker done", flush=True)
"""
HANG_FLOOR_S = 2.0
BLOCKS = {
    # 3x the hang bound without a step, inside the pause: not a hang; then, after steps 3..5, nested pauses: the
    # inner one's end does not resume detection inside the outer one (one launcher for both: each silence is
    # judged on its own, between steps, as in two runs)
    "paused-and-nested-paused": "with session.pause_hang_detection('evaluation'):\n"
                                f"    time.sleep({3 * HANG_FLOOR_S})\n"
                                "for step in range(3, 6):\n    time.sleep(0.05)\n    session.step_done(step)\n"
                                "with session.pause_hang_detection('evaluation'):\n"
                                "    with session.pause_hang_detection('export'):\n        time.sleep(0.5)\n"
                                f"    time.sleep({3 * HANG_FLOOR_S})",
    # the same without the pause: hung (the test can fail)
    "silent": f"time.sleep({3 * HANG_FLOOR_S})",
    # a short pause, then the same silence: hung, counted from the pause's end
    "paused-then-silent": f"with session.pause_hang_detection('evaluation'):\n    time.sleep(1)\n"
                          f"time.sleep({3 * HANG_FLOOR_S})",
}


def _run(tmp_path: Path, env: dict, script: str, *flags: str) -> "tuple[int, str]":
    # A job name of its own: the default name of worker.py would refuse a second launcher beside the first.
    flags = ("--job", f"hang-{tmp_path.name}-{os.getpid()}", *flags)
    (tmp_path / "detectors.toml").write_text(f"[process]\nstartup_grace_s = {GRACE_S}\n")
    (tmp_path / "worker.py").write_text(script)
    r = run_cli(["run", "--nproc-per-node", "1", "--no-standby", "--detector-config", str(tmp_path / "detectors.toml"),
                 *flags, str(tmp_path / "worker.py")], env, timeout=120)
    return r.returncode, r.stderr + r.stdout


def _run_side_by_side(tmp_path: Path, env: dict, runs: "dict[str, tuple]") -> "dict[str, tuple[int, str]]":
    """Runs each ``name -> (script, *flags)`` as :func:`_run` does, in a folder of its own, all at once: their
    waits overlap (each launcher judges only its own worker)."""
    for name in runs:
        (tmp_path / name).mkdir()
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_run, tmp_path / name, env, *args) for name, args in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_silence_before_the_first_step_is_hung_only_for_a_hooked_worker(tmp_path: Path, tg_env: dict) -> None:
    # Two launchers side by side: the plain worker sleeps through 4x the grace (no CPU) while the hooked one is
    # judged. The hooked one's hang is what shows the grace applies (the plain one's check can fail).
    got = _run_side_by_side(tmp_path, tg_env, {
        "plain": (PLAIN.format(run_s=4 * GRACE_S), "--max-restarts", "0"),
        "hooked": (HOOKED_SILENT, "--max-restarts", "0")})
    # A script without the hook is not hung for being silent.
    code, out = got["plain"]
    assert code == 0, out[-3000:]
    assert "plain worker done" in out and "0 fault(s)" in out, out[-3000:]
    assert "before its first step" not in out, out[-3000:]
    # A hooked worker silent before its first step is hung.
    code, out = got["hooked"]
    assert code != 0, out[-3000:]
    assert "hooked worker reached the hook" in out, out[-3000:]
    assert "sent no step heartbeat" in out and "before its first step" in out, out[-3000:]


def _between_steps(block: str) -> tuple:
    after = 6 if block == "paused-and-nested-paused" else 3  # the first step after the block
    return (BETWEEN_STEPS.format(block=BLOCKS[block], after=after), "--max-restarts", "0",
            "--hang-floor-s", str(HANG_FLOOR_S))


def test_a_long_phase_between_steps_is_no_hang_inside_a_pause(tmp_path: Path, tg_env: dict) -> None:
    # Alone: its pass (no fault) needs its 0.05 s steps on time, so no other launcher starts beside it.
    code, out = _run(tmp_path, tg_env, *_between_steps("paused-and-nested-paused"))
    assert code == 0 and "worker done" in out and "0 fault(s)" in out, out[-3000:]


def test_a_long_phase_between_steps_is_a_hang_outside_a_pause(tmp_path: Path, tg_env: dict) -> None:
    # Both hung (the pass above can fail), side by side: a late step only delays their hang, never prevents it.
    got = _run_side_by_side(tmp_path, tg_env, {block: _between_steps(block)
                                               for block in ("silent", "paused-then-silent")})
    for block, (code, out) in got.items():
        assert code != 0 and "worker done" not in out, (block, out[-3000:])
        assert "sent no step heartbeat" in out and "after step 2" in out, (block, out[-3000:])
