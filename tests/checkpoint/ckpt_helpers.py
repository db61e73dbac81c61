"""Helpers shared by the checkpoint tests (a module with a unique name; conftest modules are not importable)."""

from __future__ import annotations

import torch


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
