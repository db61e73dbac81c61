"""Restoring into a live tensor whose elements share memory (an `expand()`ed or broadcast view): `copy_` cannot
fill it, so the up-front fit check refuses it, naming the key, before any key is loaded; views whose elements
each own a location (transposes, slices, rows of a larger tensor) restore in place as before."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer, LocalShard, StateMismatchError


def _cfg(tmp_path) -> CheckpointConfig:
    return CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False}, persist={"service": "inline"})


def test_an_expanded_live_tensor_is_refused_before_anything_is_loaded(tmp_path):
    """Before, torch's own RuntimeError came from copy_ at "b", with "a" already holding the checkpoint."""
    with Checkpointer(_cfg(tmp_path), job="j") as ck:
        ck.save({"a": torch.ones(3), "b": torch.ones(4, 3), "m": torch.nn.Linear(2, 2)}, 1)
    for live_b in (torch.zeros(3).expand(4, 3), torch.zeros(4, 1).expand(4, 3)):
        state = {"a": torch.zeros(3), "b": live_b, "m": torch.nn.Linear(2, 2)}
        weight = state["m"].weight.detach().clone()
        with Checkpointer(_cfg(tmp_path), job="j") as ck:
            with pytest.raises(StateMismatchError, match=r"^b: the live tensor's elements share memory .*\.clone\(\)"):
                ck.restore(state)
        assert torch.equal(state["a"], torch.zeros(3)) and torch.equal(state["m"].weight, weight)


def test_an_expanded_local_shard_is_refused_before_anything_is_loaded(tmp_path):
    with Checkpointer(_cfg(tmp_path), job="j") as ck:
        ck.save({"a": torch.ones(3), "x": LocalShard(torch.ones(4, 3), (4, 3), (0, 0))}, 1)
    state = {"a": torch.zeros(3), "x": LocalShard(torch.zeros(1, 3).expand(4, 3), (4, 3), (0, 0))}
    with Checkpointer(_cfg(tmp_path), job="j") as ck:
        with pytest.raises(StateMismatchError, match=r"^x: the live tensor's elements share memory"):
            ck.restore(state)
    assert torch.equal(state["a"], torch.zeros(3))


def test_views_that_own_their_elements_still_restore_in_place(tmp_path):
    saved = {"t": torch.arange(12.0).view(3, 4), "row": torch.arange(5.0), "cols": torch.arange(6.0).view(3, 2),
             "one": torch.tensor([7.0])}
    with Checkpointer(_cfg(tmp_path), job="j") as ck:
        ck.save(saved, 1)
    base_t, base_rows, base_cols = torch.zeros(4, 3), torch.zeros(2, 5), torch.zeros(3, 4)
    # A size-1 dimension may have stride 0: it holds one element, nothing is shared.
    one = torch.zeros(()).expand(1)
    live = {"t": base_t.t(), "row": base_rows[1], "cols": base_cols[:, ::2], "one": one}
    with Checkpointer(_cfg(tmp_path), job="j") as ck:
        assert ck.restore(live) == 1
    assert torch.equal(base_t.t(), saved["t"]) and torch.equal(base_rows[1], saved["row"])
    assert torch.equal(base_rows[0], torch.zeros(5)) and torch.equal(base_cols[:, ::2], saved["cols"])
    assert torch.equal(base_cols[:, 1::2], torch.zeros(3, 2)) and one.item() == 7.0
