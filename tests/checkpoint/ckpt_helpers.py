"""Helpers shared by the checkpoint tests (a module with a unique name; conftest modules are not importable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from trainguard.checkpoint import CheckpointConfig


def small_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny MLP with BatchNorm and an Adam optimizer that has taken two steps."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    for _ in range(2):
        m(torch.randn(5, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One forward/backward/step."""
    m(torch.randn(5, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def flat(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, cloned, by name."""
    out = {f"m.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o.{pid}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of two flat dicts."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def start_trainer(cfg: CheckpointConfig, job: str) -> subprocess.Popen[str]:
    """Starts ``ckpt_trainer.py`` (a second, real process saving under ``cfg`` as ``job``) and waits for it."""
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, str(here / "ckpt_trainer.py"), json.dumps(cfg.to_dict()), job, "0", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().startswith("ready")
    return p


def ask(p: subprocess.Popen[str], cmd: str) -> str:
    """Sends one command line to a trainer started by :func:`start_trainer`; returns its one-line answer."""
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()
