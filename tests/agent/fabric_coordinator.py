"""A real ``trainguard coordinator`` process on a netns fabric's host address, for the end-to-end tests whose
launchers run in network namespaces (:class:`trainguard.drill.netns.Fabric`). Imported by name by the agent tests.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tg_testutil import REPO
from trainguard.drill.netns import Fabric


def start_fabric_coordinator(fabric: Fabric, tmp: Path, env: dict[str, str], job: str, nnodes: int,
                             *flags: str) -> tuple[subprocess.Popen, IO[str], str]:
    """Starts the coordinator of ``job`` (in-memory store, 0.2 s heartbeats, exits when the job is done) on a
    free port of the fabric's host address and waits for the port.

    Returns:
        The process, its open log file (``tmp/coordinator.log``; the caller closes it) and the address the
        launchers dial. On failure to start, the process is killed and the log closed before the error.
    """
    port_file = tmp / "port"
    log = open(tmp / "coordinator.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "coordinator", "--job", job, "--listen",
         f"{fabric.coordinator_host}:0", "--store", "memory://", "--nnodes", str(nnodes), "--heartbeat-interval", "0.2",
         "--port-file", str(port_file), "--exit-when-done", *flags],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "coordinator.log").read_text()
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        log.close()
        raise
    return proc, log, f"{fabric.coordinator_host}:{port_file.read_text().strip()}"


__all__ = ["start_fabric_coordinator"]
