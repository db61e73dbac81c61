"""Step numbers that are not plain ints: numpy and tensor integers are steps, floats and bools are refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ckpt_helpers import small_model, train_step
from trainguard.checkpoint import Checkpointer, CheckpointError


def test_numpy_and_tensor_integer_steps_save_and_other_steps_are_refused(make_config):
    # `for step in np.arange(n)`: the np.int64 step failed JSON encoding in the snapshot thread and kept its
    # staging slot taken, so with overlap_with the third save blocked training for ever; a float step tagged the
    # slot "5.0" and every save was skipped as "reused before it was persisted".
    m, opt = small_model()
    ck = Checkpointer(make_config(disk={"keep": 5}), job="np-steps")
    done: list[bool] = []

    def loop() -> None:
        for step in np.arange(4):
            ck.save({"model": m, "optim": opt}, step, overlap_with=opt)
            train_step(m, opt)
        done.append(ck.wait())

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(120)  # a hang guard only: a blocked save never returns
    try:
        assert done == [True], "the saves of numpy steps blocked or failed"
        assert [(i.step, "disk" in i.tiers) for i in ck.steps()] == [(0, True), (1, True), (2, True), (3, True)]
        h = ck.save({"model": m}, torch.tensor(7))
        assert h.step == 7 and type(h.step) is int and ck.wait(np.int64(7))
        assert ck.restore({"model": m}, step=np.int64(7)) == 7
        for bad in (5.0, True, "5", torch.tensor(5.0)):
            with pytest.raises(CheckpointError, match="step must be an integer"):
                ck.save({"model": m}, bad)
    finally:
        ck.close()
