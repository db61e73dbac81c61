"""Peer replication benchmark: the time to get a snapshot off the node into a buddy's memory, and to fetch it
back onto a replacement, against the disk tier measured in the same run.

Usage: python bench/bench_replication.py [--mib 256] [--repeats 3] [--dir /var/tmp] [--json out.json]
       [--components-out bench/components/replication.json]

One rank's snapshot of ``--mib`` MiB (random bytes, a real manifest with xxh3 chunk checksums) lies in a
shared-memory arena, as the persist process leaves it. Measured, each ``--repeats`` times (median printed):

* **replicate**: the node agent's push (:mod:`trainguard.agent.replica_transport`) to a buddy agent in another
  process over gRPC on loopback: the sender checks every chunk, the receiver stages, verifies, publishes;
  uncapped, then under the default 1024 MiB/s cap;
* **fetch**: a replacement node's fetch of that replica into its own arena (stage, verify, publish as a slot);
* baselines: **persist to disk**, the disk tier's own write path (``trainguard.checkpoint.writer``: checksums,
  write, fsync, rename, directory fsync) of the same bytes; **read from disk**, reading and verifying that file
  with the page cache dropped where allowed; **restore from memory**, verifying the local arena copy.

``--components-out`` writes the replication time carried to a 405B job's 2.58 GiB per node (the size
``bench/components/checkpoint-2gib.json`` uses) as the ETTR model's ``persist_s``: with peer replication the
newest snapshot a node-level recovery can use is the newest one replicated, no longer the newest persisted to
remote storage (the 60 s assumed before).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

NODE_STATE_GIB = 2.58  # a 405B-parameter job's checkpoint state per node (bench/components/checkpoint-2gib.json)


def _snapshot(root: str, mib: int) -> tuple[str, object]:
    """One rank's copy in the arena under ``root``; returns (data path, manifest)."""
    from trainguard.checkpoint.arena import Arena, write_tag
    from trainguard.checkpoint.manifest import Manifest, compute_checksums, plan_layout

    entries, nbytes = plan_layout([("w", "uint8", (mib << 20,))], 4096)
    arena = Arena(root, "bench", 0, 2)
    s = arena.get(0, nbytes)
    block = os.urandom(1 << 20)
    for o in range(0, nbytes, 1 << 20):
        s.map[o:o + (1 << 20)] = block[:min(1 << 20, nbytes - o)]
    s.map[:8] = os.urandom(8)
    man = Manifest(job="bench", step=1, rank=0, world_size=1, tensors=entries, tree={}, data_bytes=nbytes,
                   created=time.time(), location="/bench")
    man.chunks = compute_checksums(memoryview(s.map), nbytes, man.chunk_bytes)
    with open(s.paths.manifest, "wb") as f:
        f.write(man.to_json())
    write_tag(s.paths, "1")
    return s.paths.data, man


def _serve(root: str, portfile: str) -> None:
    """The buddy: a replica server in its own process (own GIL, as on another node)."""
    from trainguard.agent.memory_tier import MemoryTier
    from trainguard.agent.replica_transport import ReplicaServer, ReplicaServicer
    from trainguard.checkpoint.replica_store import ReplicaStore

    tier = MemoryTier(root, "bench", "/bench")
    server = ReplicaServer(ReplicaServicer("bench", ReplicaStore(root, "bench", 1 << 40), tier.own_copy),
                           "127.0.0.1")
    with open(portfile + ".tmp", "w") as f:
        f.write(server.address)
    os.replace(portfile + ".tmp", portfile)
    while True:
        time.sleep(1)


def _drop_cache(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="snapshot size, MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="disk-tier directory of the baseline (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--components-out", default=None)
    ap.add_argument("--serve", nargs=2, metavar=("ROOT", "PORTFILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve(*args.serve)
        return

    import torch

    from trainguard.agent.replica_transport import Throttle, copy_stream, fetch, push
    from trainguard.checkpoint.reader import RankCopy
    from trainguard.checkpoint.replica_store import arena_writer
    from trainguard.checkpoint.storage import LocalStore
    from trainguard.checkpoint.writer import write_rank_step

    tag = uuid.uuid4().hex[:8]
    src, buddy, repl = (f"/dev/shm/tg-bench-repl-{tag}-{n}" for n in ("src", "buddy", "new"))
    disk = tempfile.mkdtemp(prefix="tg-bench-repl-", dir=args.dir)
    portfile = os.path.join(disk, "port")
    server = subprocess.Popen([sys.executable, __file__, "--serve", buddy, portfile])
    out: dict[str, object] = {"mib": args.mib, "repeats": args.repeats}
    try:
        data_path, man = _snapshot(src, args.mib)
        deadline = time.monotonic() + 60
        while not os.path.exists(portfile):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the buddy's replica server did not start")
            time.sleep(0.05)
        address = open(portfile).read()
        nbytes = man.data_bytes

        def timed(fn) -> list[float]:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times

        steps = iter(range(2, 1_000_000))

        def replicate(cap: float) -> None:
            # a new step each time: the buddy takes a copy it already holds without receiving it, which would
            # time nothing
            sent = dataclasses.replace(man, step=next(steps))
            ack = push(address, copy_stream("bench", sent, data_path, "bench", Throttle(cap)), 600)
            assert ack.ok and ack.bytes == nbytes, ack

        push_s = timed(lambda: replicate(0))
        capped_s = timed(lambda: replicate(1024))
        fetch_s = timed(lambda: fetch(address, "bench", 0, 1, lambda m: arena_writer(repl, "bench", m), 600))

        tensor = torch.frombuffer(bytearray(open(data_path, "rb").read(nbytes)), dtype=torch.uint8)
        store = LocalStore(disk, "bench")
        persist_s = timed(lambda: write_rank_step(store, 1, 0, 1, {"w": {"tensor": 0}}, [("w", tensor)]))
        disk_file = store.local_data_path(1, 0)
        dropped = _drop_cache(disk_file)

        def read_disk() -> None:
            _drop_cache(disk_file)
            with RankCopy(man, disk_file, "disk copy") as c:
                c.verify()

        def read_memory() -> None:
            with RankCopy(man, data_path, "memory copy", shared_lock=True) as c:
                c.verify()

        disk_read_s = timed(read_disk)
        memory_s = timed(read_memory)
        med = {k: statistics.median(v) for k, v in (("replicate_s", push_s), ("replicate_capped_s", capped_s),
                                                     ("fetch_s", fetch_s), ("persist_disk_s", persist_s),
                                                     ("read_disk_s", disk_read_s), ("restore_memory_s", memory_s))}
        mib = nbytes / (1 << 20)
        rate = mib / med["replicate_s"]
        out.update(med, all={"replicate_s": push_s, "replicate_capped_s": capped_s, "fetch_s": fetch_s,
                             "persist_disk_s": persist_s, "read_disk_s": disk_read_s, "restore_memory_s": memory_s},
                   replicate_mib_s=rate, page_cache_dropped=dropped)
        print(f"snapshot of {mib:.0f} MiB, median of {args.repeats}:")
        print(f"  replicate to the buddy's memory (gRPC, uncapped)   {med['replicate_s']:.3f} s  ({rate:.0f} MiB/s)")
        print(f"  replicate under the default 1024 MiB/s cap        {med['replicate_capped_s']:.3f} s")
        print(f"  baseline: persist to local disk (fsync)            {med['persist_disk_s']:.3f} s  "
              f"(replication {med['persist_disk_s'] / med['replicate_s']:.1f}x faster)")
        print(f"  fetch from the buddy into a new node's arena       {med['fetch_s']:.3f} s")
        print(f"  baseline: read + verify from local disk{'' if dropped else ' (cache warm)'}       "
              f"{med['read_disk_s']:.3f} s  (fetch {med['read_disk_s'] / med['fetch_s']:.2f}x of it)")
        print(f"  restore from local memory (verify in place)        {med['restore_memory_s']:.3f} s")
        at_scale = NODE_STATE_GIB * 1024 / min(rate, 1024.0)
        out["persist_s_at_scale"] = at_scale
        print(f"  carried to {NODE_STATE_GIB} GiB per node at min(measured rate, 1024 MiB/s cap): {at_scale:.2f} s "
              "to have the newest snapshot in the buddy's memory (was: 60 s assumed to reach remote storage)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        if args.components_out:
            with open(args.components_out, "w") as f:
                json.dump({"_source": f"bench/bench_replication.py --mib {args.mib} --repeats {args.repeats}: one "
                                      f"rank's {mib:.0f} MiB snapshot replicated to a buddy agent's memory over gRPC "
                                      f"at {rate:.0f} MiB/s on this machine; carried to {NODE_STATE_GIB} GiB per "
                                      "node at min(that rate, the default 1024 MiB/s cap)",
                           "_measured": {k: round(v, 4) for k, v in med.items()} | {"replicate_mib_s": round(rate)},
                           "trainguard": {"persist_s": round(at_scale, 3)}}, f, indent=1)
    finally:
        server.kill()
        server.wait()
        for d in (src, buddy, repl):
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
