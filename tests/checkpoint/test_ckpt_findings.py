"""Regression tests for the findings of issue 13: containers (small /dev/shm), isolation between a writer and
readers, re-saved steps, full/read-only disks, in-process remotes, all-corrupt restores, mismatched and
unsupported tensors."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from ckpt_helpers import ask, start_trainer
from ckpt_trainer import state_for
from tg_testutil import fill_fs

from trainguard.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    Checkpointer,
    CorruptCheckpointError,
    StateMismatchError,
)
from trainguard.checkpoint import staging
from trainguard.checkpoint.arena import rank_dir
from trainguard.checkpoint.errors import ArenaOwnedError, CheckpointConfigError, UnsupportedValueError
from trainguard.checkpoint.storage import data_name, step_dirname

HERE = Path(__file__).parent


# ---------------------------------------------------------------------- (a) containers
@pytest.mark.parametrize("memory_enabled", [True, False])
def test_small_shm_falls_back_to_disk_staging_and_says_how_to_fix(make_config, small_tmpfs, caplog,
                                                                  memory_enabled):
    # "disk" pinned: with the default "auto" a CUDA node stages in page-locked host memory instead
    # (test_ckpt_cuda.py covers that path).
    cfg = make_config(memory={"directory": str(small_tmpfs), "enabled": memory_enabled, "fallback": "disk"})
    state = {"w": torch.randn(400_000), "step": 7}  # 1.6 MB: two slots cannot fit in 1 MiB
    events = []
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        with Checkpointer(cfg, job="c", on_event=events.append) as ck:
            ck.prepare(state)
            assert ck.staging == "disk"
            h = ck.save(state, 7)
            assert h.wait(timeout=60) and h.tiers_done == ["disk"]
            ck.save(state, 8)
            assert ck.wait(8, timeout=60)
            assert [s.step for s in ck.steps()] == [7, 8]
    assert os.listdir(small_tmpfs) == []  # nothing was staged in the small tmpfs
    assert [e.kind for e in events] == ["checkpoint.staging_fallback"]
    warnings = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
    assert len(warnings) == 1
    for needle in ("/dev/shm", "--shm-size", "emptyDir", "medium: Memory", "checkpoint.memory.directory",
                   str(small_tmpfs)):
        assert needle in warnings[0], needle
    live = {"w": torch.zeros(400_000), "step": 0}
    with Checkpointer(cfg, job="c") as ck2:
        assert ck2.restore(live) == 8 and ck2.last_restore_tier == "disk"
    assert torch.equal(live["w"], state["w"]) and live["step"] == 7
    assert not os.path.exists(os.path.join(cfg.disk_directory, ".trainguard-staging", "c"))  # removed on close


def test_small_shm_host_memory_fallback(make_config, small_tmpfs):
    """The fallback CUDA nodes get by default (anonymous memfd slots; page-locked there), forced on CPU."""
    cfg = make_config(memory={"directory": str(small_tmpfs), "fallback": "host"})
    state = {"w": torch.randn(400_000)}
    events = []
    with Checkpointer(cfg, job="h", on_event=events.append) as ck:
        ck.save(state, 1)
        assert ck.wait(1, timeout=60) and ck.staging == "host"
        assert ck.arena.slots[0].paths.data.startswith(f"/proc/{os.getpid()}/fd/")
    assert os.listdir(small_tmpfs) == [] and [e.evidence["fallback"] for e in events] == ["host"]
    live = {"w": torch.zeros(400_000)}
    with Checkpointer(cfg, job="h") as ck2:
        assert ck2.restore(live) == 1 and torch.equal(live["w"], state["w"])


def test_state_fitting_small_shm_still_uses_memory(make_config, small_tmpfs):
    cfg = make_config(memory={"directory": str(small_tmpfs)})
    with Checkpointer(cfg, job="fits") as ck:
        ck.save({"w": torch.ones(1000)}, 1)
        assert ck.wait(1, timeout=30) and ck.staging == "memory"


# ---------------------------------------------------------------------- (b) isolation


@pytest.mark.parametrize("reader_memory", [True, False])
def test_reader_never_removes_the_writers_area_and_a_second_writer_is_refused(make_config, reader_memory, tmp_path,
                                                                               monkeypatch, caplog):
    cfg = make_config()
    # The checkpoint folder's filesystem, as the kernel's mount table gives it (local here; NFS further down).
    mounts = tmp_path / "mountinfo"
    mount_line = f"36 22 0:40 / {os.path.realpath(tmp_path)} rw,relatime - {{}} server:/export rw\n"
    mounts.write_text("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n" + mount_line.format("ext4"))
    monkeypatch.setattr(staging, "MOUNTINFO", str(mounts))
    trainer = start_trainer(cfg, "iso")
    try:
        assert ask(trainer, "save 1") == "saved 1 True"
        area = rank_dir(cfg.memory.directory, "iso", 0)
        assert os.path.isdir(area)
        # An evaluation job / notebook restores from the same directory and job, then closes.
        reader_cfg = make_config(memory={"enabled": reader_memory})
        live = {"w": torch.zeros(256, 64), "step": -1}
        with Checkpointer(reader_cfg, job="iso") as reader:
            assert reader.restore(live) == 1
            assert reader.last_restore_tier == ("memory" if reader_memory else "disk")
        assert torch.equal(live["w"], state_for(1)["w"])
        assert os.path.isdir(area)
        assert ask(trainer, "save 2") == "saved 2 True"  # the trainer's next save still works
        # A second writer for the same (job, rank) is refused with a clear error naming the owner.
        with Checkpointer(cfg, job="iso") as intruder:
            with pytest.raises(ArenaOwnedError, match=f"process {trainer.pid} already writes"):
                intruder.save({"w": torch.ones(3)}, 5)
        # So is one given another memory directory (another container's /dev/shm) on the same checkpoint folder:
        # it wrote every step there too, each process overwriting the other's files, with no word.
        elsewhere = make_config(memory={"directory": cfg.memory.directory + "-elsewhere"})
        with Checkpointer(elsewhere, job="iso") as intruder:
            with pytest.raises(ArenaOwnedError, match=f"process {trainer.pid} already writes.*trainguard-writers"):
                intruder.save({"w": torch.ones(3)}, 5)
        assert ask(trainer, "save 3") == "saved 3 True"
        # On a filesystem shared between hosts the lease may be a lost node's lock that the file server keeps until
        # it expires (NFSv4: 90 s) while the replacement runs the rank: refusing failed every save of the
        # replacement for that long. There it is a warning naming the holder, and the save goes ahead.
        mounts.write_text("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n" + mount_line.format("nfs4"))
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint.staging"):
            with Checkpointer(elsewhere, job="iso") as intruder:
                intruder.save({"w": torch.ones(3)}, 6)
                assert intruder.wait(6, timeout=30)
        warned = [r.getMessage() for r in caplog.records if "shared between hosts" in r.getMessage()]
        assert len(warned) == 1 and f"process {trainer.pid} already writes" in warned[0], caplog.text
    finally:
        trainer.kill()
        trainer.wait()
        shutil.rmtree(cfg.memory.directory + "-elsewhere", ignore_errors=True)


def test_filesystem_type_reads_the_kernel_mount_table(tmp_path):
    """The longest mount point above a path decides, and octal escapes in mount points are decoded."""
    table = tmp_path / "mountinfo"
    table.write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                     "40 22 0:50 / /mnt/ckpt\\040dir rw - nfs4 fs:/x rw\n"
                     "41 40 0:51 / /mnt/ckpt\\040dir/local rw - xfs /dev/sdb rw\n")
    assert staging.filesystem_type("/mnt/ckpt dir/job", str(table)) == "nfs4"
    assert staging.filesystem_type("/mnt/ckpt dir/local/job", str(table)) == "xfs"
    assert staging.filesystem_type("/mnt/ckptdir", str(table)) == "ext4"
    assert staging.filesystem_type("/x", str(tmp_path / "missing")) == ""


def test_crashed_owners_area_is_reclaimed(make_config):
    cfg = make_config()
    trainer = start_trainer(cfg, "crash")
    child = 0
    try:
        assert ask(trainer, "save 1") == "saved 1 True"
        # A forked child (a DataLoader worker) holds copies of every descriptor and outlives the trainer here:
        # it must not keep the lease from the successor.
        child = int(ask(trainer, "fork 60").split()[1])
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
    try:
        _check_successor(cfg)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)


def _check_successor(cfg: CheckpointConfig) -> None:
    with Checkpointer(cfg, job="crash") as ck:
        live = {"w": torch.zeros(256, 64), "step": -1}
        assert ck.restore(live) == 1 and ck.last_restore_tier == "memory"  # the crashed owner's copy serves
        ck.save(state_for(2), 2)  # the successor takes the lease and reuses the slots
        assert ck.wait(2, timeout=30)
        assert ck.restore(live) == 2 and ck.last_restore_tier == "memory"
        assert torch.equal(live["w"], state_for(2)["w"])


def test_second_writer_in_the_same_process_is_refused(make_config):
    with Checkpointer(make_config(), job="same") as a, Checkpointer(make_config(), job="same") as b:
        a.save({"w": torch.ones(3)}, 1)
        with pytest.raises(ArenaOwnedError, match=f"this process \\({os.getpid()}\\) already writes"):
            b.save({"w": torch.ones(3)}, 1)
        assert a.wait(1, timeout=30)
        a.save({"w": torch.ones(3)}, 2)  # the first writer's lease is intact
        assert a.wait(2, timeout=30)


# ---------------------------------------------------------------------- (c) re-save
def test_resaving_a_step_replaces_the_memory_copy(make_config):
    with Checkpointer(make_config(memory={"keep": 2}), job="re") as ck:
        ck.save({"w": torch.full((100,), 1.0)}, 5)
        assert ck.wait(5, timeout=30)
        ck.save({"w": torch.full((100,), 2.0)}, 5)
        assert ck.wait(5, timeout=30)
        live = torch.zeros(100)
        assert ck.restore({"w": live}) == 5 and ck.last_restore_tier == "memory"
        assert torch.equal(live, torch.full((100,), 2.0))
        ck.save({"w": torch.full((100,), 3.0)}, 6)
        ck.save({"w": torch.full((100,), 4.0)}, 5)  # lower step again: still one copy of 5
        assert ck.wait(5, timeout=30)
        assert ck.restore({"w": live}, step=5) == 5 and ck.last_restore_tier == "memory"
        assert torch.equal(live, torch.full((100,), 4.0))


# ---------------------------------------------------------------------- (d) full / read-only disk
def test_restore_works_on_a_full_then_read_only_disk(tmp_path, make_config):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        cfg = make_config(directory=str(mnt / "ck"), memory={"enabled": False})
        w = torch.randn(1000)
        with Checkpointer(cfg, job="d") as ck:
            ck.save({"w": w}, 3)
            assert ck.wait(3, timeout=30)
        with open(mnt / "filler", "wb") as f:  # fill the disk
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
        events = []
        for _ in range(2):
            with Checkpointer(cfg, job="d", on_event=events.append) as ck:
                live = torch.zeros(1000)
                assert ck.restore({"w": live}) == 3 and torch.equal(live, w)
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        assert [e.kind for e in events] == ["checkpoint.disk_full", "checkpoint.storage_unwritable"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------------- (e) in-process remote
def test_in_process_remote_is_refused(tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.remote.url = 'memory://b'.*in-process"):
        CheckpointConfig(directory=str(tmp_path), remote={"url": "memory://b"})
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.directory = 'memory://x'"):
        CheckpointConfig(directory="memory://x")


# ---------------------------------------------------------------------- (f) all corrupt
def test_all_committed_steps_corrupt_raises_unless_corrupt_ok(make_config):
    cfg = make_config(memory={"enabled": False})
    with Checkpointer(cfg, job="bad") as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((5000,), float(s))}, s)
            assert ck.wait(s, timeout=30)
    for s in (1, 2):
        path = os.path.join(cfg.disk_directory, "bad", step_dirname(s), data_name(0))
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"\xff\xff")
    with Checkpointer(cfg, job="bad") as ck:
        with pytest.raises(CorruptCheckpointError) as ei:
            ck.restore({"w": torch.zeros(5000)})
        msg = str(ei.value)
        assert "(1, 2)" in msg and "step 2 (disk)" in msg and "step 1 (disk)" in msg and "checksum" in msg
        assert "corrupt_ok=True" in msg
        assert ck.restore({"w": torch.zeros(5000)}, corrupt_ok=True) is None


# ---------------------------------------------------------------------- (g) mismatches, unsupported values
def test_shape_or_dtype_mismatch_names_the_key(make_config):
    with Checkpointer(make_config(), job="mm") as ck:
        ck.save({"w": torch.ones(4, 3), "model": torch.nn.Linear(3, 2)}, 1)
        assert ck.wait(1, timeout=30)
        with pytest.raises(StateMismatchError, match=r"^w: the checkpoint holds float32\[4, 3\], the live tensor "
                                                     r"is float32\[3, 4\]"):
            ck.restore({"w": torch.zeros(3, 4)})
        with pytest.raises(StateMismatchError, match=r"^w: .*float64\[4, 3\]"):
            ck.restore({"w": torch.zeros(4, 3, dtype=torch.float64)})
        with pytest.raises(StateMismatchError, match=r"model.weight: .*float32\[2, 3\].*float32\[5, 3\]"):
            ck.restore({"model": torch.nn.Linear(3, 5)})


@pytest.mark.parametrize("value, needle", [
    (torch.eye(3).to_sparse(), "sparse"),
    (torch.zeros(2, dtype=torch.complex32), "complex32"),
    (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized"),
])
def test_unsupported_tensors_raise_checkpoint_errors(make_config, value, needle):
    with Checkpointer(make_config(), job="u") as ck:
        with pytest.raises(UnsupportedValueError, match=f"extra.t is .*{needle}") as ei:
            ck.save({"extra": {"t": value}}, 1)
        assert isinstance(ei.value, CheckpointError)


def test_unusable_memory_directory_falls_back_too(tmp_path, make_config):
    ro = tmp_path / "ro-shm"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64m", "tmpfs", str(ro)], check=True)
    try:
        events = []
        with Checkpointer(make_config(memory={"directory": str(ro)}), job="ro", on_event=events.append) as ck:
            ck.save({"w": torch.ones(1000)}, 1)
            # the default fallback ("auto"): local disk on a CPU node, page-locked host memory with CUDA
            assert ck.wait(1, timeout=30) and ck.staging == ("host" if torch.cuda.is_available() else "disk")
        assert [e.kind for e in events] == ["checkpoint.staging_fallback"]
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


@pytest.mark.parametrize("leave_pages", [0, 1])
def test_shm_filled_after_allocation_costs_the_memory_tier_only(make_config, small_tmpfs, leave_pages):
    # Full: tagging the slot failed and save() raised at every step (no step reached disk). One page left: the
    # fresh slot's first tag took it, the step's tag found none, and then the persist failed writing the
    # memory-tier manifest (three pages), so the disk copy already written was never committed. Now the first
    # case stages on the disk fallback, the second rewrites the tag in place and loses the memory tier only.
    cfg = make_config(memory={"directory": str(small_tmpfs), "fallback": "disk"},
                      persist={"service": "inline", "alignment": 64})
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(150)}  # a ~12 KB manifest, 10 KB of data
    with Checkpointer(cfg, job="f") as ck:
        ck.prepare(state)
        ck.save(state, 1)
        assert ck.wait(1, timeout=60) and ck.staging == "memory"
        fill_fs(small_tmpfs, leave_pages)
        ck.save(state, 2)
        ck.wait(2, timeout=60)
        assert "disk" in {s.step: s.tiers for s in ck.steps()}[2]


def test_restore_of_a_step_never_committed_names_the_committed_ones(tmp_path):
    """``restore(step=N)`` of a step that is not there (mistyped, or removed by retention) names the steps that
    are, instead of only pointing at ``trainguard ckpt ls``."""
    from trainguard.checkpoint.errors import NoCheckpointError

    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "ck"))) as ck:
        for step in (10, 20, 30):
            ck.save({"w": torch.full((4,), float(step))}, step)
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "ck"))) as ck:
        with pytest.raises(NoCheckpointError, match=r"no committed step 25; its committed steps are 10, 20, 30$"):
            ck.restore({"w": torch.zeros(4)}, step=25)
        live = {"w": torch.zeros(4)}
        assert ck.restore(live, step=20) == 20 and torch.equal(live["w"], torch.full((4,), 20.0))
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "empty"))) as ck:
        with pytest.raises(NoCheckpointError, match=r"its committed steps are none$"):
            ck.restore({"w": torch.zeros(4)}, step=1)
