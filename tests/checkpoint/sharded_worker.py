"""One rank of a real multi-process gloo job on CPU for the sharded-checkpoint tests (FSDP2, tensor parallel).

Usage: python sharded_worker.py SCENARIO[,SCENARIO...] RANK WORLD WORKDIR
Scenarios (several, comma-separated, run in that order in the same process group):
  save     FSDP2 model + Adam and a tensor-parallel model, sharded over WORLD ranks; saves both through the
           Checkpointer (job "fsdp" step 3, job "tp" step 1), restores in the same layout after more training,
           writes the full tensors as a reference (rank 0), and a DCP checkpoint with dcp.save for the import test.
  reshard  restores both jobs into WORLD ranks (another world size), checks against the reference bitwise; loads
           the `ckpt export`ed checkpoint with dcp.load and the `ckpt import`ed one; restores a job whose
           shards on one rank are corrupt through the hook (every rank must raise).
  ddp_to_fsdp  a plain model + Adam saved by every rank (DDP), restored into FSDP2 with a fresh Adam.
Prints one JSON line ``{"rank": r, ...facts}`` on success; any failure exits non-zero with a traceback.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import warnings

if __name__ == "__main__":
    # A rank imports some thousand torch modules (FSDP2, DTensor, DCP): the cyclic collector, run over and over
    # on the growing heap meanwhile, costs ~20 % of that (0.3 s CPU per rank). It is back on, with the imported
    # objects frozen out of its scans, before the rank does any of its work (main).
    gc.disable()

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

DIM = 64


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.ReLU(), torch.nn.Linear(4 * DIM, DIM),
                               torch.nn.ReLU(), torch.nn.Linear(DIM, 10))


def fsdp_model(seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = make_model(seed)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def tp_model(seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    m = make_model(seed)
    return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, DIM, generator=g)
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def full(sd):
    """Every tensor of a (nested) state dict as a plain full tensor (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(prefix, v):
        if isinstance(v, DTensor):
            out[prefix] = v.full_tensor().clone()
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)

    walk("", sd)
    return out


def same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ bit for bit (or are missing on one side); ``["<nothing compared>"]`` if empty."""
    if not a and not b:
        return ["<nothing compared>"]
    bad = sorted(set(a) ^ set(b))
    return bad + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k].view(-1).view(torch.uint8)
                                                                       if a[k].dtype.is_floating_point else a[k],
                                                                       b[k].view(-1).view(torch.uint8)
                                                                       if b[k].dtype.is_floating_point else b[k])]


def config(workdir: str):
    from trainguard.checkpoint import CheckpointConfig

    return CheckpointConfig(directory=os.path.join(workdir, "ckpt"),
                            memory={"directory": os.path.join(workdir, "shm")},
                            persist={"chunk_mib": 1, "service": "inline"})


def main() -> None:
    scenarios, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them (the hook reads them)
    # Every module the scenarios import, loaded before the collector is back on (see the top of the file).
    for name in ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                 "trainguard.hook"):
        importlib.import_module(name)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from trainguard.checkpoint import Checkpointer

    gc.freeze()
    gc.enable()
    pg_file = os.path.join(workdir, "pg-" + scenarios.replace(",", "+"))
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world)

    facts: dict = {"rank": rank}
    cfg = config(workdir)
    # Scenarios given as "a,b" run one after the other in the same ranks: starting a rank (imports, process
    # group) costs more than any scenario here.
    for scenario in scenarios.split(","):
        if scenario == "save":
            m, opt = fsdp_model(0, world)
            train(m, opt, 2, seed=1)
            msd, osd = get_state_dict(m, opt)
            state = {"model": msd, "optim": osd, "epoch": 3}
            with Checkpointer(cfg, rank=rank, world_size=world, job="fsdp") as ck:
                ck.save(state, 3, overlap_with=opt)
                ref = full(state)
                local_before = {k: v.to_local().clone() for k, v in msd.items()}
                train(m, opt, 1, seed=2)  # the optimizer pre-hook waits for the overlapped copy
                assert ck.wait(3, timeout=60)
                facts["staged_bytes"] = ck.arena.slots[0].size if ck.arena.slots[0] else 0
                # Restore in the same layout: each rank copies its own shard, in place, nothing else.
                msd2, osd2 = get_state_dict(m, opt)
                live = {"model": msd2, "optim": osd2, "epoch": 0}
                params_before = [p for p in m.parameters()]
                assert ck.restore(live) == 3
                set_state_dict(m, opt, model_state_dict=live["model"], optim_state_dict=live["optim"])
                assert [p for p in m.parameters()] == params_before
                assert all(torch.equal(m.state_dict()[k].to_local(), local_before[k]) for k in local_before)
                facts["same_layout_read"] = ck.last_restore_read
                facts["same_layout_diff"] = same(full(get_state_dict(m, opt)[0]), {k[6:]: v for k, v in ref.items()
                                                                                 if k.startswith("model.")})
                assert live["epoch"] == 3
            if rank == 0:
                torch.save(ref, os.path.join(workdir, "ref_fsdp.pt"))
            tp = tp_model(0, world)
            train(tp, torch.optim.SGD(tp.parameters(), lr=0.1), 1, seed=3)
            with Checkpointer(cfg, rank=rank, world_size=world, job="tp") as ck:
                ck.save({"model": tp}, 1)
                assert ck.wait(1, timeout=60)
            tp_ref = full(tp.state_dict())
            if rank == 0:
                torch.save(tp_ref, os.path.join(workdir, "ref_tp.pt"))
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": get_state_dict(m, opt)[0]}, checkpoint_id=os.path.join(workdir, "dcp_native"))
            native_ref = full({"model": get_state_dict(m, opt)[0]})  # collective: every rank
            if rank == 0:
                torch.save(native_ref, os.path.join(workdir, "ref_native.pt"))
        elif scenario == "reshard":
            ref = torch.load(os.path.join(workdir, "ref_fsdp.pt"), weights_only=True)
            m, opt = fsdp_model(5, world)  # other initial values
            msd, osd = get_state_dict(m, opt)
            live = {"model": msd, "optim": osd, "epoch": 0}
            with Checkpointer(cfg, rank=rank, world_size=world, job="fsdp") as ck:
                assert ck.restore(live) == 3
                facts["read"] = ck.last_restore_read
                facts["tier"] = ck.last_restore_tier
            set_state_dict(m, opt, model_state_dict=live["model"], optim_state_dict=live["optim"])
            got = full(dict(zip(("model", "optim"), get_state_dict(m, opt))))
            facts["fsdp_diff"] = same(got, {k: v for k, v in ref.items() if k != "epoch"})
            facts["fsdp_keys"] = sorted(got)
            train(m, opt, 1, seed=4)  # the restored optimizer works
            tp = tp_model(7, world)
            with Checkpointer(cfg, rank=rank, world_size=world, job="tp") as ck:
                assert ck.restore({"model": tp}) == 1
            facts["tp_diff"] = same(full(tp.state_dict()), torch.load(os.path.join(workdir, "ref_tp.pt"),
                                                                      weights_only=True))
            # The DCP checkpoint written by dcp.save at another world size, imported by `ckpt import`.
            facts["import_diff"] = None
            if os.path.isdir(os.path.join(workdir, "ckpt", "imported")):
                m3, _ = fsdp_model(9, world)
                with Checkpointer(cfg, rank=rank, world_size=world, job="imported") as ck:
                    live3 = {"model": get_state_dict(m3, [])[0]}
                    assert ck.restore(live3) is not None
                facts["import_diff"] = same(full(m3.state_dict()),
                                            {k[6:]: v for k, v in torch.load(os.path.join(workdir, "ref_native.pt"),
                                                                             weights_only=True).items()})
            # `ckpt export` of the 4-rank step, loaded by dcp.load itself at this world size.
            import torch.distributed.checkpoint as dcp

            m4, opt4 = fsdp_model(11, world)
            msd4, osd4 = get_state_dict(m4, opt4)
            sd = {"model": msd4, "optim": osd4}
            dcp.load(sd, checkpoint_id=os.path.join(workdir, "exported"))
            set_state_dict(m4, opt4, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            got = full(dict(zip(("model", "optim"), get_state_dict(m4, opt4))))
            facts["dcp_diff"] = same(got, {k: v for k, v in ref.items() if k != "epoch"})
            # A rank whose shards are corrupt: through the hook every rank raises, none hangs or trains.
            from trainguard.hook import Session

            sess = Session(checkpoint_dir=cfg.directory, job="fsdp_bad", checkpoint_options={
                "memory": {"directory": cfg.memory.directory}, "persist": {"service": "inline"}})
            try:
                sess.restore({"model": get_state_dict(m4, opt4)[0]})
                facts["bad_raised"] = None
            except Exception as exc:
                facts["bad_raised"] = type(exc).__name__
            sess.close()
        elif scenario == "ddp_to_fsdp":
            # A plain (DDP: every rank the same full state) model + Adam saved by every rank, restored into an FSDP2
            # model with a fresh Adam, the optimizer given as itself (as the hook takes it).
            plain = make_model(0)
            popt = torch.optim.Adam(plain.parameters(), lr=1e-2)
            train(plain, popt, 2, seed=1)
            with Checkpointer(cfg, rank=rank, world_size=world, job="ddp") as ck:
                ck.save({"model": plain, "optim": popt}, 2)
                assert ck.wait(2, timeout=60)
            dist.barrier()  # the step is complete once every rank committed its copy
            ref = full({"model": plain.state_dict(), "optim": popt.state_dict()})
            m, opt = fsdp_model(5, world)
            with Checkpointer(cfg, rank=rank, world_size=world, job="ddp") as ck:
                assert ck.restore({"model": m, "optim": opt}) == 2
            got = full({"model": m.state_dict(), "optim": opt.state_dict()})
            facts["ddp_to_fsdp_diff"] = same(got, ref)
            train(m, opt, 1, seed=4)  # the restored sharded optimizer steps
        else:
            raise SystemExit(f"unknown scenario {scenario!r}: save, reshard or ddp_to_fsdp (comma-separated)")
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(facts), flush=True)
    _leave()


def _leave() -> None:
    """Exits at once: every fact is printed, every file written and closed, every Checkpointer closed. FSDP2, DTensor
    and DCP import some thousand modules, and the interpreter's finalization then spends seconds in the garbage
    collector per rank (4 ranks on 2 cores), which every test of the module waited out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
