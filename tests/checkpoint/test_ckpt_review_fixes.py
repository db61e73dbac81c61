"""Regression tests for the checkpoint bugs a user-style review of main found (rev-report items 3-6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from ckpt_trainer import state_for

from trainguard.checkpoint import CheckpointConfig, Checkpointer

HERE = Path(__file__).parent


def _start_trainer(cfg: CheckpointConfig, job: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, str(HERE / "ckpt_trainer.py"), json.dumps(cfg.to_dict()), job, "0", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().startswith("ready")
    return p


def _ask(p: subprocess.Popen[str], cmd: str) -> str:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


# ---------------------------------------------------------------------- item 3: memory tier keyed by job only
def test_memory_copy_of_another_directory_with_the_same_job_is_never_restored(tmp_path, make_config):
    """A trainer in one directory; a Checkpointer of an EMPTY directory with the same job name must find nothing."""
    cfg = make_config(directory=str(tmp_path / "trainer"))
    trainer = _start_trainer(cfg, "demo")
    try:
        assert _ask(trainer, "save 5") == "saved 5 True"
        other = make_config(directory=str(tmp_path / "empty"))
        live = {"w": torch.zeros(256, 64), "step": -1}
        with Checkpointer(other, job="demo") as reader:
            assert reader.steps() == []
            assert reader.restore(live) is None
        assert torch.equal(live["w"], torch.zeros(256, 64)) and live["step"] == -1
        # The same directory (spelled through a symlink and as a file:// URL) still restores from memory.
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "trainer")
        for directory in (str(link), f"file://{tmp_path / 'trainer'}"):
            with Checkpointer(make_config(directory=directory), job="demo") as same:
                assert same.restore(live) == 5 and same.last_restore_tier == "memory"
            assert torch.equal(live["w"], state_for(5)["w"])
    finally:
        trainer.kill()
        trainer.wait()

