"""The workers' store threads never outlive ``trainguard run`` (CI stop 32: exit -6 after a job succeeded).

The launcher imports torch for the workers' store in a background thread. A job that ended before that import
did left the thread inside torch while the interpreter finalised, and the launcher could abort with
``terminate called without an active exception`` after printing "job succeeded": the console entry now exits
without finalising while the import runs. Each check runs in a fresh interpreter, where torch is not imported
yet, exactly as a launcher starts.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import tg_testutil

REPO = Path(__file__).resolve().parents[2]

# The console entry, run as the installed script runs it, with two observers: whether the store's import was
# still running when the command ended, and whether the interpreter then finalised (an atexit line).
RUN_ENTRY = """import atexit, sys
atexit.register(lambda: print("finalised", flush=True))
from trainguard import cli
from trainguard.agent import worker_store
real_busy = worker_store.busy

def busy():
    running = real_busy()
    print(f"busy={running}", flush=True)
    return running

worker_store.busy = busy
sys.argv = ["trainguard", "run", "--nproc-per-node", "1", "--no-standby", sys.argv[1]]
cli.entry()
"""


def test_a_job_shorter_than_the_torch_import_exits_without_finalising_inside_it(tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text("pass\n")  # ends long before the launcher's torch import (seconds of CPU) does
    proc = subprocess.run([sys.executable, "-c", RUN_ENTRY, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainguard: job succeeded" in proc.stderr, proc.stderr[-3000:]  # flushed before the exit
    assert "busy=True" in proc.stdout, proc.stdout  # the case of CI stop 32: the import still running
    assert "finalised" not in proc.stdout, "the interpreter finalised with the import thread inside torch"


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


SETTLE_AFTER_CLOSE = """import json, sys, threading
from trainguard.agent.worker_store import GenerationStore, settle
store = GenerationStore(int(sys.argv[1]), 1).start_soon(lambda exc: print("error", exc))
store.close()  # before torch is imported: the pending start must not bring the server up afterwards
settled = settle(120)
print(json.dumps({"settled": settled, "store": store._store is not None,
                  "threads": [t.name for t in threading.enumerate()]}))
"""


def test_a_store_closed_before_it_started_never_listens(tmp_path: Path) -> None:
    port = tg_testutil.free_port()
    proc = subprocess.run([sys.executable, "-c", SETTLE_AFTER_CLOSE, str(port)], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _last_json(proc.stdout)
    assert result == {"settled": True, "store": False, "threads": ["MainThread"]}, proc.stdout
    with socket.socket() as s:  # nothing kept the port
        s.bind(("0.0.0.0", port))
