"""Failure modes: byte flips, full disk, unreachable remote, SIGKILL during persist, restore after a crash."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from ckpt_worker import state_for
from tg_testutil import fill_fs

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.reader import RankCopy
from trainguard.checkpoint.service import CheckpointService
from trainguard.checkpoint.storage import LocalStore, data_name, manifest_name, marker_name, step_dirname
from trainguard.checkpoint.writer import write_rank_step

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ckpt_worker.py"


class Events(list):
    def __call__(self, ev):
        self.append(ev)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _save_two(ck: Checkpointer) -> None:
    for s in (1, 2):
        ck.save({"w": torch.full((1000,), float(s)), "n": s}, s)
        assert ck.wait(s, timeout=30)


def _service_disk_config(tmp_path, shm_dir: str, svc: CheckpointService, keep: int, **persist) -> CheckpointConfig:
    """Disk tier under ``tmp_path/ck`` persisted by ``svc``, no memory tier, 1 MiB chunks."""
    return CheckpointConfig(directory=str(tmp_path / "ck"), disk={"keep": keep},
                            memory={"directory": shm_dir, "enabled": False},
                            persist={"service": svc.address, "chunk_mib": 1, **persist})


@pytest.mark.parametrize("target", ["data", "manifest"])
def test_byte_flip_on_disk_falls_back_to_previous_step(make_config, caplog, target):
    cfg = make_config(memory={"enabled": False})
    with Checkpointer(cfg, job="flip") as ck:
        _save_two(ck)
        d = os.path.join(ck.disk.job_dir, step_dirname(2))
        if target == "data":
            _flip(os.path.join(d, data_name(0)), 123)
        else:
            raw = open(os.path.join(d, manifest_name(0)), "rb").read()
            _flip(os.path.join(d, manifest_name(0)), raw.index(b'"step"') + 8)
        w = torch.zeros(1000)
        state = {"w": w, "n": 0}
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
            assert ck.restore(state) == 1
        assert torch.equal(w, torch.full((1000,), 1.0)) and state["n"] == 1
        assert "disk copy of step 2" in caplog.text and ("checksum" in caplog.text or "not a valid" in caplog.text)


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_a_newest_step_without_its_commit_marker_is_named_when_skipped(make_config, caplog, capsys, tmp_path,
                                                                         damage):
    # The record said step 2 was committed; its marker deleted (or overwritten with garbage), the restore went to
    # step 1 with only an INFO line, where every other kind of damage is said (black-box review).
    cfg = make_config(memory={"enabled": False})
    with Checkpointer(cfg, job="marker") as ck:
        _save_two(ck)
        marker = os.path.join(ck.disk.job_dir, step_dirname(2), marker_name(0))
        if damage == "deleted":
            os.remove(marker)
        else:
            with open(marker, "wb") as f:
                f.write(os.urandom(40))
        state = {"w": torch.zeros(1000), "n": 0}
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
            assert ck.restore(state) == 1
        assert state["n"] == 1
        assert ("not restoring step 2 from the disk tier: the job's commit record names it as committed, but the "
                "commit marker of rank(s) 0 is missing or damaged") in caplog.text, caplog.text
        from trainguard.cli import main

        capsys.readouterr()
        assert main(["ckpt", "verify", str(tmp_path / "ckpt"), "--job", "marker"]) == 1  # it said nothing, exit 0
        out = capsys.readouterr().out
        assert "step 1 rank 0: OK" in out and "step 2: NOT COMMITTED (" in out, out
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
            ck.save({"w": torch.full((1000,), 3.0), "n": 3}, 3)
            assert ck.wait(3, timeout=30)
            assert ck.restore(state) == 3  # once a newer step is committed, nothing is said
        assert "commit record" not in caplog.text, caplog.text


def test_byte_flip_in_memory_tier_served_by_disk(make_config, caplog):
    with Checkpointer(make_config(), job="flipm") as ck:
        _save_two(ck)
        _flip(os.path.join(ck.arena.dir, f"slot_{ck._status[2].slot}.data"), 5)
        w = torch.zeros(1000)
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
            assert ck.restore({"w": w, "n": 0}) == 2
        assert ck.last_restore_tier == "disk" and torch.equal(w, torch.full((1000,), 2.0))
        assert "memory copy of step 2" in caplog.text


def test_full_disk_reports_event_keeps_old_and_retries(tmp_path, shm_dir):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        events = Events()
        cfg = CheckpointConfig(directory=str(mnt / "ck"), memory={"enabled": False, "directory": shm_dir})
        with Checkpointer(cfg, job="full", on_event=events) as ck:
            ck.save({"w": torch.full((200_000,), 1.0)}, 1)  # 800 kB
            assert ck.wait(1, timeout=30)
            filler = mnt / "filler"
            with open(filler, "wb", buffering=0) as f:  # fill the filesystem to the last byte
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass
            h = ck.save({"w": torch.full((200_000,), 2.0)}, 2)  # training goes on: no exception
            assert h.wait(timeout=30) is False
            assert [e.kind for e in events] == ["checkpoint.disk_full"]
            assert events[0].evidence["tier"] == "disk" and events[0].evidence["step"] == "2"
            assert [s for s, _ in ck.disk.committed_steps()] == [1]
            w = torch.zeros(200_000)
            assert ck.restore({"w": w}) == 1 and torch.equal(w, torch.full((200_000,), 1.0))
            step2 = mnt / "ck" / "full" / step_dirname(2)  # even its mkdir may have hit ENOSPC
            assert not step2.exists() or not [n for n in os.listdir(step2) if ".tmp" in n]
            filler.unlink()
            h = ck.save({"w": torch.full((200_000,), 3.0)}, 3)  # the next save retries and succeeds
            assert h.wait(timeout=30)
            assert [s for s, _ in ck.disk.committed_steps()][-1] == 3
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


# Two steps fit, three do not: 1.2 MB steps on 3 MiB, and 100 kB steps on 270 KiB (small steps: a fixed 256 KiB
# allowance for the manifest and markers was more than removing a step freed, so such a job never found room).
@pytest.mark.parametrize("n, size", [(300_000, "3m"), (25_000, "270k")])
def test_retention_that_does_not_fit_the_disk_makes_room_instead_of_failing_every_save(tmp_path, shm_dir, n, size):
    """keep=2 on a disk holding two steps but not three: the third save hit ENOSPC, and as retention removes the
    oldest step only after the new one commits, every later save failed too. The writer now removes the oldest
    complete step (never the newest, nor one a restore reads) and writes once more."""
    mnt = tmp_path / f"keep-{os.getpid()}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        events = Events()
        cfg = CheckpointConfig(directory=str(mnt / "ck"), memory={"directory": shm_dir}, disk={"keep": 2})
        with Checkpointer(cfg, job="room", on_event=events) as ck:
            for s in range(1, 6):
                assert ck.save({"w": torch.full((n,), float(s))}, s).wait(timeout=30), events
            assert [s for s, _ in ck.disk.committed_steps()] == [4, 5]
            # every save fitted, but steps 3-5 only by removing an older step: the job hears the disk is full
            # (a warning), as it does when a save fails (an error), not only at that failure
            assert [(e.kind, e.severity.name, e.evidence["step"], e.evidence["evicted"]) for e in events] == [
                ("checkpoint.disk_full", "WARNING", str(s), str(s - 2)) for s in (3, 4, 5)]
            assert "free space or lower checkpoint.disk.keep" in events[0].message
            events.clear()
            # A restore reading step 4 (the older one) keeps it: no room, the clear error stays, step 5 intact.
            man = Manifest.from_json(ck.disk.read_small(4, manifest_name(0)))
            reading = ck._open_data("disk", 4, 0, man, "disk copy of step 4", populate=False)
            try:
                assert ck.save({"w": torch.full((n,), 6.0)}, 6).wait(timeout=30) is False
            finally:
                reading.close()
            assert [e.kind for e in events] == ["checkpoint.disk_full"]
            assert "lower the retention" in events[0].message
            assert [s for s, _ in ck.disk.committed_steps()] == [4, 5]
            assert ck.save({"w": torch.full((n,), 7.0)}, 7).wait(timeout=30)
            assert [s for s, _ in ck.disk.committed_steps()] == [5, 7]
            assert [(e.kind, e.severity.name) for e in events[1:]] == [("checkpoint.disk_full", "WARNING")]
        disk_only = CheckpointConfig(directory=str(mnt / "ck"), memory={"enabled": False, "directory": shm_dir})
        with Checkpointer(disk_only, job="room") as ck:
            w = torch.zeros(n)
            assert ck.restore({"w": w}) == 7 and ck.last_restore_tier == "disk"
            assert torch.equal(w, torch.full((n,), 7.0))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_making_room_spares_the_newest_complete_step_newer_steps_and_live_writers(tmp_path):
    """Unit rules of LocalStore.make_room: oldest first and only what it takes; never the newest complete step,
    a step newer than it (another rank may be finishing it), a protected step, or a step whose temporary file a
    live writer holds; nothing at all when every candidate together would not free enough."""
    mnt = tmp_path / f"room-{os.getpid()}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    unit = 512 << 10  # one step's data
    try:
        store = LocalStore(str(mnt), "rules", fsync=False)

        def put(step: int, ws: int = 1) -> None:
            write_rank_step(store, step, 0, ws, {"w": {"t": "tensor", "i": 0}}, [("w", torch.ones(unit // 4))])

        def free() -> int:
            st = os.statvfs(store.job_dir)
            return st.f_bavail * st.f_frsize

        put(1)
        put(2, ws=2)  # torn: rank 1 never committed, older than the newest complete step
        put(3)
        put(4)
        put(5, ws=2)  # torn and newer than the newest complete step: another rank may be finishing it
        assert store.make_room(free() + 4 * unit) == []  # 1, 2 and 3 together free 3 units: remove nothing
        assert store.list_steps() == [1, 2, 3, 4, 5]
        assert store.make_room(free() + unit // 2, protect={1}) == [2]
        writer = store.begin_data(3, 1)  # a live writer's temporary file in step 3
        try:
            assert store.make_room(free() + 2 * unit) == []  # only step 1 may go: not enough
            assert store.make_room(free() + unit // 2) == [1]
        finally:
            writer.abort()
        assert store.make_room(free() + 2 * unit) == []
        assert store.make_room(free() + unit // 2) == [3]
        assert store.list_steps() == [4, 5] and [s for s, _ in store.committed_steps()] == [4]
        assert store.make_room(free() + unit // 2) == []  # one complete step left: never removed
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_unreachable_remote_reports_and_disk_still_commits(make_config):
    events = Events()
    cfg = make_config(remote={"url": "ftp://127.0.0.1:1/ckpt"})  # nothing listens on port 1
    with Checkpointer(cfg, job="unreach", on_event=events) as ck:
        assert [e.kind for e in events] == ["checkpoint.remote_unreachable"]  # found at construction, not raised
        h = ck.save({"w": torch.ones(10)}, 1)
        assert h.wait(timeout=60) is False
        assert set(h.tiers_done) == {"memory", "disk"}
        assert [s.step for s in ck.steps()] == [1]
        ck.save({"w": torch.ones(10)}, 2)
        assert ck.wait(2, timeout=60) is False
        # One event for the outage: the saves within remote.retry_s (30 s) do not dial it, and say nothing more
        # (each save's upload used to dial, and each sent its own event); the newest step is uploaded once the
        # remote answers (test_ckpt_remote_backoff.py).
        assert [e.kind for e in events] == ["checkpoint.remote_unreachable"]
        assert "saves do not upload meanwhile" in events[0].message


def test_remote_tier_roundtrip_via_fsspec(make_config):
    cfg2 = make_config(memory={"enabled": False})
    remote_dir = Path(cfg2.disk_directory).parent / "remote"
    cfg2 = make_config(memory={"enabled": False}, remote={"url": f"file://{remote_dir}", "keep": 2})
    with Checkpointer(cfg2, job="rem2") as ck:
        for s in (1, 2, 3):
            ck.save({"w": torch.full((100,), float(s))}, s)
            assert ck.wait(s, timeout=30)
        assert sorted(os.listdir(remote_dir / "rem2")) == ["COMMITTED.json", step_dirname(2), step_dirname(3)]
        # Lose the local copy: the remote tier serves the restore.
        import shutil

        shutil.rmtree(ck.disk.job_dir)
        w = torch.zeros(100)
        assert ck.restore({"w": w}) == 3 and ck.last_restore_tier == "remote"
        assert torch.equal(w, torch.full((100,), 3.0))


def _committed_all_verify(cfg: CheckpointConfig, job: str) -> None:
    from trainguard.checkpoint.storage import LocalStore

    store = LocalStore(cfg.disk_directory, job)
    for step, _ in store.committed_steps():
        man = Manifest.from_json(store.read_small(step, manifest_name(0)))
        with RankCopy(man, store.local_data_path(step, 0), f"step {step}") as copy:
            copy.verify()


def test_sigkill_loop_during_persist_never_leaves_torn_state(tmp_path, shm_dir):
    """50 SIGKILLs of the persist process at random moments; every committed step stays valid and bit-exact."""
    rng = random.Random(1234)
    job = "kill"
    restored_before = 0
    confirmed = 0  # newest step whose wait() returned True: restore may never go below it
    persist_s = 0.05  # running estimate of one persist's duration, so kills land inside persists on any load
    kills = mid_persist = 0
    for i in range(1, 51):
        svc = CheckpointService(job=job, shm_dir=shm_dir, nice=0).start()
        try:
            cfg = _service_disk_config(tmp_path, shm_dir, svc, keep=2)
            ck = Checkpointer(cfg, job=job)
            t0 = time.monotonic()
            h = ck.save(state_for(0, i), i)
            if i % 10 == 1:  # every tenth save completes, then the service is killed idle
                assert h.wait(timeout=60)
                confirmed = i
                persist_s = time.monotonic() - t0
            else:
                time.sleep(rng.uniform(0.0, 1.5 * persist_s))
            os.kill(svc.pid, signal.SIGKILL)
            svc.proc.wait()
            kills += 1
            mid_persist += not ck._status[i].released
            ck.close()
        finally:
            svc.stop(remove_memory=False, timeout=5)
        _committed_all_verify(cfg, job)
        cfg_r = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"directory": shm_dir, "enabled": False},
                                 persist={"service": "inline"})
        with Checkpointer(cfg_r, job=job) as reader:
            w, b = torch.zeros(64, 1024), torch.zeros(4097)
            state = {"w": w, "b": b, "meta": None}
            got = reader.restore(state)
        assert got is not None and max(restored_before, confirmed) <= got <= i
        exp = state_for(0, got)
        assert torch.equal(w, exp["w"]) and torch.equal(b, exp["b"]) and state["meta"] == exp["meta"]
        restored_before = got
    assert kills == 50
    assert mid_persist >= 10, mid_persist  # most kills really hit a persist in flight


def _spawn_worker(cfg: dict, job: str, rank: int, world: int, steps: int, env: dict) -> subprocess.Popen:
    import json

    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg), job, str(rank), str(world), str(steps),
                             "--hang"], stdout=subprocess.PIPE, text=True, env=env)


def _wait_done(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if line.startswith("saved"):
            assert line.split()[2] == "True", line
        if line.strip() == "done":
            return
    raise AssertionError(f"worker exited early with {proc.wait()}")


@pytest.mark.parametrize("mode", ["agent", "private"])
def test_restore_after_worker_sigkill_served_from_shared_memory(tmp_path, shm_dir, mode):
    job = f"crash-{mode}"
    cfg = {"directory": str(tmp_path / "ck"), "memory": {"directory": shm_dir, "keep": 1}}
    env = dict(os.environ)
    svc = None
    if mode == "agent":
        svc = CheckpointService(job=job, shm_dir=shm_dir).start()
        env["TRAINGUARD_CHECKPOINT_SERVICE"] = svc.address
    else:
        env.pop("TRAINGUARD_CHECKPOINT_SERVICE", None)
    world = 2 if mode == "agent" else 1  # the private mode needs one worker to make its point; torch imports cost
    procs = [_spawn_worker(cfg, job, r, world, 3, env) for r in range(world)]
    try:
        for p in procs:
            _wait_done(p)
        children = [c.pid for p in procs for c in psutil.Process(p.pid).children()]
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
        if mode == "private":  # the orphaned private persist processes exit on their own
            gone, alive = psutil.wait_procs([psutil.Process(c) for c in children if psutil.pid_exists(c)], 15)
            assert not alive
        # A restarted worker (here: this process, the last rank) restores from the surviving shared memory.
        restart_cfg = CheckpointConfig.from_dict(cfg)
        if svc is not None:
            restart_cfg.persist.service = svc.address
        with Checkpointer(restart_cfg, rank=world - 1, world_size=world, job=job) as ck:
            state = {"w": torch.zeros(64, 1024), "b": torch.zeros(4097), "meta": None}
            assert ck.restore(state) == 3
            assert ck.last_restore_tier == "memory"
            exp = state_for(world - 1, 3)
            assert torch.equal(state["w"], exp["w"]) and state["meta"] == exp["meta"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if svc is not None:
            svc.stop(remove_memory=True)
            assert not os.path.exists(os.path.join(shm_dir, job))


def test_a_killed_checkpoint_service_is_started_again_and_saves_reach_disk(tmp_path, shm_dir):
    """The agent's checkpoint service killed alone (an OOM kill): it was never started again, every later persist
    of the node failed ("cannot connect to the checkpoint service ... Connection refused") and the job still
    reported success with no step of that rank on disk (found by a user's review, 2-node job)."""
    job = "svc-restart"
    restarted: list[tuple[int, int]] = []
    svc = CheckpointService(job=job, shm_dir=shm_dir, nice=0,
                            on_restart=lambda old, new: restarted.append((old, new))).start()
    try:
        cfg = _service_disk_config(tmp_path, shm_dir, svc, keep=3)
        with Checkpointer(cfg, job=job) as ck:
            assert ck.save(state_for(0, 1), 1).wait(timeout=60)
            first = svc.pid
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not restarted and time.monotonic() < deadline:
                time.sleep(0.05)
            assert restarted and restarted[0][0] == first and svc.pid == restarted[0][1] != first
            saved = False
            for step in (2, 3):  # the first save after the death may find the old connection gone
                saved = ck.save(state_for(0, step), step).wait(timeout=60)
            assert saved and svc.restarts == 1
        _committed_all_verify(cfg, job)
        assert (tmp_path / "ck" / job / step_dirname(3)).is_dir()
    finally:
        svc.stop(remove_memory=True, timeout=10)
    assert not psutil.pid_exists(restarted[0][1]) or psutil.Process(restarted[0][1]).status() == psutil.STATUS_ZOMBIE


_LIVE_WRITER = """
import sys, time
from trainguard.checkpoint.storage import LocalStore
pending = LocalStore(sys.argv[1], sys.argv[2]).begin_data(1, 0)  # rank 0 of step 1, being written
print(pending.tmp, flush=True)
time.sleep(120)
"""


def test_a_persist_process_killed_mid_write_leaves_no_temp_file_but_a_live_writers_stays(tmp_path, shm_dir):
    """kill -9 of the persist process while it wrote a rank's data left ``rank_00000.data.tmp.<pid>`` (as large
    as the rank's data) in the step folder until retention removed the folder; the next persist removes it, and
    never the temporary file of a writer still at work (another process writing the same file, e.g. the persist
    process of an earlier incarnation of the rank)."""
    job = "tmpkill"
    live = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(tmp_path / "ck"), job], stdout=subprocess.PIPE,
                            text=True)
    svc = CheckpointService(job=job, shm_dir=shm_dir, nice=0).start()
    try:
        live_tmp = Path(live.stdout.readline().strip())
        assert live_tmp.name == f"{data_name(0)}.tmp.{live.pid}", live_tmp
        # Throttled: the write is done at once, then the throttle holds the file uncommitted for seconds.
        cfg = _service_disk_config(tmp_path, shm_dir, svc, keep=3, bandwidth_mib_s=0.01)
        ck = Checkpointer(cfg, job=job)
        ck.save(state_for(0, 1), 1)
        stale = tmp_path / "ck" / job / step_dirname(1) / f"{data_name(0)}.tmp.{svc.pid}"
        deadline = time.monotonic() + 30
        while not stale.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stale.exists(), sorted(os.listdir(stale.parent))
        os.kill(svc.pid, signal.SIGKILL)
        svc.proc.wait()
        ck.close()
    finally:
        svc.stop(remove_memory=False, timeout=5)
    assert stale.exists()  # what the killed writer left
    svc = CheckpointService(job=job, shm_dir=shm_dir, nice=0).start()
    try:
        cfg = _service_disk_config(tmp_path, shm_dir, svc, keep=3)
        with Checkpointer(cfg, job=job) as ck:
            assert ck.save(state_for(0, 2), 2).wait(timeout=60)
        assert not stale.exists(), sorted(os.listdir(stale.parent))
        assert live_tmp.exists()  # its writer lives
    finally:
        svc.stop(remove_memory=True, timeout=10)
        live.kill()
        live.wait()


def test_a_marker_that_does_not_fit_makes_room_too(tmp_path, shm_dir):
    """The data file fits, its commit marker does not. Room was made only for the data write, so the step stayed
    torn: newer than the newest complete step, which making room never removes. On a disk of ~2.5 steps a 2-rank
    torchrun job tore a step this way at step 13 and failed every later step (15-99 of 100)."""
    mnt = tmp_path / f"marker-{os.getpid()}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        cfg = CheckpointConfig(directory=str(mnt / "ck"), memory={"directory": shm_dir},
                               persist={"service": "inline"})
        with Checkpointer(cfg, job="m") as ck:
            for s in (1, 2):
                assert ck.save({"w": torch.full((40_000,), float(s))}, s).wait(timeout=30)
            step2 = mnt / "ck" / "m" / step_dirname(2)
            pages = (os.path.getsize(step2 / data_name(0)) // 4096
                     + -(-os.path.getsize(step2 / manifest_name(0)) // 4096))
            fill_fs(mnt, leave_pages=pages)  # room for data and manifest only
            assert ck.save({"w": torch.full((40_000,), 3.0)}, 3).wait(timeout=30)
            assert [s for s, _ in ck.disk.committed_steps()] == [2, 3]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_room_freed_by_another_rank_meanwhile_retries_the_write(tmp_path):
    """Two ranks' persists hit ENOSPC together; one's retention or make_room removed the older step first, so the
    other found a single complete step, removed nothing and failed its write although there was room now (the
    2-rank job above then tore that step and stalled again)."""
    from trainguard.checkpoint.persist import _make_room

    store = LocalStore(str(tmp_path / "ck"), "j")
    write_rank_step(store, 1, 0, 1, {"w": {"t": "tensor", "i": 0}}, [("w", torch.zeros(10))])
    assert [s for s, _ in store.committed_steps()] == [1]
    assert _make_room(store, 2, 0, 4096, 2, set(), [])  # nothing to remove, but the disk has room: write again


def test_a_rank_outside_a_process_group_does_not_fall_back_alone(make_config):
    """``restore`` called before ``init_process_group`` (under torchrun: RANK and WORLD_SIZE set, no group):
    rank 1's copy of the newest step is torn. It fell back to step 1 alone while rank 0 resumed step 2, a silent
    divergence; now rank 1 raises, naming init_process_group, and rank 0 still loads step 2."""
    from trainguard.checkpoint.errors import CorruptCheckpointError

    cfg = make_config(memory={"enabled": False})
    ranks = [Checkpointer(cfg, rank=r, world_size=2, job="nogroup") for r in (0, 1)]
    try:
        for s in (1, 2):
            for ck in ranks:
                ck.save({"w": torch.full((1000,), float(s))}, s)
            assert all(ck.wait(s, timeout=30) for ck in ranks)
        _flip(os.path.join(ranks[1].disk.job_dir, step_dirname(2), data_name(1)), 123)
        w = torch.zeros(1000)
        assert ranks[0].restore({"w": w}) == 2 and torch.equal(w, torch.full((1000,), 2.0))
        with pytest.raises(CorruptCheckpointError, match="rank 1 of 2 cannot load step 2.*init_process_group"):
            ranks[1].restore({"w": torch.zeros(1000)})
        # with the step named, or in a lone process, falling back stays each caller's own business
        w = torch.zeros(1000)
        assert ranks[1].restore({"w": w}, step=1) == 1 and torch.equal(w, torch.full((1000,), 1.0))
    finally:
        for ck in ranks:
            ck.close()


@pytest.mark.parametrize("leave_pages", [0, 196, 197])
def test_failed_disk_save_leaves_no_step_folder(tmp_path, shm_dir, leave_pages):
    """A full disk failing a save at any point (the data file: 0 pages free; the manifest: room for the data
    only; the commit marker: room for data and manifest) left ``step_2/`` behind, empty or holding the data file
    (800 kB of litter on a full disk): ``ckpt ls`` listed it as an incomplete step and ``gc`` kept it, being newer
    than the newest commit. Now the failed rank's files and the folder are removed; the error still says why."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        events = Events()
        cfg = CheckpointConfig(directory=str(mnt / "ck"), memory={"enabled": False, "directory": shm_dir})
        with Checkpointer(cfg, job="full", on_event=events) as ck:
            assert ck.save({"w": torch.full((200_000,), 1.0)}, 1).wait(timeout=30)  # 800 kB: 196 pages
            filler = fill_fs(mnt, leave_pages)
            assert ck.save({"w": torch.full((200_000,), 2.0)}, 2).wait(timeout=30) is False
            assert [e.kind for e in events] == ["checkpoint.disk_full"]
            assert "No space left on device" in events[0].message and "free space" in events[0].message
            job_dir = mnt / "ck" / "full"
            assert sorted(os.listdir(job_dir)) == ["COMMITTED.json", step_dirname(1)]
            assert LocalStore(str(mnt / "ck"), "full").list_steps() == [1]
            filler.unlink()
            assert ck.save({"w": torch.full((200_000,), 3.0)}, 3).wait(timeout=30)
            assert sorted(os.listdir(job_dir / step_dirname(3))) == sorted([data_name(0), "rank_00000.commit",
                                                                             manifest_name(0)])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_write_rank_step_on_a_full_disk_leaves_no_step_folder(tmp_path):
    """``write_rank_step`` (``ckpt import``, tools) failing on a full disk left an empty ``step_5/`` behind."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        store = LocalStore(str(mnt / "ck"), "imp")
        os.makedirs(store.job_dir)
        fill_fs(mnt, 0)
        with pytest.raises(OSError, match="No space left"):
            write_rank_step(store, 5, 0, 1, {"w": {"t": "tensor", "i": 0}}, [("w", torch.ones(1000))])
        assert os.listdir(store.job_dir) == [] and store.list_steps() == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_unreachable_remote_is_backed_off_in_listings_and_said_once(make_config, caplog):
    """An FTP endpoint that accepts connections and never answers (a stalled object-store endpoint): every
    ``steps()``/``restore()`` used to connect again and pay the whole connect timeout, and logged a warning each
    time. Now a failure leaves the remote out of listings for ``remote.retry_s`` (doubling while it keeps failing,
    bounded), the listings in between return at once, and the log says it once."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    port = srv.getsockname()[1]
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(srv.accept()[0])  # held open, never answered: the FTP greeting never comes
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    url = f"ftp://127.0.0.1:{port}/ckpt"
    cfg = make_config(remote={"url": url, "storage_options": {"timeout": 0.3}, "retry_s": 1.0})
    try:
        with caplog.at_level(logging.DEBUG, logger="trainguard.checkpoint"):
            with Checkpointer(cfg, job="down") as ck:
                deadline = time.monotonic() + 10
                while not conns:  # the constructor's probe reached the endpoint
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                tried = len(conns)
                t0 = time.monotonic()
                for _ in range(10):
                    assert ck.steps() == []
                assert len(conns) == tried and time.monotonic() - t0 < 1.5  # no connect, no timeout (3 s before)
                while len(conns) == tried:  # retried once the back-off is over
                    assert time.monotonic() < deadline, "the remote was never tried again"
                    ck.steps()
                    time.sleep(0.02)
                tried = len(conns)
                t0 = time.monotonic()
                for _ in range(10):
                    ck.steps()
                assert len(conns) == tried and time.monotonic() - t0 < 1.5  # backing off again
                loud = [r.getMessage() for r in caplog.records
                        if r.levelno >= logging.WARNING and f"127.0.0.1:{port}" in r.getMessage()]
                assert len(loud) == 1 and "retried in 1 s" in loud[0], loud
                # A restore tries it regardless (it may hold the only copy of the newest step), and says so.
                assert ck.restore({"w": torch.zeros(1)}) is None and len(conns) == tried + 1
                assert "restore: the remote tier is unreachable" in caplog.text
    finally:
        srv.close()
        for c in conns:
            c.close()


def test_failed_disk_save_of_one_rank_keeps_the_other_ranks_copy(tmp_path, shm_dir):
    """The cleanup of a failed save removes only the failing rank's files: rank 1's committed copy of step 2 and
    the folder stay, and rank 0's later save of step 2 completes the step."""
    mnt = tmp_path / "full2"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    cfg = CheckpointConfig(directory=str(mnt / "ck"), memory={"enabled": False, "directory": shm_dir})
    r0 = Checkpointer(cfg, rank=0, world_size=2, job="mr")
    r1 = Checkpointer(cfg, rank=1, world_size=2, job="mr")
    try:
        assert r1.save({"w": torch.full((100_000,), 1.0)}, 2).wait(timeout=30)
        filler = fill_fs(mnt, 0)
        assert r0.save({"w": torch.full((100_000,), 0.0)}, 2).wait(timeout=30) is False
        step2 = mnt / "ck" / "mr" / step_dirname(2)
        assert sorted(os.listdir(step2)) == sorted([data_name(1), manifest_name(1), "rank_00001.commit"])
        filler.unlink()
        assert r0.save({"w": torch.full((100_000,), 0.0)}, 2).wait(timeout=30)
        assert [s.step for s in r0.steps()] == [2]
    finally:
        r0.close()
        r1.close()
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_first_save_of_a_process_started_on_a_full_disk_reports_instead_of_raising(tmp_path, shm_dir):
    """The disk tier's writer lease (``.trainguard-writers/<job>/rank_N/owner.lock``) wrote the pid into its lock
    file, and on a full disk that write raised ENOSPC out of ``save()`` into the training loop; the lock is what
    excludes, the pid only names the holder. Now the save reports the full disk as any other save does."""
    mnt = tmp_path / "full3"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        fill_fs(mnt, 0)
        events = Events()
        cfg = CheckpointConfig(directory=str(mnt / "ck"), memory={"enabled": False, "directory": shm_dir})
        with Checkpointer(cfg, job="late", on_event=events) as ck:
            assert ck.save({"w": torch.ones(1000)}, 1).wait(timeout=30) is False  # raised OSError before
            assert [e.kind for e in events][-1] == "checkpoint.disk_full"
            assert ck.disk.list_steps() == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("leave_pages", [0, 49, 50])
def test_failed_upload_to_a_full_remote_leaves_no_step_folder(tmp_path, shm_dir, leave_pages):
    """A ``file://`` remote (an NFS mount) filling up: fsspec writes files in place, so a failed upload kept
    ``step_2/`` there with a truncated data file, an empty manifest or an empty commit marker (0, 49, 50 pages
    left: the data, the manifest, the marker fail), and the error said to check the network. Now the rank's files
    and the empty folder go, and the error says the remote is full."""
    rem = tmp_path / "rem"
    rem.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(rem)], check=True)
    try:
        events = Events()
        cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False, "directory": shm_dir},
                               remote={"url": f"file://{rem}"})
        with Checkpointer(cfg, job="j", on_event=events) as ck:
            assert ck.save({"w": torch.ones(50_000)}, 1).wait(timeout=30)  # 200 kB: 49 pages
            fill_fs(rem, leave_pages)
            h = ck.save({"w": torch.ones(50_000)}, 2)
            assert h.wait(timeout=30) is False and h.tiers_done == ["disk"]
            assert "the remote storage is full" in events[-1].message, events[-1].message
            assert sorted(os.listdir(rem / "j")) == ["COMMITTED.json", step_dirname(1)]
    finally:
        subprocess.run(["umount", "-l", str(rem)], check=True)
