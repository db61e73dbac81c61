"""A long-lived writer process driven over stdin, for the isolation tests.

Usage: python ckpt_trainer.py CONFIG_JSON JOB RANK WORLD
Commands (one per line): ``save N`` (saves a state derived from N, waits, prints ``saved N True|False`` or
``error N <message>``), ``fork S`` (forks a child that sleeps S seconds, prints ``forked <pid>``), ``exit``
(closes and prints ``closed``). Prints ``ready <pid>`` first.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer


def state_for(step: int) -> dict:
    """The deterministic state saved at ``step``."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "step": step}


def main() -> None:
    cfg = CheckpointConfig.from_dict(json.loads(sys.argv[1]))
    ck = Checkpointer(cfg, rank=int(sys.argv[3]), world_size=int(sys.argv[4]), job=sys.argv[2])
    print(f"ready {os.getpid()}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "save":
            n = int(cmd[1])
            try:
                ck.save(state_for(n), n)
                print(f"saved {n} {ck.wait(n, timeout=60)}", flush=True)
            except Exception as exc:  # reported to the test, which decides
                print(f"error {n} {type(exc).__name__}: {exc}", flush=True)
        elif cmd[0] == "fork":
            # Like a DataLoader worker: a forked child inherits every descriptor and may outlive this process.
            pid = os.fork()
            if pid == 0:
                import time

                time.sleep(float(cmd[1]))
                os._exit(0)
            print(f"forked {pid}", flush=True)
        elif cmd[0] == "exit":
            break
    ck.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
