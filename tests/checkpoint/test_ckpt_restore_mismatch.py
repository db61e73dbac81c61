"""A restore that does not fit the live state raises before it loads anything into it."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import Checkpointer, StateMismatchError


def test_a_mismatch_at_a_later_key_leaves_the_earlier_keys_untouched(make_config):
    # The load went key by key: a resized head at the last key raised StateMismatchError after the encoder and
    # the scalars had been overwritten with the checkpoint's, so a script that caught the error and trained on
    # trained half the old run and half a fresh model, with no word of it.
    saved = {"encoder": torch.nn.Linear(4, 4), "epoch": 7, "extra": {"best": torch.ones(2)},
             "head": torch.nn.Linear(4, 3)}
    with torch.no_grad():
        saved["encoder"].weight.fill_(1.0)
    with Checkpointer(make_config(), job="mm") as ck:
        ck.save(saved, 5)
        assert ck.wait(timeout=30)

    encoder, best = torch.nn.Linear(4, 4), torch.zeros(2)
    with torch.no_grad():
        encoder.weight.fill_(-1.0)
    live = {"encoder": encoder, "epoch": 0, "extra": {"best": best}, "head": torch.nn.Linear(4, 5)}
    with Checkpointer(make_config(), job="mm") as ck:
        with pytest.raises(StateMismatchError) as raised:
            ck.restore(live)
    assert torch.equal(encoder.weight, torch.full((4, 4), -1.0))
    assert live["epoch"] == 0 and torch.equal(best, torch.zeros(2))
    assert str(raised.value).startswith("head.weight: the checkpoint holds float32[3, 4], the live tensor is "
                                        "float32[5, 4]")
    assert "nothing was loaded" in str(raised.value)

    # The same state with the head it was saved with still restores every key.
    live["head"] = torch.nn.Linear(4, 3)
    with Checkpointer(make_config(), job="mm") as ck:
        assert ck.restore(live) == 5
    assert torch.equal(encoder.weight, torch.ones(4, 4)) and live["epoch"] == 7 and torch.equal(best, torch.ones(2))
