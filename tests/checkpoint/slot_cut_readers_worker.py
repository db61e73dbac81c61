"""Child of test_ckpt_slot_cut_readers: a shared-memory slot is cut short by another process (truncate(1)) while
the persist process or a restore reads it. Run in its own process: a SIGBUS there must fail the test, not kill
pytest.

Usage:
    slot_cut_readers_worker.py restore SHM DISK CUT   # CUT 0/1; prints ``restored=<step> tier=<t> same=<bool>``
    slot_cut_readers_worker.py persist SHM DISK CUT   # prints each report as ``report <json>``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint import fileio, reader
from trainguard.checkpoint.arena import Arena, write_tag
from trainguard.checkpoint.manifest import Manifest, plan_layout
from trainguard.checkpoint.persist import persist_snapshot


def cut(path: str) -> None:
    """Another process truncates the slot to one page (it ignores the slot's lock, as an operator would)."""
    subprocess.run(["truncate", "-s", "4096", path], check=True)


def restore(shm: str, disk: str, do_cut: bool) -> None:
    cfg = CheckpointConfig(directory=disk, memory={"directory": shm})
    t = torch.randn(2 << 20)  # 8 MiB
    ck = Checkpointer(cfg, job="j")
    ck.save({"t": t}, 1)
    assert ck.wait(1, timeout=30)
    real = reader.RankCopy.__init__

    def opened_then_cut(self, manifest, data_path, where, shared_lock=False, **kw):  # type: ignore[no-untyped-def]
        real(self, manifest, data_path, where, shared_lock=shared_lock, **kw)
        if shared_lock and do_cut:  # the restore holds the slot open: another process cuts it now
            cut(data_path)

    reader.RankCopy.__init__ = opened_then_cut  # type: ignore[method-assign]
    live = torch.zeros_like(t)
    step = ck.restore({"t": live})
    print(f"restored={step} tier={ck.last_restore_tier} same={torch.equal(live, t)}", flush=True)
    ck.close()


def persist(shm: str, disk: str, do_cut: bool) -> None:
    entries, nbytes = plan_layout([("w", "uint8", (8 << 20,))], 4096)
    arena = Arena(shm, "job", 0, 2)
    s = arena.get(0, nbytes)
    s.map[:nbytes] = os.urandom(nbytes)
    write_tag(s.paths, "5")
    man = Manifest(job="job", step=5, rank=0, world_size=1, tensors=entries, tree={}, data_bytes=nbytes,
                   chunk_bytes=1 << 20, created=time.time(), location=disk)
    arena.close()
    prefix = s.paths.data[: -len(".data")]
    req = {"op": "persist", "id": 1, "job": "job", "rank": 0, "world_size": 1, "step": 5, "slot": prefix,
           "manifest": man.to_json().decode(), "memory": True, "disk": {"root": disk, "keep": 3, "fsync": False},
           "remote": None, "bandwidth_mib_s": 0}
    real = fileio.Throttle.account
    calls = [0]

    def account_then_cut(self, n):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2 and do_cut:  # two of eight chunks are on disk: the slot is cut under the persist
            cut(s.paths.data)
        return real(self, n)

    fileio.Throttle.account = account_then_cut  # type: ignore[method-assign]
    persist_snapshot(req, lambda msg: print("report", json.dumps(msg), flush=True))


if __name__ == "__main__":
    {"restore": restore, "persist": persist}[sys.argv[1]](sys.argv[2], sys.argv[3], sys.argv[4] == "1")
