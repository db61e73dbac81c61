"""Checkpoint benchmark: stall, throughput cost, persist bandwidth, restore time, against same-run baselines.

Usage: python bench/bench_checkpoint.py [--size-gib 2] [--dir /var/tmp/tg-bench] [--json out.json]

State: float32 tensors in a transformer-like mix (embedding, per-layer qkv/proj/mlp matrices, norms and
biases) totalling ``--size-gib``. Every figure is measured in this run and printed with its baseline:

* stall (time the training loop is blocked per save) vs ``torch.save`` + fsync, vs
  ``torch.distributed.checkpoint.async_save`` (default options), vs the copy floor (``copy_`` into
  preallocated buffers); trainguard plain and with the overlapped snapshot (save + optimizer pre-hook wait);
* throughput of a small CPU model with a save every N steps vs no saves, unthrottled and throttled persist;
* persist bandwidth vs a plain fsync'ed write of the same bytes;
* restore time from shared memory, local disk (page cache dropped), fsspec (file://, cache dropped) vs
  ``torch.load`` (cache dropped) and ``torch.distributed.checkpoint.load`` (cache dropped).

``--sharded`` runs the sharded case instead (FSDP2 on ``--ranks`` gloo ranks vs DCP async_save/load, and a
reshard restore; see bench_checkpoint_sharded.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer

warnings.simplefilter("ignore")


def make_state(size_gib: float, d: int = 2048) -> dict[str, torch.Tensor]:
    """Float32 tensors, transformer-like, about ``size_gib`` GiB in total."""
    target = int(size_gib * (1 << 30)) // 4
    state: dict[str, torch.Tensor] = {}
    vocab = min(32000, max(1000, target // (8 * d)))
    state["embed.weight"] = torch.empty(vocab, d)
    used = vocab * d
    layer = 0
    while used < target:
        shapes = {"attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d),
                  "attn.proj.bias": (d,), "ln1.weight": (d,), "ln1.bias": (d,), "mlp.up.weight": (4 * d, d),
                  "mlp.up.bias": (4 * d,), "mlp.down.weight": (d, 4 * d), "mlp.down.bias": (d,),
                  "ln2.weight": (d,), "ln2.bias": (d,)}
        for name, shape in shapes.items():
            n = 1
            for s in shape:
                n *= s
            if used + n > target and name.endswith("weight") and len(shape) == 2:
                shape = (max(1, (target - used) // shape[1]), shape[1])
                n = shape[0] * shape[1]
            state[f"layers.{layer}.{name}"] = torch.empty(shape)
            used += n
            if used >= target:
                break
        layer += 1
    g = torch.Generator().manual_seed(0)
    for t in state.values():
        t.normal_(generator=g)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def phase(name: str) -> None:
    """Progress line (stderr), so a slow machine shows where the time goes."""
    print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)


def drop_caches() -> bool:
    """Drops the page cache (root only); returns False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)


class Timer:
    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def init_dist() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        f = tempfile.mktemp(prefix="tg-bench-pg-")
        dist.init_process_group("gloo", init_method=f"file://{f}", rank=0, world_size=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.25, help="state size in GiB (README figures: 2)")
    ap.add_argument("--dir", default="/var/tmp/tg-bench", help="scratch directory on the disk to measure")
    ap.add_argument("--repeats", type=int, default=3, help="saves measured per trainguard configuration")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--components-out", default=None, metavar="FILE",
                    help="write the overlapped save's stall, scaled to --per-node-gib, as a `trainguard ettr "
                         "--components` file")
    ap.add_argument("--per-node-gib", type=float, default=2.58,
                    help="training state per node of the modelled job, GiB (default 2.58: 405e9 parameters x 14 "
                         "bytes (bf16 weights, fp32 master, Adam moments) over 2,048 nodes)")
    ap.add_argument("--sharded", action="store_true",
                    help="run the sharded case only: FSDP2 + Adam on --ranks gloo ranks vs DCP async_save/load")
    ap.add_argument("--sharded-mib", type=float, default=256.0, help="sharded case: total state in MiB")
    ap.add_argument("--ranks", type=int, default=2, help="sharded case: gloo ranks (2-4)")
    args = ap.parse_args()
    if args.sharded:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_checkpoint_sharded as sharded

        if not 1 <= args.ranks <= 8:
            ap.error(f"--ranks must be within 1..8, got {args.ranks}")
        r = sharded.run(args.ranks, args.sharded_mib, args.repeats)
        sharded.report(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    if not args.per_node_gib > 0:
        ap.error(f"--per-node-gib must be a positive number of GiB, got {args.per_node_gib}")

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    shm = tempfile.mkdtemp(prefix="tg-bench-", dir="/dev/shm")
    res: dict[str, float] = {}
    state = make_state(args.size_gib)
    size = nbytes(state)
    gib = size / (1 << 30)
    import faulthandler

    faulthandler.dump_traceback_later(300, repeat=True)  # a stuck phase shows its stack on stderr
    print(f"state: {len(state)} float32 tensors, {gib:.3f} GiB; {os.cpu_count()} CPUs; scratch {args.dir}", flush=True)

    try:
        # ---------------------------------------------------------------- copy floor
        phase("copy floor")
        bufs = {k: torch.empty_like(v) for k, v in state.items()}
        for b in bufs.values():
            b.zero_()  # pre-touch
        times = []
        for _ in range(args.repeats):
            with Timer() as t:
                for k, v in state.items():
                    bufs[k].copy_(v)
            times.append(t.s)
        res["stall_copy_floor_s"] = min(times)
        del bufs
        gc.collect()

        # ---------------------------------------------------------------- raw fsync'ed write bandwidth
        phase("raw write")
        raw = torch.empty(size, dtype=torch.uint8)
        raw.fill_(7)
        view = memoryview(raw.numpy())
        path = os.path.join(args.dir, "raw.bin")
        with Timer() as t:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            off = 0
            while off < size:
                off += os.write(fd, view[off:off + (4 << 20)])
            os.fsync(fd)
            os.close(fd)
        res["raw_write_bw_gib_s"] = gib / t.s
        del view, raw
        os.unlink(path)
        gc.collect()

        # ---------------------------------------------------------------- torch.save + fsync
        phase("torch.save")
        path = os.path.join(args.dir, "torch.pt")
        with Timer() as t:
            torch.save(state, path)
            fsync_path(path)
        res["stall_torch_save_fsync_s"] = t.s

        # ---------------------------------------------------------------- DCP async_save (default options)
        phase("dcp async_save")
        import torch.distributed.checkpoint as dcp

        init_dist()
        dcp_dir = os.path.join(args.dir, "dcp")
        stalls = []
        for i in range(2):
            shutil.rmtree(dcp_dir, ignore_errors=True)
            with Timer() as t:
                fut = dcp.async_save(state, checkpoint_id=dcp_dir)
            stalls.append(t.s)
            with Timer() as t2:
                fut.result()
            fsync_tree(dcp_dir)
        res["stall_dcp_async_save_s"] = min(stalls)
        res["dcp_async_save_total_s"] = min(stalls) + t2.s
        del fut
        gc.collect()

        # ---------------------------------------------------------------- trainguard: stall and persist
        phase("trainguard save")
        ck_dir = os.path.join(args.dir, "tg")
        # nice 0 here: this section measures the persist path's efficiency against a nice-0 raw write (the
        # throughput section below keeps the default nice 10, the setting that protects training).
        cfg = CheckpointConfig(directory=ck_dir, memory={"directory": shm, "keep": 1}, disk={"keep": 2},
                               persist={"nice": 0})
        ck = Checkpointer(cfg, job="bench")
        with Timer() as t:
            ck.prepare(state)
        res["tg_arena_first_touch_s"] = t.s
        stalls, persists = [], []
        for i in range(args.repeats):
            with Timer() as t:
                h = ck.save(state, i)
            stalls.append(t.s)
            with Timer() as tp:
                ok = h.wait()
            assert ok, "persist failed"
            persists.append(tp.s)
        res["stall_tg_save_s"] = statistics.median(stalls)
        res["tg_persist_s"] = statistics.median(persists)
        res["tg_persist_bw_gib_s"] = gib / res["tg_persist_s"]

        phase("trainguard overlapped save")
        # Overlapped: parameters copied while "forward/backward" (matmuls) runs; the optimizer pre-hook waits.
        params = [v.requires_grad_(True) for v in state.values()]
        opt = torch.optim.SGD(params, lr=0.0)
        a = torch.randn(1024, 1024)
        stalls_ov, hooks, computes, alone = [], [], [], []
        for i in range(args.repeats):
            with Timer() as t:  # the compute phase alone, interleaved with the overlapped runs (same load)
                for _ in range(12):
                    a @ a
            alone.append(t.s)
            step = 100 + i
            with Timer() as t:
                ck.save(state, step, overlap_with=opt)
            with Timer() as tc:
                for _ in range(12):
                    a @ a
            with Timer() as th:
                opt.step()  # grads are None: only the pre-hook's wait is measured
            stalls_ov.append(t.s + th.s)
            hooks.append(th.s)
            computes.append(tc.s)
            ck.wait(step)
        res["stall_tg_overlap_s"] = statistics.median(stalls_ov)
        res["tg_overlap_hook_wait_s"] = statistics.median(hooks)
        res["compute_phase_with_overlap_s"] = statistics.median(computes)
        res["compute_phase_alone_s"] = statistics.median(alone)
        # What the overlap really costs the loop: the visible wait plus how much longer the compute it overlaps
        # took (the background copy competes for memory bandwidth and, here, for the same 2 cores).
        res["stall_tg_overlap_effective_s"] = res["stall_tg_overlap_s"] + max(
            0.0, res["compute_phase_with_overlap_s"] - res["compute_phase_alone_s"])
        for v in params:
            v.requires_grad_(False)

        # ---------------------------------------------------------------- restore
        phase("restore")
        live = state
        with Timer() as t:
            got = ck.restore(live)
        assert ck.last_restore_tier == "memory", ck.last_restore_tier
        res["restore_tg_shm_s"] = t.s
        ck.close()  # removes the private arena
        cfg_disk = CheckpointConfig(directory=ck_dir, memory={"directory": shm, "enabled": False},
                                    persist={"service": "inline"})
        res["page_cache_dropped"] = float(drop_caches())
        with Checkpointer(cfg_disk, job="bench") as ck2:
            with Timer() as t:
                got = ck2.restore(live)
            assert ck2.last_restore_tier == "disk" and got is not None
        res["restore_tg_disk_cold_s"] = t.s
        remote = os.path.join(args.dir, "remote")
        shutil.copytree(ck_dir, remote)
        cfg_remote = CheckpointConfig(directory=os.path.join(args.dir, "empty"), memory={"enabled": False,
                                      "directory": shm}, remote={"url": f"file://{remote}"},
                                      persist={"service": "inline"})
        drop_caches()
        with Checkpointer(cfg_remote, job="bench") as ck3:
            with Timer() as t:
                got = ck3.restore(live)
            assert ck3.last_restore_tier == "remote" and got is not None
        res["restore_tg_fsspec_cold_s"] = t.s
        drop_caches()
        with Timer() as t:
            loaded = torch.load(path, weights_only=True)
        res["restore_torch_load_cold_s"] = t.s
        del loaded
        gc.collect()
        drop_caches()
        with Timer() as t:
            dcp.load(live, checkpoint_id=dcp_dir)
        res["restore_dcp_load_cold_s"] = t.s
        with Timer() as t:
            loaded = torch.load(path, weights_only=True)
        res["restore_torch_load_warm_s"] = t.s
        del loaded
        gc.collect()

        # ---------------------------------------------------------------- throughput
        phase("throughput")
        if not args.skip_throughput:
            res.update(throughput(args.dir, shm))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    report(res, gib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.components_out and "stall_tg_overlap_s" in res:
        write_components(args.components_out, res, gib, args.per_node_gib)
    return 0


def write_components(path: str, res: dict[str, float], gib: float, per_node_gib: float) -> None:
    """Writes the measured checkpoint stall, scaled to ``per_node_gib`` of state per node, for ``trainguard ettr``.

    The blocking time of the overlapped save (the snapshot call plus the wait of the next optimizer step) grows
    with the bytes a node copies; nodes snapshot in parallel, so a job's stall is one node's.
    """
    # stall_tg_overlap_s is already the save call plus the pre-hook wait (the hook wait was added a second time)
    blocked = res["stall_tg_overlap_s"]
    scaled = blocked * per_node_gib / gib
    with open(path, "w") as f:
        json.dump({"_source": f"bench/bench_checkpoint.py --size-gib {gib:g}: overlapped save blocked the loop "
                              f"{blocked:.4f} s for {gib:g} GiB on this machine, scaled to {per_node_gib:g} GiB "
                              "per node", "trainguard": {"checkpoint_stall_s": round(scaled, 5)}}, f, indent=1)
    print(f"components: checkpoint_stall_s={scaled:.4f} ({blocked:.4f} s x {per_node_gib:g}/{gib:g} GiB) -> {path}")


def timed_steps(one_step, ck: Checkpointer | None, state_at, opt, steps: int, every: int) -> tuple[int, float]:
    """Runs ``steps`` steps, saving every ``every`` (overlapped with ``opt``) when ``ck`` is given, then keeps
    stepping until the last save is durable; returns (steps run, seconds), the whole cost of the saves inside.
    """
    t0 = time.perf_counter()
    done = 0
    for s in range(steps):
        one_step()
        done += 1
        if ck is not None and s % every == 0:
            ck.save(state_at(s), s, overlap_with=opt)
    if ck is not None:
        drain_until = time.perf_counter() + 120.0  # a failed tier never turns durable: stop counting then
        while not ck.wait(timeout=0) and time.perf_counter() < drain_until:
            one_step()
            done += 1
    return done, time.perf_counter() - t0


def throughput(scratch: str, shm: str, steps: int = 40, every: int = 10) -> dict[str, float]:
    """Steps/s of a small MLP with no saves, saves every ``every`` steps (unthrottled, throttled).

    A run with saves keeps training (no more saves) until its last checkpoint is durable and counts those steps
    too: the persists run in the background, and a throttled one outlived the 40 timed steps, so its cost fell
    outside the window (the throttled run came out faster than no saves at all). The no-save baseline runs
    before and after the runs with saves, so a load change on the shared machine hits both sides.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 1024))  # ~8.4M params, ~100 MB with Adam
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 1024)

    def one_step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    def run(ck: Checkpointer | None) -> float:
        for _ in range(3):
            one_step()
        if ck is not None:
            ck.prepare({"model": model, "optim": opt})
        done, dt = timed_steps(one_step, ck, lambda s: {"model": model, "optim": opt, "step": s}, opt, steps,
                               every)
        if ck is not None:
            ck.close()
        return done / dt

    before = run(None)
    out: dict[str, float] = {}
    for name, bw in (("unthrottled", 0.0), ("throttled_100mib", 100.0)):
        d = os.path.join(scratch, f"tput-{name}")
        cfg = CheckpointConfig(directory=d, memory={"directory": shm}, disk={"keep": 1},
                               persist={"bandwidth_mib_s": bw})
        out[f"tput_save_every_{every}_{name}_steps_s"] = run(Checkpointer(cfg, job="tput"))
        shutil.rmtree(d, ignore_errors=True)
    after = run(None)
    return {"tput_no_save_steps_s": (before + after) / 2, **out}


def report(r: dict[str, float], gib: float) -> None:
    base = r["stall_torch_save_fsync_s"]

    def row(name: str, key: str, ref: str | None = None) -> None:
        v = r[key]
        extra = ""
        if ref:
            extra = f"   torch.save+fsync / this = {base / v:8.1f}x"
        print(f"  {name:<52} {v:9.3f} s{extra}")

    print(f"\n== stall per save ({gib:.2f} GiB) ==")
    row("torch.save + fsync (baseline)", "stall_torch_save_fsync_s")
    row("torch.distributed.checkpoint.async_save (default)", "stall_dcp_async_save_s", "x")
    row("copy floor (copy_ into preallocated buffers)", "stall_copy_floor_s", "x")
    row("trainguard save()", "stall_tg_save_s", "x")
    row("trainguard save(overlap_with=opt) + pre-hook wait", "stall_tg_overlap_s", "x")
    row("  effective: + slowdown of the overlapped compute", "stall_tg_overlap_effective_s", "x")
    print(f"  trainguard vs DCP async_save stall: {r['stall_dcp_async_save_s'] / r['stall_tg_save_s']:.1f}x lower "
          f"(overlapped: {r['stall_dcp_async_save_s'] / r['stall_tg_overlap_s']:.1f}x)")
    print(f"  trainguard save() / copy floor: {r['stall_tg_save_s'] / r['stall_copy_floor_s']:.2f}")
    print(f"  overlapped compute phase: {r['compute_phase_with_overlap_s']:.3f} s vs {r['compute_phase_alone_s']:.3f}"
          " s alone (the background copy competes for the 2 cores)")
    print(f"  one-time arena allocation + pre-fault: {r['tg_arena_first_touch_s']:.2f} s")
    print("\n== persist bandwidth ==")
    print(f"  raw fsync'ed write (baseline)   {r['raw_write_bw_gib_s']:.3f} GiB/s")
    print(f"  trainguard persist (checksum+shm manifest+write+fsync+commit) {r['tg_persist_bw_gib_s']:.3f} GiB/s"
          f" = {100 * r['tg_persist_bw_gib_s'] / r['raw_write_bw_gib_s']:.0f}% of raw")
    print(f"\n== restore (page cache dropped: {bool(r['page_cache_dropped'])}) ==")
    tl = r["restore_torch_load_cold_s"]
    for name, key in (("torch.load, cold (baseline)", "restore_torch_load_cold_s"),
                      ("torch.load, warm page cache", "restore_torch_load_warm_s"),
                      ("torch.distributed.checkpoint.load, cold", "restore_dcp_load_cold_s"),
                      ("trainguard from shared memory (verified, in place)", "restore_tg_shm_s"),
                      ("trainguard from local disk, cold", "restore_tg_disk_cold_s"),
                      ("trainguard from fsspec file://, cold", "restore_tg_fsspec_cold_s")):
        print(f"  {name:<52} {r[key]:8.3f} s   torch.load cold / this = {tl / r[key]:6.1f}x")
    if "tput_no_save_steps_s" in r:
        print("\n== training throughput (small CPU MLP, 2 cores, save every 10 steps, overlapped) ==")
        b = r["tput_no_save_steps_s"]
        for k, v in r.items():
            if k.startswith("tput_"):
                print(f"  {k:<52} {v:8.2f} steps/s  ({100 * v / b:5.1f}% of no-save)")


if __name__ == "__main__":
    sys.exit(main())
