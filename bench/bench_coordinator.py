"""Scale benchmark of the coordinator: thousands of simulated node agents over real gRPC.

What it measures, per cluster size (default 1k, 4k, 12.5k nodes; 12.5k nodes x 8 devices = 100k accelerators):

- **time to a complete rank table**: from the first RegisterNode until the *last* node has received START with
  the rank table. Nodes register in random order, all at once, then poll Heartbeat at the interval the
  coordinator tells them, exactly as the node agent does.
- **heartbeat throughput**: every node heartbeats once per ``--hb-period`` (default 1 s, jittered) for
  ``--hb-seconds``; reported as achieved heartbeats/s against the offered rate, with latency p50/p99.
- **coordinator CPU and memory**: CPU seconds (user+sys) of the coordinator process per phase, as % of one
  core, and its peak RSS.

Baseline, measured in the same run on the same machine with the same clients: a **no-op gRPC server** (a
Coordinator servicer whose Heartbeat returns an empty response) driven with the same offered load. The ratio
"coordinator / no-op" says how much of the gRPC transport's capacity the coordinator's own logic leaves.

Simulated agents are coroutines on ``grpc.aio`` channels in ``--client-procs`` processes (not a thread per
node); each process spreads its nodes over ``--channels`` HTTP/2 connections. The coordinator under test is
started as a separate process through :mod:`trainguard.recovery` (``CoordinatorServer(JobSpec(...))``), so
the bench works with whichever service is current, and talks only ``coordinator_pb2_grpc.CoordinatorStub``.

Usage::

    .venv/bin/python bench/bench_coordinator.py                     # 1000, 4000, 12500 nodes
    .venv/bin/python bench/bench_coordinator.py --nodes 1000 --hb-seconds 5 --store sqlite

Targets on a 2-core machine: rank table for 12.5k nodes < 10 s; 12.5k heartbeats/s sustained.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

JOB = "bench"


# ------------------------------------------------------------------------------------------------ servers
def _serve(kind: str, nodes: int, port_file: str, store: str, interval_s: float) -> None:
    """Runs a server until SIGTERM: the real coordinator, or the no-op baseline."""
    import grpc

    from trainguard.proto import coordinator_pb2, coordinator_pb2_grpc

    if kind == "noop":
        class Noop(coordinator_pb2_grpc.CoordinatorServicer):
            def Heartbeat(self, request, context):  # noqa: N802
                return coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_NONE,
                                                             interval_s=interval_s)

        from concurrent import futures
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Noop(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stop = server.stop
    else:
        from trainguard.recovery import service as svc

        spec_params = inspect.signature(svc.JobSpec).parameters
        spec_kw = {"job": JOB}
        for name, value in (("nnodes", nodes), ("heartbeat_interval_s", interval_s), ("max_restarts", 3),
                            ("lease_timeout_s", 120.0), ("store", store)):
            if name in spec_params:
                spec_kw[name] = value
        server_obj = svc.CoordinatorServer(svc.JobSpec(**spec_kw), listen="127.0.0.1:0").start()
        port = server_obj.port
        stop = server_obj.stop
    Path(port_file + ".tmp").write_text(str(port))
    os.replace(port_file + ".tmp", port_file)
    done = False

    def _term(*_: object) -> None:
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, _term)
    while not done:
        time.sleep(0.1)
    stop(0)


def _start_server(kind: str, nodes: int, store: str, interval_s: float, tmp: Path) -> tuple[subprocess.Popen, int]:
    port_file = str(tmp / f"{kind}-{nodes}.port")
    proc = subprocess.Popen([sys.executable, __file__, "--_serve", kind, "--nodes", str(nodes), "--_port-file",
                             port_file, "--_store-url", store, "--_interval", str(interval_s)])
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{kind} server did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, int(Path(port_file).read_text())


# ------------------------------------------------------------------------------------------------ clients
async def _client_main(target: str, ids: list[int], nodes_total: int, channels: int, hb_period: float,
                       hb_seconds: float, t_start: float, form: bool, form_timeout: float, out: mp.Queue) -> None:
    import grpc

    from trainguard.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in chans]
    leases: dict[int, str] = {}
    gens: dict[int, int] = {}
    started_at: dict[int, float] = {}
    errors = 0
    pods = max(1, nodes_total // 32)

    while time.time() < t_start:
        await asyncio.sleep(0.005)

    async def join(i: int) -> None:
        nonlocal errors
        stub = stubs[i % channels]
        info = common_pb2.NodeInfo(node_id=f"node-{i}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                                   topology=common_pb2.Topology(pod_id=f"pod-{i % pods}", node_index=i // pods,
                                                                host=f"host-{i}", device_count=8))
        free_port = 20000 + i % 40000
        while True:
            try:
                reg = await stub.RegisterNode(coordinator_pb2.RegisterNodeRequest(job=JOB, node=info,
                                                                                  free_port=free_port), timeout=120)
                break
            except grpc.aio.AioRpcError:
                errors += 1
                await asyncio.sleep(0.5)
        leases[i] = reg.lease_id
        while True:
            try:
                resp = await stub.Heartbeat(coordinator_pb2.NodeHeartbeatRequest(
                    job=JOB, node_id=info.node_id, lease_id=reg.lease_id, generation=-1, free_port=free_port),
                    timeout=120)
            except grpc.aio.AioRpcError:
                errors += 1
                await asyncio.sleep(0.5)
                continue
            if resp.command in (coordinator_pb2.NODE_COMMAND_START, coordinator_pb2.NODE_COMMAND_RESTART):
                started_at[i] = time.time()
                gens[i] = resp.rank_table.generation
                return
            await asyncio.sleep(resp.interval_s or 0.5)

    if form:
        # A cluster that cannot form in time is reported as such (formed_nodes < nodes), never waited on forever.
        pending = [asyncio.ensure_future(join(i)) for i in ids]
        _, late = await asyncio.wait(pending, timeout=form_timeout)
        for t in late:
            t.cancel()
    latencies: list[float] = []
    sent = 0
    t_hb0 = time.time() + 0.5

    async def beat(i: int) -> None:
        nonlocal sent, errors
        stub = stubs[i % channels]
        rng = random.Random(i)
        await asyncio.sleep(max(0.0, t_hb0 - time.time()) + rng.random() * hb_period)
        nid = f"node-{i}"
        nxt = time.time()
        end = t_hb0 + hb_seconds
        while nxt < end:
            t0 = time.perf_counter()
            try:
                await stub.Heartbeat(coordinator_pb2.NodeHeartbeatRequest(
                    job=JOB, node_id=nid, lease_id=leases.get(i, ""), generation=gens.get(i, -1),
                    workers_running=8, last_step=int(nxt)), timeout=30)
                latencies.append(time.perf_counter() - t0)
            except grpc.aio.AioRpcError:
                errors += 1
            sent += 1
            nxt += hb_period
            await asyncio.sleep(max(0.0, nxt - time.time()))

    t_a = time.time()
    await asyncio.gather(*(beat(i) for i in ids))
    t_b = time.time()
    for c in chans:
        await c.close()
    out.put({"started_at": list(started_at.values()), "latencies": latencies, "sent": sent, "errors": errors,
             "hb_window": (t_a, t_b)})


def _client_proc(*args: object) -> None:
    asyncio.run(_client_main(*args))  # type: ignore[arg-type]


def _drive(kind: str, target_port: int, server: psutil.Process, nodes: int, args: argparse.Namespace,
           form: bool) -> dict[str, float]:
    ids = list(range(nodes))
    random.Random(nodes).shuffle(ids)  # random registration order
    procs = args.client_procs
    chunks = [ids[k::procs] for k in range(procs)]
    q: mp.Queue = mp.Queue()
    t_start = time.time() + 1.0 + nodes / 20000  # let client processes import grpc first
    ps = [mp.Process(target=_client_proc, args=(f"127.0.0.1:{target_port}", c, nodes, args.channels, args.hb_period,
                                                 args.hb_seconds, t_start, form, args.form_timeout, q))
          for c in chunks]
    for p in ps:
        p.start()
    cpu0 = server.cpu_times()
    while time.time() < t_start:
        time.sleep(0.01)
    try:
        results = [q.get(timeout=args.form_timeout + 3 * args.hb_seconds + 120) for _ in ps]
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    cpu1 = server.cpu_times()
    started = [t for r in results for t in r["started_at"]]
    lat = sorted(x for r in results for x in r["latencies"])
    win = max(r["hb_window"][1] for r in results) - min(r["hb_window"][0] for r in results)
    form_s = (max(started) - t_start) if form and started else float("nan")
    hb_s = len(lat) / args.hb_seconds
    total_s = time.time() - t_start
    return {
        "nodes": nodes, "form_s": form_s, "formed_nodes": len(started), "hb_offered_per_s": nodes / args.hb_period,
        "hb_per_s": hb_s, "hb_p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
        "hb_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
        "errors": sum(r["errors"] for r in results), "window_s": win,
        "cpu_pct": 100 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / max(total_s, 1e-9),
        "rss_mib": server.memory_info().rss / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 4000, 12500], help="cluster sizes to run")
    ap.add_argument("--hb-period", type=float, default=1.0, help="seconds between heartbeats of one node")
    ap.add_argument("--hb-seconds", type=float, default=10.0, help="length of the heartbeat phase, seconds")
    ap.add_argument("--client-procs", type=int, default=2, help="processes running the simulated agents")
    ap.add_argument("--channels", type=int, default=32, help="gRPC connections per client process")
    ap.add_argument("--store", default="sqlite", choices=["memory", "sqlite", "file"],
                    help="coordinator store backend (a fresh temp one per size)")
    ap.add_argument("--form-timeout", type=float, default=300.0,
                    help="seconds the simulated nodes wait for their rank table before giving up")
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval the coordinator tells nodes")
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-op gRPC server baseline")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--_serve", help=argparse.SUPPRESS)
    ap.add_argument("--_port-file", help=argparse.SUPPRESS)
    ap.add_argument("--_interval", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--_store-url", default="memory://", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._serve:
        _serve(args._serve, args.nodes[0], args._port_file, args._store_url, args._interval)
        return 0
    mp.set_start_method("spawn")
    print(f"machine: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"{args.client_procs} client procs x {args.channels} channels; store={args.store}; "
          f"hb period {args.hb_period} s for {args.hb_seconds} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for n in args.nodes:
            store = {"memory": "memory://", "sqlite": f"sqlite://{tmp}/c{n}.db", "file": f"file://{tmp}/c{n}"}[args.store]
            proc, port = _start_server("coordinator", n, store, args.interval, tmp)
            try:
                row = _drive("coordinator", port, psutil.Process(proc.pid), n, args, form=True)
            finally:
                proc.terminate()
                proc.wait(30)
            if not args.no_baseline:
                proc, port = _start_server("noop", n, store, args.interval, tmp)
                try:
                    base = _drive("noop", port, psutil.Process(proc.pid), n, args, form=False)
                finally:
                    proc.terminate()
                    proc.wait(30)
                row["noop_hb_per_s"] = base["hb_per_s"]
                row["noop_cpu_pct"] = base["cpu_pct"]
            rows.append(row)
            r = row
            ratio = (f"  coordinator/no-op throughput {r['hb_per_s'] / r['noop_hb_per_s']:.2f}"
                     if "noop_hb_per_s" in r else "")
            print(f"{n:>6} nodes: rank table complete in {r['form_s']:.2f} s ({r['formed_nodes']} nodes)  "
                  f"heartbeats {r['hb_per_s']:.0f}/s of {r['hb_offered_per_s']:.0f}/s offered "
                  f"(p50 {r['hb_p50_ms']:.1f} ms, p99 {r['hb_p99_ms']:.1f} ms, errors {r['errors']})  "
                  f"coordinator CPU {r['cpu_pct']:.0f}% RSS {r['rss_mib']:.0f} MiB{ratio}", flush=True)
    print("\n| nodes | rank table (s) | heartbeats/s (offered) | p99 ms | coord CPU % | coord RSS MiB | no-op server hb/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['nodes']} | {r['form_s']:.2f} | {r['hb_per_s']:.0f} ({r['hb_offered_per_s']:.0f}) | "
              f"{r['hb_p99_ms']:.1f} | {r['cpu_pct']:.0f} | {r['rss_mib']:.0f} | "
              f"{r.get('noop_hb_per_s', float('nan')):.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
