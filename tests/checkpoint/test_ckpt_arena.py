"""Staging arena behaviour: pre-allocation, slot reuse order across a restart, and the persist throttle."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import time

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.errors import StorageUnavailableError
from trainguard.checkpoint.events import EventSink
from trainguard.checkpoint.staging import StagingArea


def test_prepare_allocates_every_slot_once(make_config):
    state = {"w": torch.randn(1000, 100)}
    with Checkpointer(make_config(memory={"keep": 2}), job="prep") as ck:
        nbytes = ck.prepare(state)
        assert nbytes >= 400_000 and ck.arena.nslots == 3
        sizes = [os.path.getsize(ck.arena.paths(i).data) for i in range(3)]
        assert sizes == [nbytes] * 3
        inode = os.stat(ck.arena.paths(0).data).st_ino
        for s in range(4):
            ck.save(state, s)
            assert ck.wait(s, timeout=30)
        assert os.stat(ck.arena.paths(0).data).st_ino == inode  # reused, never reallocated


def test_restarted_worker_overwrites_oldest_slot_first(make_config):
    cfg = make_config(memory={"keep_on_close": True})
    with Checkpointer(cfg, job="order") as ck:
        for s in (1, 2):
            ck.save({"w": torch.full((10,), float(s))}, s)
            assert ck.wait(s, timeout=30)
    with Checkpointer(cfg, job="order") as ck:  # a successor finds the slots with their step tags
        ck.save({"w": torch.full((10,), 3.0)}, 3)
        assert ck.wait(3, timeout=30)
        # Step 1 sat in slot 0 (the first free one), step 2 in slot 1: the successor reuses slot 0. Slot 1 keeps
        # its bytes and tag, but with memory.keep = 1 it stops being listed once step 3 is in memory.
        tags = [arena_mod.read_tag(ck.arena.paths(i)) for i in range(2)]
        assert tags == ["3", "2"]
        assert sorted(arena_mod.memory_manifests(cfg.memory.directory, "order")) == [3]
    arena_mod.remove_job(cfg.memory.directory, "order")


def test_bandwidth_cap_paces_the_persist(make_config):
    state = {"w": torch.randn(2 << 20)}  # 8 MiB
    with Checkpointer(make_config(persist={"bandwidth_mib_s": 8.0, "chunk_mib": 1}), job="thr") as ck:
        t0 = time.monotonic()
        h = ck.save(state, 1)
        saved = time.monotonic()
        assert h.wait(timeout=60)
        # 8 MiB at 8 MiB/s takes about a second; save() itself must not wait for it.
        assert time.monotonic() - t0 >= 0.8
        assert saved - t0 < time.monotonic() - t0 - 0.5


def test_removing_a_job_arena_spares_ranks_a_live_process_writes(tmp_path) -> None:
    """The arena is keyed by job name only: a second run of the same name on this host ending with code 0
    removed the whole job folder, the first run's live slots included, and that trainer's next save failed."""
    import subprocess
    import sys

    root = str(tmp_path / "shm")
    for rank in (0, 1):
        os.makedirs(arena_mod.rank_dir(root, "same", rank))
        with open(os.path.join(arena_mod.rank_dir(root, "same", rank), "slot_0.data"), "wb") as f:
            f.write(b"x" * 64)
    os.makedirs(os.path.join(root, "same", "replicas"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainguard.checkpoint.arena import ArenaLease; "
         f"ArenaLease({arena_mod.rank_dir(root, 'same', 0)!r}).acquire(); print('held', flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # `trainguard ckpt gc --shm` goes through it too, and says which ranks it left.
        from trainguard.checkpoint import CheckpointConfig
        from trainguard.cli import main

        cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False},
                               persist={"service": "inline"})
        with Checkpointer(cfg, job="same") as ck:
            ck.save({"w": torch.ones(8)}, 1)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["ckpt", "gc", str(tmp_path / "ck"), "--keep", "1", "--shm", root]) == 0
        assert "except ranks [0]: a live process writes them" in out.getvalue()
        assert arena_mod.remove_job(root, "same") == [0]
        assert sorted(os.listdir(os.path.join(root, "same"))) == ["rank_00000"]
        assert os.path.exists(os.path.join(arena_mod.rank_dir(root, "same", 0), "slot_0.data"))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert arena_mod.remove_job(root, "same") == []  # the holder is gone: its lease is free
    assert not os.path.exists(os.path.join(root, "same"))
    assert arena_mod.remove_job(root, "none") == []


def test_an_empty_shm_dir_variable_means_the_default_for_workers_and_service(monkeypatch, tmp_path) -> None:
    """TRAINGUARD_CHECKPOINT_SHM_DIR= (set, empty) made the arena root the working directory, and the agent's
    checkpoint service removed the folder named like the job there when the job ended."""
    from trainguard.checkpoint.config import MemoryTierConfig
    from trainguard.checkpoint.service import CheckpointService

    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", "")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "train.py").write_text("user code")
    assert MemoryTierConfig().directory == "/dev/shm/trainguard"
    svc = CheckpointService(job="mymodel")
    assert svc.shm_dir == "/dev/shm/trainguard"
    svc.stop(remove_memory=False)  # never started: nothing to stop
    assert (tmp_path / "mymodel" / "train.py").exists()


@contextlib.contextmanager
def _tmpfs(path, size: str):
    """A private tmpfs of ``size`` at ``path`` (a container's small /dev/shm), unmounted afterwards."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_preallocation_that_runs_out_gives_back_what_it_allocated(tmp_path) -> None:
    """Ranks racing for a small /dev/shm: the loser's slots allocated before the one that failed stayed
    allocated (unused: it stages elsewhere) until the end of the run. A predecessor's copy in a slot that was
    grown stays intact."""
    mib = 1 << 20
    with _tmpfs(tmp_path / f"shm-{os.getpid()}", "8m") as root:
        first = arena_mod.Arena(root, "race", 0, 3)
        slot = first.get(0, mib)  # a predecessor's 1 MiB copy in slot 0
        slot.map[:4] = b"copy"
        arena_mod.write_tag(first.paths(0), "7")
        first.close()
        before = _free(root)
        arena = arena_mod.Arena(root, "race", 0, 3)
        with pytest.raises(StorageUnavailableError):
            arena.preallocate(3 * mib)  # slot 0 grows, slot 1 fits, slot 2 does not
        assert _free(root) == before
        assert sorted(n for n in os.listdir(arena.dir) if n.endswith(".data")) == ["slot_0.data"]
        with open(arena.paths(0).data, "rb") as f:
            assert os.fstat(f.fileno()).st_size == mib and f.read(4) == b"copy"


def test_sparse_slot_files_do_not_count_as_held_shared_memory(tmp_path) -> None:
    """Slot files were counted by their size: sparse ones (holding no memory) made a too-small /dev/shm look
    big enough, and staging went to shared memory it could not back."""
    mib = 1 << 20
    with _tmpfs(tmp_path / f"shm-{os.getpid()}", "8m") as root:
        d = arena_mod.rank_dir(root, "sparse", 0)
        os.makedirs(d)
        for i in range(2):
            with open(arena_mod.SlotPaths.of(d, i).data, "wb") as f:
                f.truncate(6 * mib)  # a file of 6 MiB holding no memory
        assert arena_mod.staging_shortfall(d, 2, 6 * mib) == 12 * mib - _free(root)
        before = _free(root)
        with pytest.raises(StorageUnavailableError):  # their holes are filled first: never a SIGBUS later
            arena_mod.Arena(root, "sparse", 0, 2).preallocate(6 * mib)
        assert _free(root) == before and not [n for n in os.listdir(d) if n.endswith(".data")]
        cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), memory={"directory": root, "fallback": "disk"})
        stage = StagingArea(cfg, "sparse", 0, 2, EventSink(None, 0))
        try:
            stage.ensure(6 * mib)
            assert stage.kind == "disk"
        finally:
            stage.close(remove=True)


def test_a_slot_file_that_cannot_be_created_falls_back_instead_of_raising_into_training(tmp_path) -> None:
    """A /dev/shm out of inodes: creating the second slot file failed with a raw OSError, which went out of
    save() into the training step instead of the documented fallback."""
    with _tmpfs(tmp_path / f"shm-{os.getpid()}", "8m,nr_inodes=5") as root:  # room for slot_0.data only
        cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), memory={"directory": root, "fallback": "disk"})
        with Checkpointer(cfg, job="ino") as ck:
            assert ck.save({"w": torch.ones(1000)}, 1).wait(timeout=30)
            assert ck.staging == "disk"
            assert not [n for n in os.listdir(arena_mod.rank_dir(root, "ino", 0)) if n.endswith(".data")]


def test_a_slot_tag_that_is_not_text_is_a_damaged_slot_not_a_crash(make_config):
    """A slot's tag file holding bytes that are not UTF-8 (damaged /dev/shm contents) raised UnicodeDecodeError out
    of the next Checkpointer's restore: the job could not start although the disk tier held the step."""
    cfg = make_config(memory={"keep_on_close": True})
    with Checkpointer(cfg, job="tag") as ck:
        for s in (1, 2):
            assert ck.save({"w": torch.full((10,), float(s))}, s).wait(timeout=30)
        tag = ck.arena.paths(ck._status[2].slot).tag
    with open(tag, "wb") as f:
        f.write(b"\xff\xfe2")
    with Checkpointer(cfg, job="tag") as ck:
        w = torch.zeros(10)
        assert ck.restore({"w": w}) == 2 and ck.last_restore_tier == "disk" and w[0].item() == 2.0
        assert ck.save({"w": torch.full((10,), 3.0)}, 3).wait(timeout=30)


def test_the_first_job_makes_the_host_wide_root_writable_by_every_user(tmp_path) -> None:
    """A launcher that made /dev/shm/trainguard with the umask's 0755 kept every other user's jobs on the host out
    of the in-memory tier: the root is made 1777, as /dev/shm is; a job's own folders stay the owner's."""
    import stat

    from trainguard.checkpoint.staging import StagingArea

    root = tmp_path / "shm" / "trainguard"
    cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), memory={"directory": str(root)})
    stage = StagingArea(cfg, "shared-root", 0, 2, EventSink(None, 0))
    old = os.umask(0o022)
    try:
        stage.ensure(4096)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(root / "shared-root").st_mode) == 0o755
        # A root that exists keeps the mode it has (an operator's choice, or the daemon's).
        kept = tmp_path / "kept"
        kept.mkdir(mode=0o700)
        arena_mod.make_shared_root(str(kept))
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o700
    finally:
        stage.close(remove=True)


def test_a_fallback_in_the_jobs_checkpoint_folder_stays_private(tmp_path) -> None:
    """Only the roots every job of the host shares are made 1777: anonymous-memory staging with a disk tier keeps
    its lease files in ``<checkpoint dir>/.trainguard-staging``, which is the job's own."""
    import stat

    from trainguard.checkpoint.staging import StagingArea

    cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), memory={"directory": str(tmp_path / "shm"),
                                                                     "fallback": "host"})
    stage = StagingArea(cfg, "private-fallback", 0, 2, EventSink(None, 0))
    kind, where = stage.fallback()
    assert kind == "host" and where == str(tmp_path / "ckpt" / ".trainguard-staging")
    old = os.umask(0o022)
    try:
        stage.fall_back(4096, 4096)
    finally:
        os.umask(old)
        stage.close(remove=True)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o755


def test_a_shortfall_lost_to_another_process_is_not_called_zero_mib() -> None:
    # Two ranks starting together on a small tmpfs: the room checked was taken by the other before this rank's
    # allocation, and the warning said "0.0 MiB short" (black-box review).
    from trainguard.checkpoint.staging import _short

    assert _short(0, raced=True) == "1 bytes short (another process took the room while these were allocated)"
    assert _short(3 * 2**20) == "3.0 MiB short" and _short(4096) == "4096 bytes short"
