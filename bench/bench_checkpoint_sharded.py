"""Sharded checkpoint benchmark: an FSDP2 model + Adam on N gloo ranks (CPU), trainguard vs DCP in the same run.

Run through ``python bench/bench_checkpoint.py --sharded [--sharded-mib 256] [--ranks 2]`` (it starts the ranks).

Per rank, measured in one run and reported for the slowest rank (a step waits for every rank):

* stall per save: trainguard ``save()`` (copy into shared memory), ``save(overlap_with=opt)`` (visible: the
  call plus the optimizer step's extra wait; effective: visible plus how much slower the overlapped
  forward/backward ran), vs ``torch.distributed.checkpoint.async_save`` (visible: the call; effective: plus the
  slowdown of the forward/backward its background write overlaps);
* restore in the same layout: trainguard from shared memory and from local disk (page cache warm), vs
  ``dcp.load`` (warm);
* reshard: the N-rank checkpoint restored into one plain (unsharded) process, trainguard vs ``dcp.load``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

warnings.simplefilter("ignore")
D = 1024


def _timer() -> float:
    return time.perf_counter()


def build(layers: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(layers)])
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-4)


def worker(rank: int, world: int, work: str, mib: float, repeats: int) -> None:
    """One rank: prints a JSON line of its timings (rank 0 adds the single-process reshard figures)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainguard.checkpoint import CheckpointConfig, Checkpointer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    layers = max(1, int(mib * (1 << 20) / (3 * 4 * (D * D + D))))  # weights + Adam's two moments, float32
    m, opt = build(layers, fsdp=True)
    x = torch.randn(32, D)

    def fb() -> float:
        t0 = _timer()
        m(x).square().mean().backward()
        return _timer() - t0

    def step() -> float:
        t0 = _timer()
        opt.step()
        opt.zero_grad()
        return _timer() - t0

    for _ in range(2):
        fb()
        step()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    r: dict[str, Any] = {"rank": rank, "layers": layers,
                         "state_bytes_rank": sum(t.to_local().numel() * 4 for t in msd.values()) * 3}
    shm = shm_dir(work)  # one arena root for every rank: the memory tier counts a step when all ranks hold it
    try:
        cfg = CheckpointConfig(directory=os.path.join(work, "tg"), memory={"directory": shm}, disk={"keep": 2})
        ck = Checkpointer(cfg, rank=rank, world_size=world, job="shard")
        ck.prepare(state)
        ck.save(state, 99)  # warm-up (first-use costs), not measured
        ck.wait(99)
        plain, ov_vis, ov_eff, fb_alone, st_alone = [], [], [], [], []
        for i in range(repeats):
            dist.barrier()
            fb_alone.append(fb())
            st_alone.append(step())
            dist.barrier()
            t0 = _timer()
            h = ck.save(state, i)
            plain.append(_timer() - t0)
            h.wait()
        # The optimizer step's wait for the overlapped copy, timed by pre-hooks around trainguard's own (hooks run
        # in registration order; trainguard registers its hook at the first overlapped save).
        marks: dict[str, float] = {}
        opt.register_step_pre_hook(lambda *_: marks.__setitem__("before", _timer()))
        after_hook = None
        for i in range(repeats):
            dist.barrier()
            fb()
            step()  # the gradients of the overlapped run below come from a fresh backward
            dist.barrier()
            t0 = _timer()
            ck.save(state, 100 + i, overlap_with=opt)
            call = _timer() - t0
            if after_hook is None:
                after_hook = opt.register_step_pre_hook(lambda *_: marks.__setitem__("after", _timer()))
            f = fb()
            step()  # the pre-hook waits for the copy here
            vis = call + (marks["after"] - marks["before"])
            ov_vis.append(vis)
            ov_eff.append(vis + max(0.0, f - statistics.median(fb_alone)))
            ck.wait(100 + i)
        r.update(tg_save_s=statistics.median(plain), tg_overlap_visible_s=statistics.median(ov_vis),
                 tg_overlap_effective_s=statistics.median(ov_eff), fb_alone_s=statistics.median(fb_alone))
        # DCP async_save with its defaults, overlapped with the same forward/backward.
        d_vis, d_eff, d_total = [], [], []
        # async_save finishes with collectives in a background thread: give it its own group (as DCP advises),
        # or they interleave with FSDP's all-gathers of the overlapped forward/backward.
        async_pg = dist.new_group(backend="gloo")
        dcp.async_save(state, checkpoint_id=os.path.join(work, "dcp-warmup"), process_group=async_pg).result()
        for i in range(repeats):
            out = os.path.join(work, f"dcp{i}")
            dist.barrier()
            t0 = _timer()
            fut = dcp.async_save(state, checkpoint_id=out, process_group=async_pg)
            call = _timer() - t0
            f = fb()
            fut.result()
            d_total.append(_timer() - t0)
            step()
            d_vis.append(call)
            d_eff.append(call + max(0.0, f - statistics.median(fb_alone)))
        r.update(dcp_async_visible_s=statistics.median(d_vis), dcp_async_effective_s=statistics.median(d_eff),
                 dcp_async_total_s=statistics.median(d_total))
        # Restores into the live sharded state, same layout (page cache warm for both).
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = _timer()
            got = ck.restore(state)
            times.append(_timer() - t0)
            assert got == 100 + repeats - 1 and ck.last_restore_tier == "memory", (got, ck.last_restore_tier)
        r["tg_restore_shm_s"] = statistics.median(times)
        ck.close()
        cfg_disk = CheckpointConfig(directory=os.path.join(work, "tg"), memory={"enabled": False,
                                    "directory": shm}, persist={"service": "inline"})
        with Checkpointer(cfg_disk, rank=rank, world_size=world, job="shard") as ck2:
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = _timer()
                assert ck2.restore(state) is not None and ck2.last_restore_tier == "disk"
                times.append(_timer() - t0)
            r["tg_restore_disk_s"] = statistics.median(times)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = _timer()
            dcp.load(state, checkpoint_id=os.path.join(work, f"dcp{repeats - 1}"))
            times.append(_timer() - t0)
        r["dcp_load_s"] = statistics.median(times)
        dist.barrier()
    finally:
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        # Reshard: the whole model into one plain process (evaluation), from the N-rank checkpoints.
        plain_m, _ = build(layers, fsdp=False)
        tg_t, dcp_t = [], []
        with Checkpointer(cfg_disk, rank=0, world_size=1, job="shard") as ck3:
            for _ in range(repeats):
                t0 = _timer()
                assert ck3.restore({"model": plain_m}) is not None
                tg_t.append(_timer() - t0)
                r["tg_reshard_read_bytes"] = sum(ck3.last_restore_read.values())
                sd = {"model": plain_m.state_dict()}
                t0 = _timer()
                dcp.load(sd, checkpoint_id=os.path.join(work, f"dcp{repeats - 1}"))
                dcp_t.append(_timer() - t0)
        r["tg_reshard_to_1_s"], r["dcp_reshard_to_1_s"] = statistics.median(tg_t), statistics.median(dcp_t)
    print(json.dumps(r), flush=True)


def shm_dir(work: str) -> str:
    """The arena root shared by the ranks of one run."""
    return os.path.join("/dev/shm", "tg-bench-shard-" + os.path.basename(work))


def run(ranks: int, mib: float, repeats: int) -> dict[str, Any]:
    """Starts ``ranks`` worker processes; returns the slowest rank's figures (plus rank 0's reshard ones)."""
    work = tempfile.mkdtemp(prefix="tg-bench-sharded-", dir="/var/tmp")
    try:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), str(ranks), work, str(mib),
                                   str(repeats)], stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        outs = []
        for p in procs:
            stdout, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"sharded bench rank failed with code {p.returncode}")
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir(work), ignore_errors=True)
    res: dict[str, Any] = {"ranks": ranks, "layers": outs[0]["layers"]}
    for k in outs[0]:
        if k.endswith("_s") and not k.startswith(("tg_reshard", "dcp_reshard")):
            res[k] = max(o[k] for o in outs)
    for k in ("tg_reshard_to_1_s", "dcp_reshard_to_1_s", "tg_reshard_read_bytes"):
        res[k] = outs[0][k]
    res["state_gib_total"] = sum(o["state_bytes_rank"] for o in outs) / (1 << 30)
    return res


def report(r: dict[str, Any]) -> None:
    """Prints the sharded rows with their DCP baselines."""
    print(f"\n== sharded: FSDP2 + Adam, {r['layers']} Linear({D},{D}) layers, {r['state_gib_total']:.3f} GiB "
          f"over {r['ranks']} gloo ranks (slowest rank) ==")
    base = r["dcp_async_visible_s"]
    for name, key in (("dcp.async_save, visible (baseline)", "dcp_async_visible_s"),
                      ("dcp.async_save, effective (+ compute slowdown)", "dcp_async_effective_s"),
                      ("trainguard save()", "tg_save_s"),
                      ("trainguard save(overlap_with=opt), visible", "tg_overlap_visible_s"),
                      ("trainguard save(overlap_with=opt), effective", "tg_overlap_effective_s")):
        print(f"  {name:<52} {r[key]:8.4f} s   dcp visible / this = {base / max(r[key], 1e-9):6.1f}x")
    print(f"  (forward/backward alone {r['fb_alone_s']:.4f} s; dcp.async_save until durable "
          f"{r['dcp_async_total_s']:.3f} s)")
    for name, key, ref in (("dcp.load, same layout (baseline)", "dcp_load_s", "dcp_load_s"),
                           ("trainguard restore from shared memory", "tg_restore_shm_s", "dcp_load_s"),
                           ("trainguard restore from local disk", "tg_restore_disk_s", "dcp_load_s"),
                           ("dcp.load, reshard to 1 plain process (baseline)", "dcp_reshard_to_1_s",
                            "dcp_reshard_to_1_s"),
                           ("trainguard reshard to 1 plain process", "tg_reshard_to_1_s", "dcp_reshard_to_1_s")):
        print(f"  {name:<52} {r[key]:8.4f} s   baseline / this = {r[ref] / max(r[key], 1e-9):6.1f}x")


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))
