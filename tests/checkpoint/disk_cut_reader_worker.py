"""Child of test_ckpt_disk_cut_reader: a checkpoint data file on the disk tier (or fetched from a ``file://``
remote) is cut short by another process (truncate(1)) while a restore reads it. Run in its own process: a SIGBUS
there must fail the test, not kill pytest.

Usage:
    disk_cut_reader_worker.py disk|remote ROOT CUT   # CUT 0/1; prints ``restored=<step> tier=<t> same=<bool>``
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint import reader


def main(tier: str, root: str, do_cut: bool) -> None:
    disk = os.path.join(root, "disk")
    remote = {"url": "file://" + os.path.join(root, "remote")} if tier == "remote" else {}
    cfg = CheckpointConfig(directory=disk, memory={"enabled": False}, remote=remote)
    older, newer = torch.randn(2 << 20), torch.randn(2 << 20)  # 8 MiB each
    ck = Checkpointer(cfg, job="j")
    for step, t in ((1, older), (2, newer)):
        ck.save({"t": t}, step)
        assert ck.wait(step, timeout=30)
    if tier == "remote":
        ck.close()
        shutil.rmtree(disk)  # the local copies are gone: restore reads the remote's
        ck = Checkpointer(cfg, job="j")
    real = reader.RankCopy.__init__
    opened: list[str] = []

    def opened_then_cut(self, manifest, data_path, where, *a, **kw):  # type: ignore[no-untyped-def]
        real(self, manifest, data_path, where, *a, **kw)
        opened.append(f"{where}: {data_path}")
        if do_cut and manifest.step == 2:  # the restore holds step 2's file open: another process cuts it now
            subprocess.run(["truncate", "-s", "4096", data_path], check=True)

    reader.RankCopy.__init__ = opened_then_cut  # type: ignore[method-assign]
    live = torch.zeros(2 << 20)
    step = ck.restore({"t": live})
    print("opened", opened, flush=True)
    print(f"restored={step} tier={ck.last_restore_tier} same={torch.equal(live, older if step == 1 else newer)}",
          flush=True)
    ck.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
