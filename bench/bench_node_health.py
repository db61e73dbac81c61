"""Cost and speed of node daemons' health reports at a coordinator (``Coordinator.ReportNodeHealth``).

Two measurements against a real in-process coordinator served over gRPC on loopback (sqlite store):

1. **Capacity.** ``--nodes`` registered nodes; ``--clients`` threads send ``ReportNodeHealth`` (HEALTHY, the
   steady state between jobs) back to back for ``--seconds``; then the same threads send ``Heartbeat`` (what
   every node of a running job already sends) for as long. The heartbeat rate is the baseline measured in the
   same run; the ratio says what a continuous daemon report costs next to what the coordinator already handles.
2. **Fault to cordon.** A :class:`~trainguard.agent.coordinator_report.CoordinatorReporter` at the daemon's
   default interval (2 s) reports HEALTHY; a fatal AER event is fed to its latch (which pokes it) and the time
   until the coordinator's policy lists the node as cordoned is measured, ``--rounds`` times (a fresh node each).
   Baseline: the same without the poke, i.e. waiting for the next scheduled report (half the interval on
   average).

Usage: ``.venv/bin/python bench/bench_node_health.py [--nodes 200] [--clients 4] [--seconds 5] [--rounds 10]``
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import threading
import time

import grpc

from trainguard.agent.coordinator_report import CoordinatorReporter, NodeVerdictLatch, ReportTarget
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc
from trainguard.recovery.service import CoordinatorServer, JobSpec

JOB = "bench-nh"


def _register(stub, n: int) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        nid = f"n{i:05d}"
        info = common_pb2.NodeInfo(node_id=nid, address="127.0.0.1",
                                   topology=common_pb2.Topology(pod_id="p", node_index=i, host=nid, device_count=1))
        lease = stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=info, free_port=20000 + i), timeout=10).lease_id
        out.append((nid, lease))
    return out


def _hammer(call, make, nodes, clients: int, seconds: float) -> float:
    """Calls/s of ``clients`` threads calling ``call(make(node))`` round-robin for ``seconds``."""
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def loop(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            call(make(nodes[i % len(nodes)]), timeout=10)
            counts[k] += 1
            i += clients

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def capacity(target: str, nodes: list[tuple[str, str]], clients: int, seconds: float) -> dict:
    with grpc.insecure_channel(target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        reports = _hammer(stub.ReportNodeHealth, lambda n: pb.NodeHealthReportRequest(
            job=JOB, node_id=n[0], host=n[0], verdict=pb.NODE_HEALTH_VERDICT_HEALTHY, risk=0.01), nodes, clients,
            seconds)
        beats = _hammer(stub.Heartbeat, lambda n: pb.NodeHeartbeatRequest(
            job=JOB, node_id=n[0], lease_id=n[1], generation=-1, free_port=30000), nodes, clients, seconds)
    return {"reports_per_s": round(reports), "heartbeats_per_s": round(beats),
            "report_cost_vs_heartbeat": round(beats / reports, 3)}


def fault_to_cordon(server: CoordinatorServer, rounds: int, poke: bool) -> list[float]:
    took = []
    for r in range(rounds):
        latch = NodeVerdictLatch()
        node = f"f{'p' if poke else 'w'}{r}"
        rep = CoordinatorReporter(ReportTarget(server.target, job=JOB), latch.verdict, node, node, "bench",
                                  interval_s=2.0).start()
        try:
            while rep.reports == 0:
                time.sleep(0.01)
            time.sleep(0.3 + 1.7 * (r / max(rounds - 1, 1)))  # faults at spread phases of the report interval
            ev = HealthEvent(source="pcie", kind="pcie.aer_fatal", severity=Severity.CRITICAL,
                             action=Action.DRAIN_NODE, message="PCIe device 0000:3b:00.0: 1 new fatal error")
            t0 = time.monotonic()
            if latch.observe(ev) and poke:
                rep.poke()
            while node not in server.core.state.cordoned:
                time.sleep(0.0005)
            took.append(time.monotonic() - t0)
        finally:
            rep.stop()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # every cordon is logged as a warning: not what is measured
    with tempfile.TemporaryDirectory() as tmp:
        spec = JobSpec(job=JOB, nnodes=args.nodes + 10_000, heartbeat_interval_s=1.0, lease_timeout_s=600,
                       store=f"sqlite://{tmp}/c.db")  # never forms: every node stays a registered member
        server = CoordinatorServer(spec, max_workers=32).start()
        try:
            with grpc.insecure_channel(server.target) as ch:
                nodes = _register(coordinator_pb2_grpc.CoordinatorStub(ch), args.nodes)
            cap = capacity(server.target, nodes, args.clients, args.seconds)
            poked = fault_to_cordon(server, args.rounds, poke=True)
            waited = fault_to_cordon(server, args.rounds, poke=False)
        finally:
            server.stop(0)
    result = {**cap, "fault_to_cordon_ms_median": round(1000 * statistics.median(poked), 1),
              "fault_to_cordon_ms_max": round(1000 * max(poked), 1),
              "next_report_baseline_ms_median": round(1000 * statistics.median(waited), 1),
              "speedup_vs_next_report": round(statistics.median(waited) / statistics.median(poked), 1)}
    for k, v in result.items():
        print(f"{k:34s} {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
