"""The workers' store threads never outlive ``trainguard run`` (CI stop 32: exit -6 after a job succeeded).

The launcher imports torch for the workers' store in a background thread. A job that ended before that import
did left the thread inside torch while the interpreter finalised, and the launcher could abort with
``terminate called without an active exception`` after printing "job succeeded". Each check runs in a fresh
interpreter, where torch is not imported yet, exactly as a launcher starts.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN_IN_PROCESS = """import json, sys, threading
from trainguard.cli import main
code = main(["run", "--nproc-per-node", "1", "--no-standby", sys.argv[1]])
print(json.dumps({"code": code, "threads": [t.name for t in threading.enumerate()],
                  "torch": "torch.distributed" in sys.modules}))
"""


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_a_job_shorter_than_the_torch_import_leaves_no_store_thread_behind(tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text("pass\n")  # ends long before the launcher's torch import does
    proc = subprocess.run([sys.executable, "-c", RUN_IN_PROCESS, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _last_json(proc.stdout)
    assert result["code"] == 0, proc.stderr[-3000:]
    left = [name for name in result["threads"] if name.startswith("store-")]
    assert not left, f"store threads alive when the launcher returns: {left}"
    assert result["torch"]  # the import finished rather than being abandoned


SETTLE_AFTER_CLOSE = """import json, sys, threading
from trainguard.agent.worker_store import GenerationStore, settle
store = GenerationStore(int(sys.argv[1]), 1).start_soon(lambda exc: print("error", exc))
store.close()  # before torch is imported: the pending start must not bring the server up afterwards
settled = settle(120)
print(json.dumps({"settled": settled, "store": store._store is not None,
                  "threads": [t.name for t in threading.enumerate()]}))
"""


def test_a_store_closed_before_it_started_never_listens(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", SETTLE_AFTER_CLOSE, str(port)], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _last_json(proc.stdout)
    assert result == {"settled": True, "store": False, "threads": ["MainThread"]}, proc.stdout
    with socket.socket() as s:  # nothing kept the port
        s.bind(("0.0.0.0", port))
