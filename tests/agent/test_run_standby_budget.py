"""Warm standbys are armed only when a restart can use them.

A one-node ``trainguard run --max-restarts 0`` never starts a second generation, yet its agent armed one standby
per local rank once the generation had run ``standby_after_s`` (3 s): each imported torch and torch._dynamo
(seconds of CPU) for a restart that could not come. With a restart budget the standbys are still armed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tg_testutil import communicate_all

REPO = Path(__file__).resolve().parents[2]

# Counts the launcher's standby children (their code carries the marker below) until one shows or the window
# after the agent's 3 s arming delay has passed.
COUNT_STANDBYS = """import json, os, sys, time
launcher = os.getppid()

def standbys():
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        found += ppid == launcher and b"trainguard standby" in cmd
    return found

deadline = time.monotonic() + float(sys.argv[2])
seen = standbys()
while not seen and time.monotonic() < deadline:
    time.sleep(0.2)
    seen = standbys()
with open(sys.argv[1], "w") as f:
    json.dump({"standbys": seen}, f)
"""


def _launch(tmp_path: Path, tg_env: dict, max_restarts: int, window_s: float) -> subprocess.Popen:
    out = tmp_path / f"seen-{max_restarts}.json"
    return subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1",
                             "--max-restarts", str(max_restarts), "--job", f"standby-{max_restarts}-{os.getpid()}",
                             str(tmp_path / "count.py"), str(out),
                             str(window_s)],
                            env=tg_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_standbys_are_armed_only_when_a_restart_may_come(tmp_path: Path, tg_env: dict) -> None:
    # Both launchers run side by side (one test: the wait of the one without a budget overlaps the other's run),
    # each with a job name of its own (the default name of the same script would refuse the second).
    # Without a budget: 3 s arming delay + 6 s for the standby to be spawned on a loaded box, and none shows.
    # With one, the same detection sees the standby (so the check without a budget can fail).
    (tmp_path / "count.py").write_text(COUNT_STANDBYS)
    procs = [_launch(tmp_path, tg_env, 0, 9.0), _launch(tmp_path, tg_env, 1, 60.0)]
    for p, (code, _, err) in zip(procs, communicate_all(procs, timeout=180)):
        assert code == 0, err[-3000:]
    seen = [json.loads((tmp_path / f"seen-{n}.json").read_text())["standbys"] for n in (0, 1)]
    assert seen == [0, 1], seen
