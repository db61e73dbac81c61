"""A step lost in the snapshot itself (its background copy raised, or a full tmpfs refused its tag) is said as a
health event and a log line, like a failed persist; training goes on and the next save works."""

from __future__ import annotations

import errno
import logging

import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint import checkpointer as ckpt_mod
from trainguard.checkpoint.snapshot import SnapshotCopier


def test_a_snapshot_that_cannot_be_tagged_or_copied_is_an_event_not_silence(make_config, monkeypatch, caplog):
    events = []
    real_tag = ckpt_mod.write_tag

    def tag_on_a_full_tmpfs(paths, text):
        # what a /dev/shm filled by another process answers once the slot was taken (its WRITING tag written)
        if text == "2":
            raise OSError(errno.ENOSPC, "No space left on device", str(paths.tag))
        return real_tag(paths, text)

    monkeypatch.setattr(ckpt_mod, "write_tag", tag_on_a_full_tmpfs)
    real_run = SnapshotCopier.copy_async

    def copy_that_fails_at_step_3(self, pairs, then):
        if state_step[0] == 3:
            def fail(err):
                then(RuntimeError("storage of size 0 cannot be copied (a parameter's storage was freed)"))
            return real_run(self, pairs, fail)
        return real_run(self, pairs, then)

    monkeypatch.setattr(SnapshotCopier, "copy_async", copy_that_fails_at_step_3)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state_step = [0]
    caplog.set_level(logging.ERROR, logger="trainguard.checkpoint")
    with Checkpointer(make_config(), job="lost", on_event=events.append) as ck:
        for step in (1, 2, 3, 4):
            state_step[0] = step
            model(torch.randn(4, 64)).sum().backward()
            ck.save({"model": model, "optim": opt}, step, overlap_with=opt)
            opt.step()
            opt.zero_grad()
        assert ck.wait(1, timeout=60) and ck.wait(4, timeout=60)
        assert not ck.wait(2, timeout=5) and not ck.wait(3, timeout=5)
    lost = {e.evidence["step"]: e for e in events if e.kind.startswith("checkpoint.")}
    assert set(lost) == {"2", "3"}, [e.message for e in events]
    assert lost["2"].kind == "checkpoint.disk_full" and "snapshot not published" in lost["2"].message
    assert "snapshot copy failed" in lost["3"].message and "storage of size 0" in lost["3"].message
    assert sum("for step 2" in r.getMessage() or "for step 3" in r.getMessage() for r in caplog.records) == 2
