"""Silence and hangs under `trainguard run`: a worker that reports through the hook and then falls silent
before its first step is hung after ``startup_grace_s``; an unmodified script (no trainguard import, so no step
heartbeats ever) is never judged by silence, however long it runs (it was killed as hung after
``startup_grace_s``, 15 min by default, and again after each restart until the job failed); a long phase
between steps inside ``session.pause_hang_detection()`` is not a hang, and silence after it is judged again.

Real processes: the launcher, its embedded coordinator, the worker, with the process detector on the real /proc.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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
    (tmp_path / "detectors.toml").write_text(f"[process]\nstartup_grace_s = {GRACE_S}\n")
    (tmp_path / "worker.py").write_text(script)
    r = run_cli(["run", "--nproc-per-node", "1", "--no-standby", "--detector-config", str(tmp_path / "detectors.toml"),
                 *flags, str(tmp_path / "worker.py")], env, timeout=120)
    return r.returncode, r.stderr + r.stdout


def test_a_script_without_the_hook_is_not_hung_for_being_silent(tmp_path: Path, tg_env: dict) -> None:
    code, out = _run(tmp_path, tg_env, PLAIN.format(run_s=4 * GRACE_S), "--max-restarts", "0")
    assert code == 0, out[-3000:]
    assert "plain worker done" in out and "0 fault(s)" in out, out[-3000:]
    assert "before its first step" not in out, out[-3000:]


def test_a_hooked_worker_silent_before_its_first_step_is_hung(tmp_path: Path, tg_env: dict) -> None:
    code, out = _run(tmp_path, tg_env, HOOKED_SILENT, "--max-restarts", "0")
    assert code != 0, out[-3000:]
    assert "hooked worker reached the hook" in out, out[-3000:]
    assert "sent no step heartbeat" in out and "before its first step" in out, out[-3000:]


@pytest.mark.parametrize("block", list(BLOCKS))
def test_a_long_phase_between_steps_is_no_hang_inside_a_pause_only(tmp_path: Path, tg_env: dict, block: str) -> None:
    after = 6 if block == "paused-and-nested-paused" else 3  # the first step after the block
    code, out = _run(tmp_path, tg_env, BETWEEN_STEPS.format(block=BLOCKS[block], after=after), "--max-restarts", "0",
                     "--hang-floor-s", str(HANG_FLOOR_S))
    if block == "paused-and-nested-paused":
        assert code == 0 and "worker done" in out and "0 fault(s)" in out, out[-3000:]
    else:
        assert code != 0 and "worker done" not in out, out[-3000:]
        assert "sent no step heartbeat" in out and "after step 2" in out, out[-3000:]
