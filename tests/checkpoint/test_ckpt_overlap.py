"""Overlapped snapshot: parameters copied in the background are never seen half-updated by the optimizer."""

from __future__ import annotations

import torch

from trainguard.checkpoint import Checkpointer


def test_optimizer_step_waits_for_background_copy(make_config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x = torch.randn(16, 512)
    with Checkpointer(make_config(), job="ov") as ck:
        for step in range(1, 4):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            model(x).sum().backward()  # gradients ready: the optimizer step can follow the save immediately
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            expected_mom = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            ck.save({"model": model, "optim": opt}, step, overlap_with=opt)
            # The optimizer mutates parameters and momentum at once (its pre-hook waits for the background copy);
            # then forward mutates BatchNorm buffers (copied before save returned).
            opt.step()
            opt.zero_grad()
            model(x).sum().backward()
            opt.zero_grad()
            assert ck.wait(step, timeout=60)
            m2 = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.BatchNorm1d(2048),
                                     torch.nn.Linear(2048, 512))
            opt2 = torch.optim.SGD(m2.parameters(), lr=0.5, momentum=0.9)
            assert ck.restore({"model": m2, "optim": opt2}, step=step) == step
            for k, v in expected.items():
                assert torch.equal(m2.state_dict()[k], v), (step, k)
            for p, mom in zip(m2.parameters(), expected_mom):
                assert torch.equal(opt2.state[p]["momentum_buffer"], mom)


def test_save_without_overlap_copies_everything_before_returning(make_config):
    w = torch.ones(1000)
    with Checkpointer(make_config(), job="noov") as ck:
        ck.save({"w": w}, 1)
        w.add_(1)  # mutating right after save must not leak into the snapshot
        assert ck.wait(1, timeout=30)
        got = torch.zeros(1000)
        ck.restore({"w": got})
        assert torch.equal(got, torch.ones(1000))


def test_one_persist_process_per_checkpointer_and_no_thread_left(make_config):
    """The overlapped copy publishes from its own thread while the trainer calls wait(): the first use from both
    must start one persist process, not one each, and close() must leave no reader thread behind."""
    import threading

    import psutil

    def readers() -> int:
        return sum(t.name == "trainguard-ckpt-reader" for t in threading.enumerate())

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    with Checkpointer(make_config(), job="one-channel") as ck:
        for step in range(1, 3):
            model(torch.randn(4, 64)).sum().backward()
            ck.save({"model": model, "optim": opt}, step, overlap_with=opt)
            opt.step()
            opt.zero_grad()
        assert ck.wait(2, timeout=60)
        spawned = [p for p in me.children() if p.pid not in before]
        assert len(spawned) == 1, [p.cmdline() for p in spawned]
        assert readers() == 1
    assert readers() == 0


def test_an_optimizer_taking_a_freed_ones_id_waits_for_the_copy_too(make_config):
    # A training phase builds its own optimizer: the one freed after the last phase's save leaves its id to the
    # next phase's, which the checkpointer took for already hooked; its first step then ran during the overlapped
    # copy of the parameters (a snapshot mixing values from before and after that step).
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    x = torch.randn(8, 512)
    previous: list[torch.optim.Optimizer] = []
    reused: list[int] = []

    def phase(ck: Checkpointer, step: int) -> None:
        old_id = id(previous[0]) if previous else None
        previous.clear()  # CPython usually hands the freed address to the next object of its size
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if id(opt) == old_id:
            reused.append(step)
        model(x).sum().backward()
        before = model.weight.detach().clone()
        ck.save({"model": model}, step, overlap_with=opt)
        opt.step()  # must wait for the background copy of the weights
        opt.zero_grad()
        assert ck.wait(step, timeout=60)
        live = {"model": torch.nn.Linear(512, 512)}
        assert ck.restore(live, step=step) == step
        assert torch.equal(live["model"].weight, before), f"phase {step}: the snapshot holds post-step weights"
        assert len(opt._optimizer_step_pre_hooks) == 1, f"phase {step}: the optimizer's step does not wait"
        previous.append(opt)

    with Checkpointer(make_config(memory={"enabled": False}), job="phases") as ck:
        for step in range(1, 30):
            phase(ck, step)
            if len(reused) == 3:
                break
    assert reused, "no optimizer got a freed one's id in 29 phases: the case was not exercised"
