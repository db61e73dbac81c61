"""Peer replicas in a node's memory (checkpoint/replica_store.py): published only when every chunk verified,
never a torn or corrupt copy, leftovers of a killed receiver cleaned, only the newest copy per rank, a memory
bound that evicts other replicas (never the node's own snapshots) and refuses what cannot fit, and a copy
installed straight into the arena that the memory tier lists."""

from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest

from trainguard.checkpoint.arena import memory_manifests
from trainguard.checkpoint.manifest import Manifest, compute_checksums, plan_layout
from trainguard.checkpoint.replica_store import ReplicaRefusedError, ReplicaStore, arena_writer


@pytest.fixture
def root():
    d = f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _copy(rank: int, step: int, kib: int = 64, fill: int = 3, location: str = "/ckpt") -> tuple[Manifest, bytes]:
    entries, nbytes = plan_layout([("w", "uint8", (kib << 10,))], 4096)
    data = bytes([(fill + i) % 251 for i in range(256)]) * (nbytes // 256)
    man = Manifest(job="job", step=step, rank=rank, world_size=4, tensors=entries, tree={}, data_bytes=nbytes,
                   chunk_bytes=16 << 10, created=time.time(), location=location)
    man.chunks = compute_checksums(memoryview(data), nbytes, man.chunk_bytes)
    return man, data


def _send(store_or_writer, man: Manifest, data: bytes, upto: int | None = None):
    w = store_or_writer.begin(man) if isinstance(store_or_writer, ReplicaStore) else store_or_writer
    for o in range(0, len(data) if upto is None else upto, 8192):
        w.write(o, data[o:o + 8192])
    return w


def test_publish_only_verified_copies(root) -> None:
    store = ReplicaStore(root, "job", 1 << 20)
    man, data = _copy(1, 10)
    w = _send(store, man, data, upto=len(data) // 2)
    assert store.replicas() == []  # arriving: not listed
    with pytest.raises(ReplicaRefusedError, match="torn"):
        w.commit()
    bad = bytearray(data)
    bad[20000] ^= 1
    with pytest.raises(ReplicaRefusedError, match="chunk 1"):
        _send(store, man, bytes(bad)).commit()
    assert store.replicas() == [] and not any(n.startswith(".partial") for n in os.listdir(store.root + "/rank_00001"))
    rep = _send(store, man, data).commit()
    assert (rep.rank, rep.step) == (1, 10) and open(rep.data, "rb").read(len(data)) == data
    rep2 = _send(store, *_copy(1, 15)).commit()
    assert [(r.rank, r.step) for r in store.replicas()] == [(1, 15)] and not os.path.exists(rep.data)
    assert store.newest(1).step == 15 and store.newest(1, min_step=16) is None and store.bytes_held() == rep2.nbytes


def test_steps_past_ten_to_the_twelfth_are_held_and_twelve_digit_names_still_listed(root) -> None:
    # A job counting steps in tokens passes 10**12: the disk tier and the coordinator take such steps, but every
    # replica was refused (``step 1000000000000 ... to 999999999999``), so a node fault restored from disk.
    store = ReplicaStore(root, "job", 1 << 20)
    _send(store, *_copy(0, 120)).commit()  # named with 12 digits, as before
    _send(store, *_copy(1, 999_999_999_999)).commit()
    for step in (10**12, 10**13 + 7, 2**53 - 1):
        rep = _send(store, *_copy(1, step)).commit()
        assert os.path.basename(rep.manifest_path) == f"step_{step}.manifest.json"
        assert [(r.rank, r.step) for r in store.replicas()] == [(0, 120), (1, step)]
    again = ReplicaStore(root, "job", 1 << 20)  # an agent restarted on the same tmpfs lists both kinds of name
    assert [(r.rank, r.step) for r in again.replicas()] == [(0, 120), (1, 2**53 - 1)]
    assert again.newest(1, min_step=10**12).step == 2**53 - 1 and again.bytes_held() == 2 * rep.nbytes
    with pytest.raises(ReplicaRefusedError, match="step 9007199254740992"):
        again.begin(_copy(1, 2**53)[0])


def test_another_runs_copies_are_not_listed_nor_removed_by_this_run_and_are_evicted_first(root) -> None:
    # A run of the same job name on another checkpoint location left its replicas (its arena outlives it for the
    # daemon's TTL): they were reported and served as this run's (a restore plan could pick the other run's
    # step 500), and this run's first push of a rank removed the other run's copy as "a run it went back from".
    man, data = _copy(1, 500, location="/old")
    old = ReplicaStore(root, "job", 3 * man.data_bytes, location="/old")
    _send(old, man, data).commit()
    new = ReplicaStore(root, "job", 3 * man.data_bytes, location="/new")
    assert new.replicas() == [] and new.newest(1) is None and new.copy_of(1, 500) is None
    _send(new, *_copy(1, 20, location="/new")).commit()
    assert [(r.rank, r.step) for r in old.replicas()] == [(1, 500)]  # not this run's to remove
    assert [(r.rank, r.step) for r in new.replicas()] == [(1, 20)] and new.bytes_held() == 2 * man.data_bytes
    _send(new, *_copy(2, 20, location="/new")).commit()
    _send(new, *_copy(3, 21, location="/new")).commit()  # no room for a fourth: the other run's copy goes first
    assert old.replicas() == [] and [(r.rank, r.step) for r in new.replicas()] == [(1, 20), (2, 20), (3, 21)]


def test_a_killed_receivers_leftovers_are_never_listed_and_are_cleaned(root) -> None:
    store = ReplicaStore(root, "job", 1 << 20)
    man, data = _copy(2, 7)
    w = _send(store, man, data, upto=len(data) // 2)  # the receiver "dies": nothing commits, nothing aborts
    os.close(w.fd)
    assert store.replicas() == []
    again = ReplicaStore(root, "job", 1 << 20)  # the agent comes back on the same tmpfs
    assert not any(n.startswith(".partial") for n in os.listdir(again.root + "/rank_00002"))


def test_memory_bound_evicts_older_replicas_first_and_refuses_what_cannot_fit(root) -> None:
    man_a, data_a = _copy(0, 5)
    store = ReplicaStore(root, "job", 2 * man_a.data_bytes)
    own_dir = os.path.join(root, "job", "rank_00003")  # this node's own snapshot: never the store's to evict
    os.makedirs(own_dir)
    with open(os.path.join(own_dir, "slot_0.data"), "wb") as f:
        f.write(b"own")
    _send(store, man_a, data_a).commit()
    _send(store, *_copy(1, 6)).commit()
    _send(store, *_copy(2, 7)).commit()  # over the bound: the oldest replica (rank 0) goes
    assert [(r.rank, r.step) for r in store.replicas()] == [(1, 6), (2, 7)] and store.evicted == 1
    assert open(os.path.join(own_dir, "slot_0.data"), "rb").read() == b"own"
    with pytest.raises(ReplicaRefusedError, match="over the replica memory bound"):
        store.begin(_copy(3, 8, kib=256)[0])
    tight = ReplicaStore(root, "job2", 1 << 40, reserve_bytes=1 << 50)  # the tmpfs cannot keep the reserve
    with pytest.raises(ReplicaRefusedError, match="reserved for own snapshots"):
        tight.begin(man_a)


def test_arena_writer_installs_a_memory_tier_copy(root) -> None:
    man, data = _copy(1, 12)
    paths = _send(arena_writer(root, "job", man), man, data).commit()
    found = memory_manifests(root, "job", "/ckpt")
    assert found[12][1][0] == paths and found[12][1][1].created == man.created
    assert open(paths.data, "rb").read() == data
    bad = bytearray(data)
    bad[0] ^= 1
    with pytest.raises(ReplicaRefusedError):
        _send(arena_writer(root, "job", _copy(1, 13)[0]), _copy(1, 13)[0], bytes(bad)).commit()
    assert sorted(memory_manifests(root, "job", "/ckpt")) == [12]  # the failed fetch left the old copy alone


def test_two_agents_on_one_host_publishing_the_same_replica_never_fail(root) -> None:
    """Two agents of one job on one host share the replica folder (found by a user's review: a shared temporary
    manifest name made one's rename fail with FileNotFoundError, a traceback in the gRPC server). Two stores
    stand for the two processes (each has its own lock, as two processes would)."""
    import threading

    stores = [ReplicaStore(root, "job", 1 << 30), ReplicaStore(root, "job", 1 << 30)]
    man, data = _copy(1, 20, kib=16)
    errors: list[BaseException] = []

    def publish(store: ReplicaStore) -> None:
        for _ in range(150):
            try:
                _send(store, man, data).commit()
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=publish, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    rep = stores[0].newest(1)
    assert rep is not None and rep.step == 20 and open(rep.data, "rb").read(len(data)) == data



def test_two_steps_of_a_rank_committed_out_of_order_leave_one_copy(root) -> None:
    """Two steps of one rank pushed at once (a sender and the node replacing it, or a restarted agent), the
    newer one committed first. The older one, committed after it, was published beside it and held its memory,
    outside "one copy per rank", until the rank's next push; now the copy published last is the rank's one."""
    store = ReplicaStore(root, "job", 1 << 20)
    old_man, old_data = _copy(2, 10)
    slow = _send(store, old_man, old_data)  # arrived in full, not yet committed
    new_man, new_data = _copy(2, 12, fill=7)
    _send(store, new_man, new_data).commit()
    slow.commit()
    assert [(r.rank, r.step) for r in store.replicas()] == [(2, 10)]
    assert store.bytes_held() == old_man.data_bytes and store.bytes_reserved() == 0
    assert sorted(os.listdir(store.root + "/rank_00002")) == ["step_000000000010.data",
                                                             "step_000000000010.manifest.json"]
    assert open(store.newest(2).data, "rb").read() == old_data


@pytest.mark.parametrize("left", [0, 1000, None])
def test_a_replica_whose_data_file_was_truncated_is_neither_listed_nor_kept(root, left) -> None:
    """Found reviewing the memory tier as a user: a replica truncated in the buddy's tmpfs (or its data file
    gone) stayed listed, so it was reported as held and planned for a replacement's restore, and every fetch of it
    failed on the serving side (mmap past the end of the file) until the next push replaced it."""
    store = ReplicaStore(root, "job", 1 << 20)
    good = _send(store, *_copy(2, 7)).commit()
    rep = _send(store, *_copy(1, 10)).commit()
    if left is None:
        os.unlink(rep.data)
    else:
        os.truncate(rep.data, left)
    assert [(r.rank, r.step) for r in store.replicas()] == [(2, 7)]
    assert store.newest(1) is None and store.copy_of(1, 10) is None and store.bytes_held() == good.nbytes
    assert not os.path.exists(rep.manifest_path) and not os.path.exists(rep.data)  # its memory is given back
    assert _send(store, *_copy(1, 10)).commit().step == 10  # the next push lands as usual
    assert [(r.rank, r.step) for r in store.replicas()] == [(2, 7), (1, 10)]


def test_a_replica_whose_manifest_is_damaged_gives_its_memory_back(root) -> None:
    """Unlisted, its data file kept its /dev/shm memory (outside the bound) until the job ended."""
    store = ReplicaStore(root, "job", 1 << 20)
    rep = _send(store, *_copy(2, 30)).commit()
    with open(rep.manifest_path, "wb") as f:
        f.write(b'{"job": "job", "step": ')  # damaged: not JSON
    assert store.replicas() == []
    assert not os.path.exists(rep.data) and not os.path.exists(rep.manifest_path)
    assert _send(store, *_copy(2, 31)).commit().step == 31  # the folder is usable as before


def test_a_damaged_manifest_is_not_removed_while_a_publisher_holds_the_folder(root) -> None:
    """A publisher replaces a copy in steps under its rank folder's lock, from another agent process too: the
    damaged copy's files are removed only once the lock is free (never between the publisher's steps)."""
    import subprocess
    import sys

    store = ReplicaStore(root, "job", 1 << 20)
    rep = _send(store, *_copy(3, 40)).commit()
    with open(rep.manifest_path, "wb") as f:
        f.write(b"\x00garbage")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", os.path.dirname(rep.data)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store.replicas() == []
        assert os.path.exists(rep.data)  # left to the next listing: a publisher may be mid-way
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert store.replicas() == [] and not os.path.exists(rep.data) and not os.path.exists(rep.manifest_path)


def test_a_publisher_killed_between_data_and_manifest_leaves_nothing_held(root) -> None:
    """The data is renamed into place before the manifest is written: a publisher killed between the two left a
    data file nothing lists, holding its memory until the job ended; the next store on the root removes it."""
    store = ReplicaStore(root, "job", 1 << 20)
    rep = _send(store, *_copy(4, 50)).commit()
    os.unlink(rep.manifest_path)  # as if killed before the manifest's rename
    leftover = rep.manifest_path + ".tmp-123-abcdef01"
    with open(leftover, "wb") as f:
        f.write(b"{")
    kept = _send(store, *_copy(5, 50)).commit()
    ReplicaStore(root, "job", 1 << 20)  # the agent restarted
    assert not os.path.exists(rep.data) and not os.path.exists(leftover)
    assert os.path.exists(kept.data) and [(r.rank, r.step) for r in store.replicas()] == [(5, 50)]


def test_a_short_replica_is_removed_only_once_no_publisher_holds_its_folder(root) -> None:
    """A listing that found a copy's data shorter than its (cached) manifest removed both at once: a copy of
    the same step republished meanwhile by another agent of the job on this host went with it."""
    import subprocess
    import sys

    store = ReplicaStore(root, "job", 1 << 20)
    rep = _send(store, *_copy(6, 60)).commit()
    os.truncate(rep.data, 4096)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", os.path.dirname(rep.data)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store.replicas() == []  # not listed: it cannot be served
        assert os.path.exists(rep.manifest_path)  # nor removed while a publisher may be mid-way
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert store.replicas() == [] and not os.path.exists(rep.data) and not os.path.exists(rep.manifest_path)
    small, data = _copy(6, 60, kib=16)  # the next push of that step lands as usual
    _send(store, small, data).commit()
    assert [(r.rank, r.step, r.nbytes) for r in store.replicas()] == [(6, 60, small.data_bytes)]


def _start_agent(root: str, job: str, i: int, barrier, out) -> None:
    from trainguard.agent.memory_tier import MemoryTier
    from trainguard.agent.replica_agent import ReplicaAgent, ReplicaConfig

    tier = MemoryTier(root, job, "/ckpt")
    barrier.wait()
    try:
        ReplicaAgent(ReplicaConfig(), tier, f"n{i}", "127.0.0.1")
        out.put("")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(f"{type(exc).__name__}: {exc}")


def test_two_agents_of_a_job_starting_together_on_one_host_both_start(root) -> None:
    # Black-box review: each agent's store makes <root>/<job>/replicas and removes it at once while empty; the
    # other's makedirs lost the job folder between its two mkdirs and the launcher died with FileNotFoundError
    # (34 of 300 agents here before; two `trainguard run` of one job on a host).
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    failures = []
    for t in range(40):
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_start_agent, args=(root, f"race{t}", i, barrier, out)) for i in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        failures += [r for r in (out.get(timeout=10) for _ in procs) if r]
    assert not failures, failures[:3]
