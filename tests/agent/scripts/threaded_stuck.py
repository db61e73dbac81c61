"""A worker stuck in load_batch() beside helper threads waiting on an event (as a heartbeat thread, data-loader
pinning, tqdm and wandb do), with the faulthandler dump handler installed. Args: helper threads, dump directory,
marker file touched once stuck."""

import sys
import threading
import time

from trainguard.detectors.stackdump import install_stack_dump_handler


def helper(depth: int, ev: threading.Event) -> None:
    if depth:
        return helper(depth - 1, ev)
    ev.wait()


def load_batch(marker: str) -> None:
    open(marker, "w").close()
    while True:
        time.sleep(0.05)


install_stack_dump_handler(sys.argv[2])
stop = threading.Event()
for i in range(int(sys.argv[1])):
    threading.Thread(target=helper, args=(8, stop), name=f"helper{i}", daemon=True).start()
load_batch(sys.argv[3])
