"""Node-level faults under `trainguard run`: a worker killed by a hardware fault gets a node replacement instead of
a restart in place, and a predictor alarm asks for one after ``--drain-grace-s``.

Real processes: the launcher, its embedded coordinator, the worker; the PCIe detector reads a fake sysfs tree
in the real sysfs formats (set up through ``--detector-config``), which the test changes while the job runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from tg_testutil import REPO

from trainguard.testing.sysfs import GPU, write_gpu

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_until_worker(tmp_path: Path, env: dict, config: str, *flags: str) -> tuple[subprocess.Popen, int]:
    """Starts `trainguard run` of hw_victim.py with ``config`` as --detector-config; returns it and the worker pid."""
    path = tmp_path / "detectors.toml"
    path.write_text(config)
    pidfile = tmp_path / "worker.pid"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", "--max-restarts", "1",
         "--no-standby", "--detectors", "process,pcie", "--detector-config", str(path), *flags,
         str(SCRIPTS / "hw_victim.py"), str(pidfile)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        time.sleep(1.0)  # the detectors' first round (started before the workers) has read the healthy tree
        return proc, int(pidfile.read_text())
    except BaseException:
        finish(proc, 0)
        raise


def finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    """Waits for the launcher (killing its session on timeout or failure); returns its stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
        return err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def log_time(stderr: str, text: str) -> float:
    """Unix time of the first log line containing ``text``."""
    line = next(line for line in stderr.splitlines() if text in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_worker_killed_by_aer_fatal_gets_node_level_recovery(tmp_path: Path, tg_env: dict) -> None:
    tree = tmp_path / "fake"
    write_gpu(tree)
    # The top-level root sends the hardware detectors to the fake tree (the process detector stays on the real
    # /proc of the workers). The PCIe detector's own schedule never comes round in this test: only the
    # out-of-schedule sample sees the fault.
    proc, worker = run_until_worker(tmp_path, tg_env, f'root = "{tree}"\n\n[pcie]\ninterval_s = 3600\n')
    write_gpu(tree, fatal={"MalfTLP": 1})
    os.kill(worker, signal.SIGKILL)
    err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert (f"generation 1: rank 0 died with a hardware fault on this node (pcie.aer_fatal: PCIe device {GPU}: 1 "
            "new uncorrectable fatal error(s) (MalfTLP+1)); asking the coordinator to replace this node") in err, err
    # One node-level report for generation 1: the same event reaching the agent's normal path is not sent again.
    assert err.count("asking the coordinator to replace this node") == 1, err
    assert "already reported for generation 1" in err, err
    # The embedded single-node coordinator has no spare: the node-level failure escalates to a job-level restart,
    # which the same node takes (generation 2), and the job ends normally.
    assert "job level, generation 2" in err and "no spare node for" in err, err
    assert "generation 2: started ranks 0..0" in err, err
    summary = err.strip().splitlines()
    assert "job succeeded" in summary[-2] and "2 generation(s), 1 fault(s)" in summary[-2], err[-2000:]
    assert "ended with signal SIGKILL (9)" in summary[-1] and "node fault pcie.aer_fatal" in summary[-1], summary[-1]


def test_predictor_alarm_drains_the_node_after_the_grace(tmp_path: Path, tg_env: dict) -> None:
    tree = tmp_path / "fake"
    write_gpu(tree)
    grace = 1.5
    proc, _ = run_until_worker(tmp_path, tg_env, f'[pcie]\nroot = "{tree}"\ninterval_s = 0.2\n',
                               "--predictor-interval-s", "0.2", "--drain-grace-s", str(grace))
    write_gpu(tree, width=8)  # the link trains at x8 of x16: a warning for the detector, an alarm for the rules tier
    narrowed = time.time()
    err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    drained = log_time(err, "predicted failure: asking the coordinator to drain this node")
    # The drain waited the grace after the alarm (which came at most a few sampling periods after the change).
    assert grace - 0.1 <= drained - narrowed <= grace + 4.0, (drained - narrowed, err[-3000:])
    assert "no spare node for" in err and "generation 2: started ranks 0..0" in err, err[-3000:]
