"""A user's training script as the hook's README shows it, for tests that launch it under torchrun (gloo, CPU).

Usage: python -m torch.distributed.run --standalone --nproc-per-node N hook_user_worker.py SCENARIO CKPT OUT STEPS
Scenarios:
  fsdp          an FSDP2 model (``fully_shard`` on a CPU mesh) and AdamW, ``state = {"model": model, "optim":
                opt}`` given to ``session.restore`` and ``session.step_done``, saving every 4 steps; runs to
                STEPS and writes ``{"start", "digest"}`` (rank 0) to OUT/result.json: the digest covers the full
                parameters after the last step.
  spawn         (run with plain python, PORT for STEPS) 2 processes started by ``mp.spawn`` that build their own group
                (``init_process_group(rank=r, world_size=2)``, no RANK in the environment), saving ``{"w": rank}``
                every step for 3 steps; each writes its session's rank, world size, restored step, ``w`` after the
                restore and latched errors to OUT/rank<R>.json. ``spawn-late``: ``trainguard.init()`` before
                ``init_process_group``; each writes what ``session.restore`` raised. ``spawn-late-save``: the
                same order, no restore, two steps through ``step_done``; each writes its latched errors.
  restore_fails a Stateful whose ``load_state_dict`` raises a plain AssertionError on rank 1 (a user's own check);
                every rank writes the type of what ``session.restore`` raised to OUT/rank<R>.json. STEPS 1: the
                first launch, which only saves step 0; STEPS 0: the second, which restores.
  fsdp+restore_fails  both in one launch (one torchrun and its workers' torch imports instead of two), STEPS the
                launch (1 or 2): ``fsdp`` on CKPT/fsdp with 6 steps, writing to OUT/fsdp-<launch>, then
                ``restore_fails`` on CKPT/restore_fails (its first launch, then its second).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import trainguard

warnings.filterwarnings("ignore")


class Counter:
    """A user's own Stateful object (a data loader position), checking what it is given."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        assert dist.get_rank() != 1, "rank 1's data shard changed since the checkpoint"
        self.position = sd["position"]


def fsdp(ckpt: str, out: str, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    session = trainguard.init(checkpoint_dir=ckpt, save_every=4)
    start = session.restore(state)
    x = torch.randn(8 * steps, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (8 * steps,), generator=torch.Generator().manual_seed(2))
    for step in range(start, steps):
        torch.nn.functional.cross_entropy(model(x[8 * step:8 * step + 8]), y[8 * step:8 * step + 8]).backward()
        opt.step()
        opt.zero_grad()
        session.step_done(step, state)
    session.close()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().full_tensor().numpy().tobytes())
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"start": start, "digest": h.hexdigest()}, f)


def restore_fails(ckpt: str, out: str, steps: int) -> None:
    state = {"counter": Counter(), "w": torch.zeros(4)}
    session = trainguard.init(checkpoint_dir=ckpt)
    if steps:  # the first launch saves one step
        session.save(state, 0)
        session.close()
        return
    try:
        session.restore(state)
        raised = None
    except BaseException as exc:  # noqa: BLE001 - what reaches the user is what the test checks
        raised = type(exc).__name__
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"raised": raised}, f)
    # No clean-up: a rank left in a collective by the other must not keep this one alive (the test sees it).
    os._exit(0)


def spawned(rank: int, scenario: str, ckpt: str, out: str, port: int) -> None:
    def group() -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))

    state = {"w": torch.full((4,), float(rank))}
    if scenario == "spawn-late-save":
        session = trainguard.init(checkpoint_dir=ckpt, save_every=1)
        group()
        for step in range(2):
            session.step_done(step, state)
        session.wait()
        facts = {"errors": [[type(e).__name__, str(e)] for e in session.errors]}
    elif scenario == "spawn-late":
        session = trainguard.init(checkpoint_dir=ckpt, save_every=1)
        group()
        try:
            session.restore(state)
            facts: dict = {"raised": None}
        except BaseException as exc:  # noqa: BLE001 - what reaches the user is what the test checks
            facts = {"raised": type(exc).__name__}
    else:
        group()
        session = trainguard.init(checkpoint_dir=ckpt, save_every=1)
        start = session.restore(state)
        restored_w = state["w"].tolist()
        for step in range(start, start + 3):
            session.step_done(step, state)
        facts = {"rank": session.rank, "world": session.world_size, "restored": session.restored_step,
                 "w": restored_w, "errors": [str(e) for e in session.errors]}
    session.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()
    # What the test checks is written: skip the interpreter's teardown (torch's, seconds a process on a loaded
    # box), as restore_fails does; mp.spawn sees exit code 0 all the same.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    scenario, ckpt, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if scenario.startswith("spawn"):
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(scenario, ckpt, out, steps), nprocs=2)
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if scenario == "fsdp+restore_fails":
        # fsdp first: restore_fails' second launch ends the process from inside a failed collective.
        fsdp(os.path.join(ckpt, "fsdp"), os.path.join(out, f"fsdp-{steps}"), 6)
        restore_fails(os.path.join(ckpt, "restore_fails"), out, 1 if steps == 1 else 0)
    else:
        {"fsdp": fsdp, "restore_fails": restore_fails}[scenario](ckpt, out, steps)
    dist.destroy_process_group()
    # The session is closed (its saves are on disk) and what the test checks is written: skip the interpreter's
    # teardown as spawned() does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
