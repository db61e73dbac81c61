"""close() right after an overlapped save persists that save."""

from __future__ import annotations

import torch

from trainguard.checkpoint import Checkpointer


def test_close_after_overlapped_saves_without_wait_persists_them(make_config):
    # The overlapped copy marked itself done before its callback sent the persist request. close() waited for the
    # copy only, saw no persist process yet (the first request starts it) and unmapped the slots: the copy's
    # thread then died on a closed file ("Bad file descriptor") and neither step reached disk, with no error.
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    ck = Checkpointer(make_config(), job="ovc")
    ck.save(state, 1, overlap_with=opt)
    ck.save(state, 2, overlap_with=opt)
    ck.close()

    with Checkpointer(make_config(), job="ovc") as ck:
        assert [s.step for s in ck.steps()] == [1, 2]
        fresh = torch.nn.Linear(256, 256)
        assert ck.restore({"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}) == 2
    assert torch.equal(fresh.weight, model.weight)
