"""Overhead of the node agent daemon: idle CPU, memory, and health-query latency under load.

Starts a real ``trainguard agent`` (every default detector, reading the real /sys, /proc and /dev) and, as the
named baseline measured in the same run, a bare Python gRPC server that serves only ``grpc.health.v1`` on a unix
socket (the least any gRPC health endpoint in Python costs). Then:

1. idle: CPU time over ``--idle-s`` seconds (in % of one core) and RSS, after a warm-up that lets every detector
   sample at least once; budget < 1 % of one core and < 100 MB;
2. load: an open-loop client sends ``GetHealth`` at ``--rate`` queries/s for ``--load-s`` seconds, over the unix
   socket and over TCP, and ``grpc.health.v1.Check`` to the baseline at the same rate. Latency is measured from
   each query's *scheduled* send time, so a stalled server cannot hide its backlog (no coordinated omission);
   budget p99 < 5 ms.

Usage: ``.venv/bin/python bench/bench_agent.py [--idle-s 20] [--rate 500] [--load-s 10] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainguard.proto import agent_pb2, agent_pb2_grpc

BASELINE_SERVER = r"""
import sys, signal, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
h = health.HealthServicer()
h.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
print("ready", flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
stop.wait()
server.stop(1).wait()
"""


def start_agent(tmp: Path) -> tuple[subprocess.Popen, int, int, str, socket.socket]:
    """Starts the agent with every default detector; returns (process, TCP port, metrics port, socket path,
    notify socket)."""
    config = tmp / "agent.toml"
    # Its own memory-tier root: the daemon holds the one it uses, and the default may be an installed daemon's.
    config.write_text('[metrics]\nlisten = "127.0.0.1:0"\n[log]\nformat = "journal"\n'
                      f'[memory_tier]\nroot = "{tmp / "shm"}"\n')
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify.sock"))
    notify.settimeout(60)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "NOTIFY_", "WATCHDOG_"))}
    env["NOTIFY_SOCKET"] = str(tmp / "notify.sock")
    env["WATCHDOG_USEC"] = "30000000"  # as the shipped unit: WatchdogSec=30s
    sock = str(tmp / "agent.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "agent", "--config", str(config), "--socket", sock,
         "--state-dir", str(tmp / "state"), "--grpc-listen", "127.0.0.1:0"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "agent.log", "wb"),
    )
    while True:
        try:
            msg = notify.recv(4096).decode()
        except socket.timeout:
            proc.kill()
            raise SystemExit(f"agent not ready within 60 s:\n{(tmp / 'agent.log').read_text()[-3000:]}") from None
        if "READY=1" in msg:
            port = int(re.search(r"tcp:(\d+)", msg).group(1))
            metrics = re.search(r"metrics on http://127.0.0.1:(\d+)/", (tmp / "agent.log").read_text())
            return proc, port, int(metrics.group(1)), sock, notify


def start_baseline(tmp: Path) -> tuple[subprocess.Popen, str]:
    sock = str(tmp / "baseline.sock")
    proc = subprocess.Popen([sys.executable, "-c", BASELINE_SERVER, sock], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, sock


def idle_usage(pids: dict[str, int], seconds: float) -> dict[str, dict[str, float]]:
    """CPU % of one core and RSS/USS in MB of each process over the same window."""
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    start = {name: p.cpu_times() for name, p in procs.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    out = {}
    for name, p in procs.items():
        end = p.cpu_times()
        busy = (end.user - start[name].user) + (end.system - start[name].system)
        mem = p.memory_full_info()
        out[name] = {"cpu_percent_of_one_core": 100.0 * busy / wall, "rss_mb": mem.rss / 2**20,
                     "uss_mb": mem.uss / 2**20, "threads": p.num_threads()}
    return out


def server_side_latency(text: str, method: str) -> dict[str, float]:
    """Share of calls the agent served within each histogram bucket (from its own /metrics)."""
    buckets = {}
    for line in text.splitlines():
        m = re.match(r'trainguard_grpc_request_duration_seconds_bucket\{le="([^"]+)",method="%s"\} (\S+)' % method,
                     line)
        if m:
            buckets[m.group(1)] = float(m.group(2))
    total = buckets.get("+Inf", 0.0)
    return {f"<= {float(le) * 1000:g} ms": n / total for le, n in buckets.items() if le != "+Inf" and total}


def open_loop(call, rate: float, seconds: float, threads: int = 4) -> dict[str, float]:
    """Issues ``call()`` at ``rate``/s for ``seconds``; latency from each scheduled send time, in ms."""
    n = int(rate * seconds)
    latencies: list[float] = [0.0] * n
    errors = [0]
    t0 = time.perf_counter() + 0.2

    def worker(k: int) -> None:
        for i in range(k, n, threads):
            scheduled = t0 + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                call()
            except grpc.RpcError:
                errors[0] += 1
            latencies[i] = (time.perf_counter() - scheduled) * 1000

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    achieved = n / (time.perf_counter() - t0)
    lat = sorted(latencies)
    pick = lambda q: lat[min(n - 1, int(q * n))]  # noqa: E731
    return {"queries": n, "errors": errors[0], "achieved_qps": achieved, "p50_ms": pick(0.50),
            "p99_ms": pick(0.99), "p999_ms": pick(0.999), "max_ms": lat[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=float, default=20.0, help="idle measurement window (s)")
    ap.add_argument("--warmup-s", type=float, default=12.0, help="time for every detector to sample first (s)")
    ap.add_argument("--rate", type=float, default=500.0, help="health queries per second")
    ap.add_argument("--load-s", type=float, default=10.0, help="load duration per target (s)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    agent, port, metrics_port, sock, notify = start_agent(tmp)
    base, base_sock = start_baseline(tmp)
    results: dict = {"cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    try:
        unix = grpc.insecure_channel(f"unix:{sock}")
        tcp = grpc.insecure_channel(f"127.0.0.1:{port}")
        bch = grpc.insecure_channel(f"unix:{base_sock}")
        get_unix = agent_pb2_grpc.NodeAgentStub(unix).GetHealth
        get_tcp = agent_pb2_grpc.NodeAgentStub(tcp).GetHealth
        check = health_pb2_grpc.HealthStub(bch).Check
        snapshot = get_unix(agent_pb2.GetHealthRequest(), timeout=5)
        results["detectors"] = {d.name: agent_pb2.DetectorState.Name(d.state) for d in snapshot.detectors}
        results["health_reply_bytes"] = snapshot.ByteSize()
        time.sleep(args.warmup_s)
        results["idle"] = idle_usage({"agent": agent.pid, "baseline": base.pid}, args.idle_s)

        req = agent_pb2.GetHealthRequest()
        hreq = health_pb2.HealthCheckRequest(service="")
        for call in (lambda: get_unix(req, timeout=1), lambda: check(hreq, timeout=1)):  # warm channels
            for _ in range(200):
                call()
        results["load"] = {}
        targets = [("GetHealth unix", agent.pid, lambda: get_unix(req, timeout=1)),
                   ("GetHealth tcp", agent.pid, lambda: get_tcp(req, timeout=1)),
                   ("baseline Check unix", base.pid, lambda: check(hreq, timeout=1))]
        for name, pid, call in targets:
            server = psutil.Process(pid)
            before = server.cpu_times()
            r = open_loop(call, args.rate, args.load_s)
            after = server.cpu_times()
            cpu_s = (after.user - before.user) + (after.system - before.system)
            r["server_cpu_ms_per_query"] = 1000 * cpu_s / r["queries"]
            results["load"][name] = r
        # Server-side latency as the agent's own histogram saw it (no client or scheduling delay).
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            results["server_side"] = server_side_latency(resp.read().decode(), "GetHealth")
        results["under_load"] = idle_usage({"agent": agent.pid}, 0.001)["agent"]["rss_mb"]
        for ch in (unix, tcp, bch):
            ch.close()
    finally:
        for p in (agent, base):
            p.terminate()
        for p in (agent, base):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        notify.close()
        shutil.rmtree(tmp, ignore_errors=True)

    a, b = results["idle"]["agent"], results["idle"]["baseline"]
    print(f"machine: {results['cores']} cores, 1-min load average {results['load_avg_1m']:.2f} (shared machine)")
    print(f"detectors ({len(results['detectors'])}): "
          + ", ".join(f"{k}={v.removeprefix('DETECTOR_STATE_').lower()}" for k, v in results["detectors"].items()))
    print(f"\nidle over {args.idle_s:g} s          agent     baseline (bare gRPC health server)   ratio   budget")
    cpu_ratio = (f"{a['cpu_percent_of_one_core'] / b['cpu_percent_of_one_core']:6.1f}x"
                 if b["cpu_percent_of_one_core"] >= 0.01 else "     -")
    print(f"CPU (% of one core)   {a['cpu_percent_of_one_core']:8.3f}  {b['cpu_percent_of_one_core']:8.3f}"
          f"{'':29}{cpu_ratio}   < 1 %")
    print(f"RSS (MB)              {a['rss_mb']:8.1f}  {b['rss_mb']:8.1f}{'':29}{a['rss_mb'] / b['rss_mb']:6.1f}x"
          f"   < 100 MB")
    print(f"USS (MB)              {a['uss_mb']:8.1f}  {b['uss_mb']:8.1f}")
    print(f"RSS after load (MB)   {results['under_load']:8.1f}")
    print(f"\nload at {args.rate:g} queries/s for {args.load_s:g} s (latency from scheduled send, ms)")
    print(f"{'target':<22}{'p50':>8}{'p99':>8}{'p99.9':>8}{'max':>8}{'qps':>8}{'errors':>8}"
          f"  server CPU ms/query   vs baseline p99")
    base_p99 = results["load"]["baseline Check unix"]["p99_ms"]
    for name, r in results["load"].items():
        print(f"{name:<22}{r['p50_ms']:8.2f}{r['p99_ms']:8.2f}{r['p999_ms']:8.2f}{r['max_ms']:8.2f}"
              f"{r['achieved_qps']:8.0f}{r['errors']:8d}{r['server_cpu_ms_per_query']:21.3f}"
              f"   {r['p99_ms'] / base_p99:5.2f}x")
    print("budget: p99 < 5 ms")
    print("GetHealth served by the agent within (its own histogram, both load runs): "
          + ", ".join(f"{k}: {v:.1%}" for k, v in results["server_side"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
