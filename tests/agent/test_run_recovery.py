"""The main job end to end: a worker SIGKILLed at a random step, the job resumes from its checkpoint and ends
bitwise equal to a run without the fault."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tg_testutil import EXAMPLE, run_cli

STEPS = 60


def _train(tmp_path: Path, tg_env: dict, name: str, extra: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "2", "--job", name,
                 "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), *extra, str(EXAMPLE),
                 "--steps", str(STEPS), "--save-every", "10", "--out", str(out)], tg_env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"result": json.loads(out.read_text()), "stderr": r.stderr}


@pytest.mark.timeout(400)
def test_sigkilled_worker_resumes_bitwise_equal(tmp_path: Path, tg_env: dict) -> None:
    kill_step = random.Random().randint(12, STEPS - 5)
    clean = _train(tmp_path, tg_env, "clean", [])
    faulty = _train(tmp_path, tg_env, "faulty", ["--fault", f"1:{kill_step}:KILL"])
    assert "rank 1 ended with signal SIGKILL (9)" in faulty["stderr"], faulty["stderr"][-2000:]
    assert faulty["result"]["restart_count"] == 1
    # Resumed from the newest checkpoint at or before the kill, not from scratch.
    restored = faulty["result"]["restored_step"]
    assert restored is not None and kill_step - 10 <= restored <= kill_step, (kill_step, restored)
    # The agent-owned shared-memory tier outlived the killed worker and served the restore.
    assert faulty["result"]["restored_tier"] == "memory"
    assert faulty["result"]["params_sha256"] == clean["result"]["params_sha256"], f"kill at step {kill_step}"
    assert faulty["result"]["test_accuracy"] > 0.8
