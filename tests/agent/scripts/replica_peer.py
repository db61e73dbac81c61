"""A replica peer in its own process, for kill -9 tests of peer replication.

``serve ROOT JOB PORTFILE``: runs a MemoryReplica server whose replicas go under ROOT, writes its address to
PORTFILE, and serves until killed. ``push ADDRESS ROOT JOB RANK MIB_S``: pushes rank RANK's newest copy in the
arena under ROOT to ADDRESS at MIB_S MiB/s, prints ``ok`` or the refusal, exits. ``fetch ADDRESS ROOT JOB RANK``:
fetches rank RANK's copy from ADDRESS into the arena under ROOT as a replacement node does, writing each piece
slowly (a loaded tmpfs) so that a test can kill it mid-transfer.
"""

from __future__ import annotations

import os
import sys
import time

from trainguard.agent.memory_tier import MemoryTier
from trainguard.agent.replica_transport import ReplicaServer, ReplicaServicer, Throttle, copy_stream, fetch, push
from trainguard.checkpoint.replica_store import ReplicaStore, arena_writer


def main() -> None:
    cmd = sys.argv[1]
    if cmd == "serve":
        root, job, portfile = sys.argv[2:5]
        tier = MemoryTier(root, job, "/ckpt")
        server = ReplicaServer(ReplicaServicer(job, ReplicaStore(root, job, 1 << 30), tier.own_copy, node_id="b"),
                               "127.0.0.1")
        with open(portfile + ".tmp", "w") as f:
            f.write(server.address)
        os.replace(portfile + ".tmp", portfile)
        while True:
            time.sleep(1)
    elif cmd == "push":
        address, root, job, rank, mib_s = sys.argv[2:7]
        tier = MemoryTier(root, job, "/ckpt")
        tier.scan()
        data, man = tier.own_copy(int(rank))
        ack = push(address, copy_stream(job, man, data, "pusher", Throttle(float(mib_s))), 60.0)
        print("ok" if ack.ok else ack.error, flush=True)
    elif cmd == "fetch":
        address, root, job, rank = sys.argv[2:6]

        def slow_writer(man):
            w = arena_writer(root, job, man)
            write = w.write

            def slowly(offset: int, data: bytes) -> None:
                time.sleep(0.2)
                write(offset, data)

            w.write = slowly
            return w

        fetch(address, job, int(rank), 0, slow_writer, 60.0)
        print("ok", flush=True)


if __name__ == "__main__":
    main()
