"""What a save hands the persist process: step numbers that are not plain ints (numpy and tensor integers are
steps, floats and bools are refused) and storage options, which travel as JSON."""

from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest
import torch

from ckpt_helpers import small_model, train_step
from trainguard.checkpoint import Checkpointer, CheckpointError
from trainguard.checkpoint.errors import CheckpointConfigError, UnsupportedValueError


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


def test_storage_options_that_cannot_travel_as_json_are_refused_and_never_block_saves(make_config, tmp_path):
    # A timedelta in storage_options failed the JSON encoding of every save request after the snapshot: save()
    # raised TypeError and kept its staging slot taken, so the third save blocked training for ever.
    remote = {"url": f"file://{tmp_path}/remote", "storage_options": {"auto_mkdir": True,
                                                                       "timeout": datetime.timedelta(seconds=5)}}
    with pytest.raises(CheckpointConfigError, match="storage_options.*timedelta"):
        make_config(remote=remote)
    # A config changed after its validation: each save fails and is reported, none blocks or raises.
    cfg = make_config(remote={"url": remote["url"]})
    events: list = []
    ck = Checkpointer(cfg, job="opts", on_event=events.append)
    cfg.remote.storage_options["timeout"] = datetime.timedelta(seconds=5)
    results: list[bool] = []

    def loop() -> None:
        for step in range(4):
            results.append(ck.save({"w": torch.ones(3)}, step).wait())

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(60)  # a hang guard only
    try:
        assert results == [False] * 4
        assert [e.kind for e in events] == ["checkpoint.persist_failed"] * 4
        assert "timedelta" in events[0].message
        del cfg.remote.storage_options["timeout"]
        assert ck.save({"w": torch.ones(3)}, 4).wait()
    finally:
        ck.close()


@pytest.mark.parametrize("array", [np.array(["a", "bb"]), np.array([1, "x"], dtype=object),
                                   np.arange(3, dtype=">f4")], ids=["str", "object", "big-endian"])
def test_a_numpy_array_the_format_cannot_store_is_refused_naming_the_key(make_config, array):
    # torch.from_numpy's own TypeError / ValueError left save() and prepare() naming neither the key nor a fix.
    with Checkpointer(make_config(), job="np-dtypes") as ck:
        for call in (lambda: ck.prepare({"meta": {"names": array}}), lambda: ck.save({"meta": {"names": array}}, 1)):
            with pytest.raises(UnsupportedValueError, match=rf"meta\.names is a numpy array of dtype {array.dtype}"):
                call()
        assert ck.save({"meta": {"names": np.arange(3, dtype=np.float32)}}, 2).wait()
