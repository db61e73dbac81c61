"""A job where one rank hangs outside any collective while the others wait for it in an all-reduce.

Usage: hang_ranks.py RANK WORLD STORE_FILE STUCK_RANK READY_DIR
Each rank touches READY_DIR/<rank> just before it blocks.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def load_batch(ready: str) -> None:
    """The stuck rank: a data loader that never returns."""
    open(ready, "w").close()
    while True:
        time.sleep(1.0)


def main() -> None:
    rank, world, store_file, stuck, ready_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
        sys.argv[5]
    store = dist.FileStore(store_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    t = torch.ones(4)
    dist.all_reduce(t)
    ready = os.path.join(ready_dir, str(rank))
    if rank == stuck:
        load_batch(ready)
    open(ready, "w").close()
    dist.all_reduce(t)


if __name__ == "__main__":
    main()
