"""Regression tests for what a new user's review of the checkpoint API and `trainguard ckpt` found."""

from __future__ import annotations

import logging
import tempfile

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer

# Nothing listens on port 1: a remote location whose tier fails at once, while the disk tier (its local cache)
# still commits, as with an unreachable or misconfigured bucket.
UNREACHABLE = "ftp://127.0.0.1:1"


def _remote_cfg(directory: str, **kw) -> CheckpointConfig:
    return CheckpointConfig(directory=directory, memory={"enabled": False}, persist={"service": "inline"}, **kw)


def _save(cfg: CheckpointConfig, job: str, steps: tuple[int, ...], value: float) -> None:
    with Checkpointer(cfg, job=job) as ck:
        for s in steps:
            ck.save({"w": torch.full((1000,), value + s)}, s)


# ---------------------------------------------------------------------- remote locations sharing one disk cache
def test_two_remote_locations_get_their_own_default_local_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = _remote_cfg(f"{UNREACHABLE}/bucket-a/exp1"), _remote_cfg(f"{UNREACHABLE}/bucket-b/other-exp")
    assert a.disk_directory != b.disk_directory  # both were <tmp>/trainguard-ckpt
    assert a.disk_directory.startswith(str(tmp_path / "trainguard-ckpt-"))
    assert _remote_cfg(f"{UNREACHABLE}/bucket-a/exp1/").disk_directory == a.disk_directory
    _save(a, "train", (50, 51, 52), 1.0)
    live = {"w": torch.zeros(1000)}
    with Checkpointer(b, job="train") as ck:
        assert ck.restore(live) is None  # restored A's step 52 from the shared folder
    assert torch.equal(live["w"], torch.zeros(1000))
    with Checkpointer(a, job="train") as ck:
        assert ck.restore(live) == 52 and ck.last_restore_tier == "disk"
    assert torch.equal(live["w"], torch.full((1000,), 53.0))


def test_a_local_cache_shared_by_two_urls_never_restores_the_other_urls_steps(tmp_path, caplog):
    cache = str(tmp_path / "cache")
    a = _remote_cfg(f"{UNREACHABLE}/bucket-a/exp1", local_cache=cache)
    b = _remote_cfg(f"{UNREACHABLE}/bucket-b/other-exp", local_cache=cache)
    _save(a, "train", (7,), 1.0)
    live = {"w": torch.zeros(1000)}
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        with Checkpointer(b, job="train") as ck:
            assert ck.steps() == [] and ck.restore(live) is None
    assert torch.equal(live["w"], torch.zeros(1000))
    warned = [r.getMessage() for r in caplog.records if "not restoring step 7 from the disk tier" in r.getMessage()]
    assert warned and f"{UNREACHABLE}/bucket-a/exp1" in warned[0] and f"{UNREACHABLE}/bucket-b/other-exp" in warned[0]
    with Checkpointer(a, job="train") as ck:  # its own steps still restore
        assert ck.restore(live) == 7 and torch.equal(live["w"], torch.full((1000,), 8.0))
