"""Warm standbys are armed only when a restart can use them.

A one-node ``trainguard run --max-restarts 0`` never starts a second generation, yet its agent armed one standby
per local rank once the generation had run ``standby_after_s`` (3 s): each imported torch and torch._dynamo
(seconds of CPU) for a restart that could not come. With a restart budget the standbys are still armed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def _standbys_seen(tmp_path: Path, tg_env: dict, max_restarts: int, window_s: float) -> int:
    script = tmp_path / "count.py"
    script.write_text(COUNT_STANDBYS)
    out = tmp_path / f"seen-{max_restarts}.json"
    proc = subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", "--max-restarts",
                           str(max_restarts), str(script), str(out), str(window_s)],
                          env=tg_env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["standbys"]


def test_no_standby_is_armed_without_a_restart_budget(tmp_path: Path, tg_env: dict) -> None:
    # 3 s arming delay + 6 s for the standby to be spawned on a loaded box.
    assert _standbys_seen(tmp_path, tg_env, max_restarts=0, window_s=9.0) == 0


def test_standbys_are_armed_when_a_restart_may_come(tmp_path: Path, tg_env: dict) -> None:
    # The same detection sees the standby when the budget allows a restart (so the test above can fail).
    assert _standbys_seen(tmp_path, tg_env, max_restarts=1, window_s=60.0) == 1
