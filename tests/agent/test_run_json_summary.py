"""`trainguard run --log-format json`: every stderr line of the launcher is one JSON object, one of them its
summary with the fault's timeline (a real launcher, a real worker exiting 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agentd_unit import clean_env
from tg_testutil import REPO

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_json_summary_names_the_fault(tg_env):
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", "--log-format", "json", "--nproc-per-node", "1",
         "--max-restarts", "0", "--no-standby", "--detectors", "process", str(SCRIPTS / "crash.py"), "0", "7"],
        env=clean_env(tg_env), cwd=REPO, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.strip()]
    (summary,) = [line for line in lines if line.get("event") == "run.summary"]
    assert summary["event"] == "run.summary" and summary["status"] == "failed" and summary["exit_code"] == 1
    assert summary["level"] == "error" and summary["msg"].startswith("trainguard: job FAILED after")
    assert summary["generations"] == 1 and "restart budget exhausted" in summary["message"]
    (fault,) = summary["faults"]
    assert fault["rank"] == 0 and fault["cause"] == "exit code 7" and fault["generation"] == 1
    assert fault["detected_after_s"] >= 0 and fault["restarted_after_s"] is None and fault["node_fault"] is None
