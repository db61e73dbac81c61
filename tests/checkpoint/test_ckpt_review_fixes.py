"""Regression tests for the checkpoint bugs a user-style review of main found (rev-report items 3-6)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from pathlib import Path

import torch
from ckpt_helpers import ask, start_trainer
from ckpt_trainer import state_for

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.storage import data_name, step_dirname
from trainguard.cli import main

HERE = Path(__file__).parent




# ---------------------------------------------------------------------- item 3: memory tier keyed by job only
def test_memory_copy_of_another_directory_with_the_same_job_is_never_restored(tmp_path, make_config):
    """A trainer in one directory; a Checkpointer of an EMPTY directory with the same job name must find nothing."""
    cfg = make_config(directory=str(tmp_path / "trainer"))
    trainer = start_trainer(cfg, "demo")
    try:
        assert ask(trainer, "save 5") == "saved 5 True"
        other = make_config(directory=str(tmp_path / "empty"))
        live = {"w": torch.zeros(256, 64), "step": -1}
        with Checkpointer(other, job="demo") as reader:
            assert reader.steps() == []
            assert reader.restore(live) is None
        assert torch.equal(live["w"], torch.zeros(256, 64)) and live["step"] == -1
        # The same directory (spelled through a symlink and as a file:// URL) still restores from memory.
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "trainer")
        for directory in (str(link), f"file://{tmp_path / 'trainer'}"):
            with Checkpointer(make_config(directory=directory), job="demo") as same:
                assert same.restore(live) == 5 and same.last_restore_tier == "memory"
            assert torch.equal(live["w"], state_for(5)["w"])
    finally:
        trainer.kill()
        trainer.wait()


# ---------------------------------------------------------------------- item 4: state grows after prepare()
def test_state_outgrowing_prepared_shm_slots_falls_back_instead_of_raising(make_config, small_tmpfs, caplog):
    """prepare() before the optimizer made its state sizes the slots small; the first real save must not raise."""
    cfg = make_config(memory={"directory": str(small_tmpfs), "keep": 1, "fallback": "disk"})
    small = {"w": torch.randn(60_000), "step": 0}   # 2 slots of 240 KB fit the 1 MiB tmpfs
    # AdamW-like growth to 960 KB: next to the 240 KB slot holding step 1, no slot of it fits in 1 MiB.
    grown = {"w": small["w"].clone(), "m": torch.randn(60_000), "v": torch.randn(60_000), "g": torch.randn(60_000),
             "step": 3}
    events = []
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        with Checkpointer(cfg, job="grow", on_event=events.append) as ck:
            ck.prepare(small)
            assert ck.staging == "memory"
            ck.save(small, 1)
            assert ck.wait(1, timeout=60)
            h = ck.save(grown, 3)  # raised StorageUnavailableError into the training loop before the fix
            assert h.wait(timeout=60) and h.tiers_done == ["disk"]
            assert ck.staging == "disk"
            ck.save(grown, 4)
            assert ck.wait(4, timeout=60)
            assert [s.step for s in ck.steps()][-2:] == [3, 4]
    assert [e.kind for e in events] == ["checkpoint.staging_fallback"]
    assert len([r for r in caplog.records if "staging" in r.getMessage()]) == 1
    # A clean close removes the outgrown shared-memory slots too: they held the container's /dev/shm after exit.
    assert os.listdir(small_tmpfs) == []
    live = {k: torch.zeros(60_000) for k in ("w", "m", "v", "g")} | {"step": -1}
    with Checkpointer(cfg, job="grow") as ck2:
        assert ck2.restore(live) == 4
    for k in ("w", "m", "v", "g"):
        assert torch.equal(live[k], grown[k]), k


# ---------------------------------------------------------------------- item 5: gc keeps a corrupt newest step
def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["ckpt", *args])
    return rc, out.getvalue()


def _corrupt(root: str, job: str, step: int) -> None:
    with open(os.path.join(root, job, step_dirname(step), data_name(0)), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")


def test_gc_counts_only_steps_that_verify(tmp_path):
    root = str(tmp_path / "ck")
    cfg = CheckpointConfig(directory=root, memory={"enabled": False}, persist={"service": "inline"},
                           disk={"keep": 10})
    with Checkpointer(cfg, job="j") as ck:
        for s in (240, 260, 280):
            ck.save({"w": torch.full((5000,), float(s))}, s)
    _corrupt(root, "j", 280)
    rc, out = _cli("gc", root, "--keep", "1", "--dry-run")
    lines = out.strip().splitlines()
    assert rc == 0 and lines[-1] == "would remove 1 step(s): [240]", out  # was [240, 260]: no valid step left
    assert lines[0].startswith("would keep step 280: CORRUPT, not counted toward --keep") and "checksum" in lines[0]
    assert lines[1] == "would keep step 260: verifies (1 of 1 kept by --keep)"
    rc, out = _cli("gc", root, "--keep", "1")
    assert rc == 0 and out.strip().splitlines()[-1] == "removed 1 step(s): [240]"
    live = {"w": torch.zeros(5000)}
    with Checkpointer(cfg, job="j") as ck:
        assert ck.restore(live) == 260 and torch.equal(live["w"], torch.full((5000,), 260.0))
    # Nothing verifies: gc deletes nothing and says so.
    _corrupt(root, "j", 260)
    rc, out = _cli("gc", root, "--keep", "1")
    assert rc == 1 and "no committed step verifies; deleting nothing" in out
    assert sorted(os.listdir(os.path.join(root, "j"))) == ["COMMITTED.json", step_dirname(260), step_dirname(280)]


# ---------------------------------------------------------------------- item 6: import --world-size of an export
def test_import_of_an_export_refuses_another_world_size(tmp_path):
    root = str(tmp_path / "ck")
    cfg = CheckpointConfig(directory=root, memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg, job="j") as ck:
        ck.save({"w": torch.arange(4000.0)}, 7)
    assert _cli("export", root, str(tmp_path / "dcp"))[0] == 0
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["ckpt", "import", str(tmp_path / "dcp"), str(tmp_path / "imp"), "--job", "j2", "--world-size", "2"])
    # Before: "imported ... as step 7" with world size 1, the flag silently ignored.
    msg = err.getvalue().strip()
    assert rc != 0 and "--world-size 2" in msg and "world size 1" in msg and len(msg.splitlines()) == 1, msg
    assert not os.path.exists(tmp_path / "imp" / "j2" / step_dirname(7))
    # The export's own world size (or none) still imports it exactly (the second time over the first: --force).
    for extra in (["--world-size", "1"], ["--force"]):
        rc, _ = _cli("import", str(tmp_path / "dcp"), str(tmp_path / "imp"), "--job", "j2", *extra)
        assert rc == 0
    live = {"w": torch.zeros(4000)}
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "imp"), memory={"enabled": False}), job="j2") as ck:
        assert ck.restore(live) == 7 and torch.equal(live["w"], torch.arange(4000.0))


# ---------------------------------------------------------------------- item 14: memory retention lists keep + 1
def test_memory_tier_keeps_exactly_memory_keep_steps(make_config):
    for keep in (1, 2):
        cfg = make_config(memory={"keep": keep})
        with Checkpointer(cfg, job=f"ret{keep}") as ck:
            for s in range(1, 5):
                ck.save({"w": torch.full((1000,), float(s))}, s)
                assert ck.wait(s, timeout=60)
            in_memory = [i.step for i in ck.steps() if "memory" in i.tiers]
            assert in_memory == list(range(5 - keep, 5)), (keep, in_memory)  # was keep + 1 steps
            live = {"w": torch.zeros(1000)}
            assert ck.restore(live) == 4 and ck.last_restore_tier == "memory"
            assert torch.equal(live["w"], torch.full((1000,), 4.0))


def test_a_staging_area_removed_under_the_trainer_is_reallocated(make_config, caplog):
    """`rm -rf /dev/shm/trainguard/<job>` (or a sibling run of the same job name ending) while a trainer runs:
    its next save raised FileNotFoundError into the training step instead of staging anew."""
    import shutil

    cfg = make_config(persist={"service": "inline"})
    with Checkpointer(cfg, job="gone") as ck:
        ck.save({"w": torch.full((1000,), 1.0)}, 1)
        assert ck.wait(1, timeout=60)
        shutil.rmtree(os.path.join(cfg.memory.directory, "gone"))
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
            h = ck.save({"w": torch.full((1000,), 2.0)}, 2)
        assert h.wait(timeout=60) and sorted(h.tiers_done) == ["disk", "memory"]
        assert any("was removed by another process" in r.getMessage() for r in caplog.records)
    live = {"w": torch.zeros(1000)}
    with Checkpointer(cfg, job="gone") as ck2:
        assert ck2.restore(live) == 2
    assert torch.equal(live["w"], torch.full((1000,), 2.0))


def test_outgrown_shm_slots_are_removed_once_a_newer_step_is_on_disk(make_config, small_tmpfs):
    """After the state outgrew its slots in a container-sized /dev/shm, the old slots stayed until close(): most
    of the 1 MiB tmpfs stayed taken for the whole run (DataLoader workers share tensors through /dev/shm), for
    copies older than the disk's. They go once this rank's first newer step is on disk."""
    cfg = make_config(memory={"directory": str(small_tmpfs), "keep": 1, "fallback": "disk"})
    small = {"w": torch.randn(60_000)}
    grown = {k: torch.randn(60_000) for k in ("w", "m", "v", "g")}
    with Checkpointer(cfg, job="grow") as ck:
        ck.prepare(small)
        assert ck.save(small, 1).wait(timeout=60) and ck.staging == "memory"
        assert ck.save(grown, 2).wait(timeout=60) and ck.staging == "disk"
        deadline = time.monotonic() + 10
        while os.listdir(small_tmpfs):
            assert time.monotonic() < deadline, f"outgrown slots still in /dev/shm: {os.listdir(small_tmpfs)}"
            time.sleep(0.02)
        assert ck.save(grown, 3).wait(timeout=60) and [s.step for s in ck.steps()][-2:] == [2, 3]
        live = {k: torch.zeros(60_000) for k in grown}
        assert ck.restore(live) == 3 and all(torch.equal(live[k], grown[k]) for k in grown)
