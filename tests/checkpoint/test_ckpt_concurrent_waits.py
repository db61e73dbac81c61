"""A Checkpointer used from more than one thread (a trainer saving, another thread waiting or restoring), a step
saved again while its first save still uploads, and a persist process dying between two of its reports: each
save's outcome stays its own, and no step the job left or overtook is listed or removed."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint import arena as arena_mod
from trainguard.checkpoint import checkpointer as ckpt_mod
from trainguard.checkpoint.snapshot import PendingCopy


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, model.in_features)).sum().backward()
    opt.step()


def test_a_wait_on_another_thread_does_not_forget_the_trainers_newer_copy(make_config, monkeypatch):
    # wait() cleared whatever copy was pending when its own wait ended: woken after the trainer had started the
    # next overlapped copy, it forgot that one. The save after it then did not wait for that copy's request,
    # which reached the persist process last and removed the newer step from disk ("the job went back").
    real_wait_host, real_submit = PendingCopy.wait_host, Checkpointer._submit
    submitted: list[int] = []

    def late_waking_wait_host(self, timeout=None):
        done = real_wait_host(self, timeout)
        if threading.current_thread().name == "waiter":
            time.sleep(1.0)  # descheduled between its wait and forgetting the copy
        return done

    def slow_submit(self, step, *args, **kwargs):
        if step == 2:
            time.sleep(2.0)  # step 2's copy thread is slow to send its request (a loaded box)
        submitted.append(step)
        return real_submit(self, step, *args, **kwargs)

    monkeypatch.setattr(PendingCopy, "wait_host", late_waking_wait_host)
    monkeypatch.setattr(Checkpointer, "_submit", slow_submit)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with Checkpointer(make_config(disk={"keep": 5}), job="waiter") as ck:
        ck.save(state, 1, overlap_with=opt)
        waiter = threading.Thread(target=ck.wait, args=(1,), name="waiter")
        waiter.start()
        time.sleep(0.2)
        ck.save(state, 2, overlap_with=opt)  # the trainer's next copy, while the waiter sleeps
        copy2 = ck._pending
        waiter.join(30)
        weights_at_2 = model.weight.detach().clone()
        _train(model, opt)  # the pre-hook must still wait for copy 2
        ck.save(state, 3)
        assert ck.wait(3) and ck.wait(2)
        assert copy2 is not None and submitted == [1, 2, 3]
        assert [s for s, _ in ck.disk.committed_steps()] == [1, 2, 3]
        fresh = torch.nn.Linear(64, 64)
        assert ck.restore({"model": fresh}, step=2) == 2
        assert torch.equal(fresh.weight, weights_at_2)


def test_a_step_saved_again_leaves_a_waiter_on_its_first_save_an_answer(make_config, tmp_path):
    # The second save replaced the step's status, and the first save's own reports (its upload's, its release)
    # were then dropped as another save's: a thread in the first save's wait() never returned.
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: at 2 MiB/s its upload runs ~2 s after the disk tier is done
    state = {"model": model}
    cfg = make_config(remote={"url": f"file://{tmp_path}/remote"}, persist={"bandwidth_mib_s": 2})
    with Checkpointer(cfg, job="resave") as ck:
        first = ck.save(state, 7)
        answer: list[bool] = []
        waiter = threading.Thread(target=lambda: answer.append(first.wait(timeout=30)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not ck._status[7].slot_freed:  # its slot is free (disk done) while its upload still runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not ck._status[7].released
        second = ck.save(state, 7)
        assert second.wait(60)
        waiter.join(60)
        assert answer == [True]


def test_a_channel_closed_report_does_not_wait_for_the_lock_its_closer_holds(make_config):
    # _persist_died holds the lock while it closes the dead channel, which joins the reader thread; the reader's
    # last report (channel_closed) waited for that lock, so the save stalled for the join's 5 s timeout.
    with Checkpointer(make_config(), job="closed") as ck:
        with ck._lock:
            reader = threading.Thread(target=ck._on_report, args=({"op": "channel_closed"},))
            reader.start()
            reader.join(3)
            assert not reader.is_alive(), "the channel_closed report waited for the lock"


def test_retiring_a_stale_memory_copy_never_retires_the_slots_next_step(make_config, monkeypatch):
    # The stale slots were chosen under the lock and retired after it: a save taking such a slot in between had
    # its new copy retired, and the newest step vanished from steps() though wait() said it was durable.
    real_retire = arena_mod.retire_manifest

    def slow_retire(paths):
        time.sleep(1.5)  # the reader thread loses the CPU right after choosing the stale slots
        real_retire(paths)

    monkeypatch.setattr(ckpt_mod.arena_mod, "retire_manifest", slow_retire)
    model = torch.nn.Linear(64, 64)
    with Checkpointer(make_config(memory={"keep": 1}, disk={"enabled": False}), job="retire") as ck:
        assert ck.save({"model": model}, 1).wait(30)
        ck.save({"model": model}, 2)  # its memory report makes step 1's slot stale
        time.sleep(0.3)
        ck.save({"model": model}, 3)  # memory.keep 1: two slots, so step 1's is reused at once
        assert ck.wait(3)
        assert [(s.step, s.tiers) for s in ck.steps()] == [(3, ["memory"])]


def test_a_persist_killed_between_its_memory_and_disk_tiers_leaves_no_step_of_a_run_the_job_left(make_config):
    # The persist process died after listing step 3 in memory and before freeing its slot; the job went back
    # (restore step 1, save 2). The going back skipped step 3's still-busy slot, so step 3 of the run the job left
    # stayed listed, and the restart restored it instead of step 2.
    model = torch.nn.Linear(2048, 2048)  # 16 MiB: the disk commit's fsync leaves a window after the memory tier
    state = {"model": model}
    for _ in range(10):
        cfg = make_config(memory={"keep_on_close": True}, overwrite=True)
        ck = Checkpointer(cfg, job="goback")
        try:
            for s in (1, 2):
                with torch.no_grad():
                    model.weight.fill_(s)
                assert ck.save(state, s).wait(60)
            with torch.no_grad():
                model.weight.fill_(3)
            proc = ck.channel.proc
            ck.save(state, 3)
            manifest = ck.arena.paths(ck._status[3].slot).manifest
            deadline = time.monotonic() + 30
            while not os.path.exists(manifest) and time.monotonic() < deadline:
                time.sleep(0.0002)  # not a bare spin: the box has two cores, and the persist needs one
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.2)  # a slot_free already sent is read by now
            hit = not ck._status[3].slot_freed
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            if not hit:
                continue  # its disk tier was done already: try again
            assert ck.restore({"model": torch.nn.Linear(2048, 2048)}, step=1) == 1
            with torch.no_grad():
                model.weight.fill_(20)
            assert ck.save(state, 2).wait(60)
            assert 3 not in [s.step for s in ck.steps()]
        finally:
            ck.close()
        fresh = torch.nn.Linear(2048, 2048)
        with Checkpointer(cfg, job="goback") as again:
            assert again.restore({"model": fresh}) == 2
        assert fresh.weight[0, 0].item() == 20.0
        return
    pytest.skip("the persist process finished step 3's disk tier before it could be killed, 10 times")
