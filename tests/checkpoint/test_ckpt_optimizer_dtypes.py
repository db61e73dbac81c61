"""Optimizer state restored into a live optimizer whose state tensors have another dtype than the saved ones."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.errors import StateMismatchError


def _stepped(width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Linear(width, width)
    o = torch.optim.Adam(m.parameters())
    m(torch.randn(2, width)).sum().backward()
    o.step()
    return m, o


def test_moments_saved_in_bfloat16_restore_into_a_live_float32_optimizer_as_torch_casts_them(make_config):
    """A run that kept Adam's moments in bfloat16 restored into an optimizer holding float32 moments raised
    StateMismatchError (filled in place, dtype checked), where ``optimizer.load_state_dict`` casts state to the
    parameter's dtype. Now the values arrive cast; a moment of another shape is still refused."""
    torch.manual_seed(0)
    m, o = _stepped()
    for st in o.state.values():
        st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
    saved = {i: st["exp_avg"].float().clone() for i, st in enumerate(o.state.values())}
    with Checkpointer(make_config(memory={"enabled": False}), job="bf") as ck:
        ck.save({"m": m, "o": o}, 1)
        assert ck.wait(1, timeout=30)
        m2, o2 = _stepped()
        assert ck.restore({"m": m2, "o": o2}) == 1
        for i, st in enumerate(o2.state.values()):
            assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], saved[i])
        m3, o3 = _stepped(width=4)  # other shapes: the model's own tensors refuse it first, naming the key
        with pytest.raises(StateMismatchError, match="the checkpoint holds"):
            ck.restore({"m": m3, "o": o3})
        m4, o4 = _stepped()
        with pytest.raises(StateMismatchError, match="exp_avg"):
            ck.restore({"o": _with_moment_shape(o4, (3,))})


def _with_moment_shape(o: torch.optim.Optimizer, shape: tuple[int, ...]) -> torch.optim.Optimizer:
    for st in o.state.values():
        st["exp_avg"] = torch.zeros(shape)
    return o
