"""Scale benchmark of the coordinator over real gRPC, with simulated node agents that are not the bottleneck.

Per cluster size (default 1k, 4k and 12.5k nodes; 12.5k nodes x 8 devices = 100k accelerators), against a
real coordinator process (``CoordinatorServer(JobSpec(...))``, SQLite store by default) and then against the
**baseline**, a no-op gRPC server in its own process fed by the same clients (RegisterNode returns a lease,
Heartbeat a prebuilt START or NONE: the transport's cost alone):

1. **registration**: every node registers at once, in random order -> registrations/s and the server's CPU
   seconds per registration (a registration is acknowledged once its record is durable in the store);
2. **rank table delivery**: every node polls Heartbeat at the interval it is told until it gets START with the
   rank table -> the *formation time* of the table is phase 1 + phase 2 (first RegisterNode to last START);
3. **steady heartbeats**: every node heartbeats once per ``--hb-period`` (jittered) for ``--hb-seconds`` ->
   achieved heartbeats/s against the offered rate, latency p50/p99, and the server's CPU seconds per heartbeat;
4. **in process**: the coordinator's servicer called directly (no gRPC, one thread) with the same requests and
   store: its own CPU per registration, START and heartbeat, apart from the transport.

The main figures are the server's **CPU seconds per registration and per heartbeat** (``psutil`` user+system
time of the server process, all threads): they depend little on how loaded the machine is, unlike wall-clock
rates, and they give the cores a coordinator needs for N nodes at a given interval (N / interval x CPU per
heartbeat). The load average is printed before and after each size.

Clients: ``--client-procs`` processes, each one asyncio loop with ``--channels`` ``grpc.aio`` channels, every node
of the process a coroutine and ``--inflight`` calls in flight at once (dozens per channel; far more only makes
gRPC core shed calls with CANCELLED, on the no-op server too). Requests are serialized once
up front and sent as bytes through raw-bytes multi-callables; steady-phase responses are not parsed. That makes a
client call cost a few tens of microseconds of client CPU, so clients are not what limits the server.

Usage::

    .venv/bin/python bench/bench_coordinator.py                          # 1000, 4000, 12500 nodes
    .venv/bin/python bench/bench_coordinator.py --nodes 12500 --client-procs 4 --hb-seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

JOB = "bench"
SERVICE = "/trainguard.v1.Coordinator/"


# ------------------------------------------------------------------------------------------------ servers
def _serve(kind: str, nodes: int, port_file: str, store: str, interval_s: float) -> None:
    """Runs a server until SIGTERM: the real coordinator, or the no-op baseline."""
    if kind == "noop":
        from concurrent import futures

        import grpc

        from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc

        table = common_pb2.RankTable(job=JOB, generation=1, world_size=8 * nodes, master_addr="10.0.0.0",
                                     master_port=29500, node_count=nodes)
        table.nodes.add(node_id="node-0", group_rank=0, first_rank=0, local_world_size=8, address="10.0.0.0")
        start = pb.NodeHeartbeatResponse(command=pb.NODE_COMMAND_START, interval_s=interval_s,
                                         job_state=pb.JOB_STATE_RUNNING, rank_table=table)
        none = pb.NodeHeartbeatResponse(command=pb.NODE_COMMAND_NONE, interval_s=interval_s,
                                        job_state=pb.JOB_STATE_RUNNING)
        reg = pb.RegisterNodeResponse(generation=0, lease_id="0" * 32)

        class Noop(coordinator_pb2_grpc.CoordinatorServicer):
            def RegisterNode(self, request, context):  # noqa: N802
                return reg

            def Heartbeat(self, request, context):  # noqa: N802
                return start if request.generation < 0 else none

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=256))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Noop(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stop = server.stop
    else:
        from trainguard.recovery import service as svc

        spec = svc.JobSpec(job=JOB, nnodes=nodes, heartbeat_interval_s=interval_s, max_restarts=3,
                           lease_timeout_s=600.0, store=store, max_heartbeat_rate=1e9)
        server_obj = svc.CoordinatorServer(spec, listen="127.0.0.1:0").start()
        port, stop = server_obj.port, server_obj.stop
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
async def _client_main(target: str, ids: list[int], nodes_total: int, channels: int, inflight: int,
                       hb_period: float, hb_seconds: float, timeout: float, ctl: "mp.Queue", out: "mp.Queue") -> None:
    import grpc

    from trainguard.proto import common_pb2, coordinator_pb2 as pb

    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    register = [c.unary_unary(SERVICE + "RegisterNode", request_serializer=None, response_deserializer=None)
                for c in chans]
    heartbeat = [c.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)
                 for c in chans]
    pods = max(1, nodes_total // 32)
    reg_req: dict[int, bytes] = {}
    for i in ids:  # serialized once, up front: the clients' per-call cost is then the transport's alone
        info = common_pb2.NodeInfo(node_id=f"node-{i}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                                   topology=common_pb2.Topology(pod_id=f"pod-{i % pods}", node_index=i // pods,
                                                                host=f"host-{i}", device_count=8))
        reg_req[i] = pb.RegisterNodeRequest(job=JOB, node=info, free_port=20000 + i % 40000).SerializeToString()
    errors = 0
    codes: dict[str, int] = {}
    leases: dict[int, str] = {}
    gens: dict[int, int] = {}
    started_at: list[float] = []

    # Calls in flight per process: beyond a few thousand, gRPC core sheds the excess with CANCELLED
    # (grpc.max_pending_requests); a real agent fleet spreads its heartbeats over the interval instead.
    window = asyncio.Semaphore(inflight)

    async def call(fns: list, i: int, payload: bytes) -> bytes | None:
        nonlocal errors
        try:
            async with window:
                return await fns[i % channels](payload, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            errors += 1
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
            if os.environ.get("BENCH_DEBUG") and codes[exc.code().name] == 1:
                print("client error:", exc.code().name, exc.details(), exc.debug_error_string(), flush=True)
            return None

    async def join(i: int) -> None:
        while (raw := await call(register, i, reg_req[i])) is None:
            await asyncio.sleep(0.5)
        leases[i] = pb.RegisterNodeResponse.FromString(raw).lease_id

    async def until_start(i: int) -> None:
        req = pb.NodeHeartbeatRequest(job=JOB, node_id=f"node-{i}", lease_id=leases[i], generation=-1,
                                      free_port=20000 + i % 40000).SerializeToString()
        while True:
            raw = await call(heartbeat, i, req)
            if raw is not None:
                resp = pb.NodeHeartbeatResponse.FromString(raw)
                if resp.command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_RESTART):
                    started_at.append(time.time())
                    gens[i] = resp.rank_table.generation
                    return
                await asyncio.sleep(resp.interval_s or 0.5)
            else:
                await asyncio.sleep(0.5)

    latencies: list[float] = []

    async def beat(i: int, t0: float) -> None:
        rng = random.Random(i)
        req = pb.NodeHeartbeatRequest(job=JOB, node_id=f"node-{i}", lease_id=leases.get(i, ""),
                                      generation=gens.get(i, -1), workers_running=8, last_step=5).SerializeToString()
        await asyncio.sleep(max(0.0, t0 - time.time()) + rng.random() * hb_period)
        nxt, end = time.time(), t0 + hb_seconds
        while nxt < end:
            a = time.perf_counter()
            if await call(heartbeat, i, req) is not None:
                latencies.append(time.perf_counter() - a)
            nxt += hb_period
            await asyncio.sleep(max(0.0, nxt - time.time()))

    loop = asyncio.get_running_loop()
    for phase in ("register", "deliver", "steady"):
        go = await loop.run_in_executor(None, ctl.get)  # the driver starts each phase in every process at once
        while time.time() < go:
            await asyncio.sleep(0.002)
        t_a, e0 = time.time(), errors
        codes.clear()
        if phase == "register":
            await asyncio.gather(*(join(i) for i in ids))
        elif phase == "deliver":
            await asyncio.wait([asyncio.ensure_future(until_start(i)) for i in ids], timeout=timeout)
        else:
            await asyncio.gather(*(beat(i, go) for i in ids))
        out.put({"phase": phase, "t": (t_a, time.time()), "errors": errors - e0, "codes": dict(codes),
                 "started_at": list(started_at),
                 "latencies": latencies if phase == "steady" else []})
    for c in chans:
        await c.close()


def _client_proc(*args: object) -> None:
    asyncio.run(_client_main(*args))  # type: ignore[arg-type]


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _drive(target_port: int, server: psutil.Process, nodes: int, args: argparse.Namespace) -> dict[str, float]:
    ids = list(range(nodes))
    random.Random(nodes).shuffle(ids)  # random registration order
    chunks = [ids[k::args.client_procs] for k in range(args.client_procs)]
    out: mp.Queue = mp.Queue()
    ctls = [mp.Queue() for _ in chunks]
    ps = [mp.Process(target=_client_proc, args=(f"127.0.0.1:{target_port}", c, nodes, args.channels,
                                                 args.inflight, args.hb_period, args.hb_seconds, args.timeout, q, out))
          for c, q in zip(chunks, ctls)]
    for p in ps:
        p.start()
    row: dict[str, float] = {"nodes": nodes}
    try:
        time.sleep(2.0 + nodes / 5000)  # clients import grpc and serialize their requests
        for phase in ("register", "deliver", "steady"):
            go = time.time() + 0.3
            for q in ctls:
                q.put(go)
            while time.time() < go:
                time.sleep(0.001)
            cpu0 = _cpu(server)
            res = [out.get(timeout=args.timeout + args.hb_seconds + 120) for _ in ps]
            cpu1 = _cpu(server)
            end = max(r["t"][1] for r in res)
            row[f"{phase}_s"] = end - go
            row[f"{phase}_cpu_s"] = cpu1 - cpu0
            row[f"{phase}_errors"] = sum(r["errors"] for r in res)
            for r in res:
                for code, k in r["codes"].items():
                    row[f"error {code}"] = row.get(f"error {code}", 0) + k
            if phase == "deliver":
                started = [t for r in res for t in r["started_at"]]
                row["formed_nodes"] = len(started)
            if phase == "steady":
                lat = sorted(x for r in res for x in r["latencies"])
                row["hb_done"] = len(lat)
                row["hb_per_s"] = len(lat) / args.hb_seconds
                row["hb_p50_ms"] = 1000 * statistics.median(lat) if lat else float("nan")
                row["hb_p99_ms"] = 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan")
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    row["form_s"] = row["register_s"] + row["deliver_s"]
    row["cpu_ms_per_reg"] = 1000 * row["register_cpu_s"] / nodes
    row["cpu_us_per_hb"] = 1e6 * row["steady_cpu_s"] / max(row["hb_done"], 1)
    row["rss_mib"] = server.memory_info().rss / 2**20
    return row


class _Context:
    """The servicer-context calls the coordinator's service makes on success (none) and refusal (abort)."""

    def peer(self) -> str:
        return "in-process"

    def abort(self, code: object, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


def _in_process(nodes: int, store: str) -> dict[str, float]:
    """The coordinator's own cost without gRPC: its servicer called directly, single-threaded (CPU time).

    Same requests as the clients send (decoded messages in, messages out), same store, same job spec; the
    difference to the gRPC figures is the transport (and thread hand-offs), which the no-op server measures.
    """
    from trainguard.proto import common_pb2, coordinator_pb2 as pb
    from trainguard.recovery.service import CoordinatorService, JobSpec

    svc = CoordinatorService(JobSpec(job=JOB, nnodes=nodes, heartbeat_interval_s=1.0, max_restarts=3,
                                     lease_timeout_s=600.0, store=store, max_heartbeat_rate=1e9))
    pods = max(1, nodes // 32)
    ctx = _Context()
    regs = [pb.RegisterNodeRequest(job=JOB, free_port=20000 + i % 40000, node=common_pb2.NodeInfo(
        node_id=f"node-{i}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", topology=common_pb2.Topology(
            pod_id=f"pod-{i % pods}", node_index=i // pods, host=f"host-{i}", device_count=8))) for i in range(nodes)]
    t0 = time.process_time()
    leases = [svc.RegisterNode(r, ctx).lease_id for r in regs]
    t1 = time.process_time()
    for i in range(nodes):
        svc.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id=f"node-{i}", lease_id=leases[i], generation=-1), ctx)
    t2 = time.process_time()
    beats = [pb.NodeHeartbeatRequest(job=JOB, node_id=f"node-{i}", lease_id=leases[i], generation=1,
                                     workers_running=8, last_step=5) for i in range(nodes)]
    for _ in range(3):
        for b in beats:
            svc.Heartbeat(b, ctx)
    t3 = time.process_time()
    svc.core.close()
    return {"cpu_ms_per_reg": 1000 * (t1 - t0) / nodes, "cpu_us_per_start": 1e6 * (t2 - t1) / nodes,
            "cpu_us_per_hb": 1e6 * (t3 - t2) / (3 * nodes)}


def _load() -> str:
    a, b, c = os.getloadavg()
    return f"load {a:.1f}/{b:.1f}/{c:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 4000, 12500], help="cluster sizes to run")
    ap.add_argument("--hb-period", type=float, default=1.0, help="seconds between heartbeats of one node (1.0)")
    ap.add_argument("--hb-seconds", type=float, default=10.0, help="length of the steady phase, seconds (10)")
    ap.add_argument("--client-procs", type=int, default=max(2, min(8, (os.cpu_count() or 2) // 2)),
                    help="processes running the simulated agents (default: half the CPUs, 2..8)")
    ap.add_argument("--channels", type=int, default=8, help="gRPC connections per client process (8)")
    ap.add_argument("--inflight", type=int, default=256,
                    help="calls in flight at once per client process (256: 32 per channel with 8 channels)")
    ap.add_argument("--store", default="sqlite", choices=["memory", "sqlite", "file"],
                    help="coordinator store backend (a fresh temp one per size; default sqlite)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-phase limit, seconds (300)")
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval the coordinator tells nodes")
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
    print(f"machine: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, {_load()}; "
          f"{args.client_procs} client procs x {args.channels} channels, {args.inflight} calls in flight each; "
          f"store={args.store}; "
          f"heartbeat every {args.hb_period} s for {args.hb_seconds} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for n in args.nodes:
            store = {"memory": "memory://", "sqlite": f"sqlite://{tmp}/c{n}.db", "file": f"file://{tmp}/c{n}"}[
                args.store]
            row: dict[str, object] = {"load_before": _load()}
            for kind in ("coordinator", "noop"):
                proc, port = _start_server(kind, n, store, args.interval, tmp)
                try:
                    r = _drive(port, psutil.Process(proc.pid), n, args)
                finally:
                    proc.terminate()
                    proc.wait(30)
                row[kind] = r
            row["in_process"] = _in_process(n, store.replace(f"c{n}", f"c{n}-inproc"))
            row["load_after"] = _load()
            rows.append(row)
            c, b = row["coordinator"], row["noop"]
            print(f"\n{n} nodes ({row['load_before']} -> {row['load_after']}):", flush=True)
            for name, r in (("coordinator", c), ("no-op server", b)):
                print(f"  {name:>12}: formation {r['form_s']:.2f} s ({r['register_s']:.2f} s registering at "
                      f"{n / r['register_s']:.0f}/s + {r['deliver_s']:.2f} s delivering the table, "
                      f"{r['formed_nodes']} nodes); CPU {r['cpu_ms_per_reg']:.3f} ms/registration, "
                      f"{r['cpu_us_per_hb']:.0f} us/heartbeat; heartbeats {r['hb_per_s']:.0f}/s of "
                      f"{n / args.hb_period:.0f}/s offered (p50 {r['hb_p50_ms']:.1f} ms, p99 {r['hb_p99_ms']:.1f} "
                      f"ms); errors {r['register_errors'] + r['deliver_errors'] + r['steady_errors']:.0f} "
                      f"{ {k[6:]: v for k, v in r.items() if k.startswith('error ')} }; "
                      f"RSS {r['rss_mib']:.0f} MiB", flush=True)
            ip = row["in_process"]
            print(f"  {'in process':>12}: CPU {ip['cpu_ms_per_reg']:.3f} ms/registration (serial: one store commit "
                  f"each), {ip['cpu_us_per_start']:.0f} us/START, {ip['cpu_us_per_hb']:.0f} us/heartbeat: the "
                  f"coordinator's own logic; 12,500 heartbeats/s of it take {ip['cpu_us_per_hb'] * 0.0125:.2f} core",
                  flush=True)
            cores = c["cpu_us_per_hb"] * 1e-6 * 12500 / args.interval
            print(f"  coordinator / no-op: CPU per registration x{c['cpu_ms_per_reg'] / b['cpu_ms_per_reg']:.1f}, "
                  f"per heartbeat x{c['cpu_us_per_hb'] / b['cpu_us_per_hb']:.1f}; 12,500 nodes heartbeating every "
                  f"{args.interval:g} s would take {cores:.2f} core(s) of this machine", flush=True)
    print("\n| nodes | formation s (coord / no-op) | CPU ms per registration (coord / no-op / in process) | "
          "CPU us per heartbeat (coord / no-op / in process) | heartbeats/s (offered) | p99 ms | coord RSS MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        c, b, ip = row["coordinator"], row["noop"], row["in_process"]
        print(f"| {c['nodes']} | {c['form_s']:.2f} / {b['form_s']:.2f} | {c['cpu_ms_per_reg']:.3f} / "
              f"{b['cpu_ms_per_reg']:.3f} / {ip['cpu_ms_per_reg']:.3f} | {c['cpu_us_per_hb']:.0f} / "
              f"{b['cpu_us_per_hb']:.0f} / {ip['cpu_us_per_hb']:.0f} | {c['hb_per_s']:.0f} "
              f"({c['nodes'] / args.hb_period:.0f}) | {c['hb_p99_ms']:.1f} | {c['rss_mib']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
