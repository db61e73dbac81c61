"""A shared-memory slot cut short under a reader: read as a damaged copy, never a SIGBUS.

The node agent's memory tier verified each new in-memory copy through a mapping sized when it opened the slot;
the slot truncated meanwhile (cut back after a failed grow, an operator, a tmpfs cleanup) raised SIGBUS on the
next page past the new end, which killed the agent and every job it served."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint.arena import Arena, write_tag
from trainguard.checkpoint.errors import CorruptCheckpointError, StorageUnavailableError
from trainguard.checkpoint.manifest import Manifest, compute_checksums, plan_layout

WORKER = Path(__file__).parent / "slot_cut_worker.py"


def _copy(root: str, mib: int = 8) -> tuple[arena_mod.SlotPaths, Manifest]:
    """One complete in-memory copy of step 5, rank 0 (as the persist process leaves it)."""
    entries, nbytes = plan_layout([("w", "uint8", (mib << 20,))], 4096)
    arena = Arena(root, "job", 0, 2)
    s = arena.get(0, nbytes)
    s.map[:nbytes] = os.urandom(nbytes)
    man = Manifest(job="job", step=5, rank=0, world_size=1, tensors=entries, tree={}, data_bytes=nbytes,
                   chunk_bytes=3 << 20, created=time.time(), location="/ckpt")  # 3 MiB: chunks across pieces
    man.chunks = compute_checksums(memoryview(s.map), nbytes, man.chunk_bytes)
    with open(s.paths.manifest, "wb") as f:
        f.write(man.to_json())
    write_tag(s.paths, "5")
    paths = s.paths
    arena.close()
    return paths, man


@pytest.mark.parametrize("cut_to", [-1, 4096])
def test_memory_tier_reads_a_slot_cut_short_under_it_as_damaged(shm_dir, cut_to) -> None:
    _copy(shm_dir)
    p = subprocess.run([sys.executable, str(WORKER), shm_dir, str(cut_to)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"the scanning process died (rc {p.returncode}): {p.stderr[-2000:]}"
    if cut_to < 0:
        assert "listed=[5] corrupt=0" in p.stdout  # an intact copy still verifies (streamed digest == one-shot)
    else:
        assert "listed=[] corrupt=1" in p.stdout
        assert "data file ends at byte 4096" in p.stderr and "truncated" in p.stderr


def test_verify_file_checksums_names_where_the_file_ends_and_a_bad_chunk(shm_dir) -> None:
    from trainguard.checkpoint.manifest import verify_file_checksums

    paths, man = _copy(shm_dir, mib=4)
    fd = os.open(paths.data, os.O_RDWR)
    try:
        verify_file_checksums(fd, man, "copy")
        os.pwrite(fd, b"\xff" * 8, (3 << 20) + 5)
        with pytest.raises(CorruptCheckpointError, match=r"chunk 1 \(bytes 3145728\.\.4194304\)"):
            verify_file_checksums(fd, man, "copy")
        os.ftruncate(fd, 1 << 20)
        with pytest.raises(CorruptCheckpointError, match="ends at byte 1048576, manifest says 4194304"):
            verify_file_checksums(fd, man, "copy")
    finally:
        os.close(fd)


def test_a_failed_grow_does_not_cut_back_a_slot_a_reader_holds(small_tmpfs) -> None:
    """preallocate's cut-back after a failed grow (a 1 MiB /dev/shm) truncated a slot holding a copy without its
    lock, under a reader that may have mapped the grown file (the agent's memory tier, a restore)."""
    root = str(small_tmpfs)
    entries, small = plan_layout([("w", "uint8", (256 << 10,))], 4096)
    arena = Arena(root, "job", 0, 2)
    s = arena.get(0, small)
    paths = s.paths
    write_tag(paths, "5")  # slot 0 holds a predecessor's copy: cut back, never removed
    arena.close()
    with pytest.raises(StorageUnavailableError):
        Arena(root, "job", 0, 2).preallocate(600 << 10)  # slot 0 grows, slot 1 finds no room
    assert os.path.getsize(paths.data) == small  # nobody reads it: cut back, the memory is given back
    fd = os.open(paths.data, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and the cut-back left no lock behind
    finally:
        os.close(fd)
    reader = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()", paths.data],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "held"
        with pytest.raises(StorageUnavailableError):
            Arena(root, "job", 0, 2).preallocate(600 << 10)
        assert os.path.getsize(paths.data) == 600 << 10  # left whole: the reader may have mapped all of it
    finally:
        reader.stdin.close()
        reader.wait(timeout=10)
