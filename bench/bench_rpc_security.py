"""What securing the coordinator costs: heartbeat latency and throughput with TLS, mutual TLS and the job token.

One real coordinator per mode (memory store, one registered node), one client thread issuing ``Heartbeat`` calls
back to back over one channel, the same count per mode; modes are interleaved over ``--rounds`` so machine load
hits all of them alike. The baseline is the plaintext coordinator without a token, measured in the same run;
every other mode is reported as a ratio to it. Certificates are EC P-256 (made with the openssl command).

Usage::

    .venv/bin/python bench/bench_rpc_security.py --calls 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "agent"))

from agent_testutil import make_pki  # noqa: E402

from trainguard.agent.tls import TlsFiles  # noqa: E402
from trainguard.proto import common_pb2  # noqa: E402
from trainguard.proto import coordinator_pb2 as pb  # noqa: E402
from trainguard.proto import coordinator_pb2_grpc  # noqa: E402
from trainguard.recovery import CoordinatorServer, JobSpec  # noqa: E402
from trainguard.recovery.rpc_security import RpcSecurity  # noqa: E402

TOKEN = "b" * 64
MODES = ("plaintext", "token", "tls", "mtls", "mtls+token")


def _securities(pki) -> dict[str, tuple[RpcSecurity, RpcSecurity]]:
    srv_tls = TlsFiles(str(pki.server_cert), str(pki.server_key))
    srv_mtls = TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    cli_tls = TlsFiles(ca_file=str(pki.ca))
    cli_mtls = TlsFiles(str(pki.client_cert), str(pki.client_key), str(pki.ca))
    return {
        "plaintext": (RpcSecurity(), RpcSecurity()),
        "token": (RpcSecurity(token=TOKEN), RpcSecurity(token=TOKEN)),
        "tls": (RpcSecurity(srv_tls), RpcSecurity(cli_tls, server_name="localhost")),
        "mtls": (RpcSecurity(srv_mtls), RpcSecurity(cli_mtls, server_name="localhost")),
        "mtls+token": (RpcSecurity(srv_mtls, TOKEN), RpcSecurity(cli_mtls, TOKEN, server_name="localhost")),
    }


def run_mode(server_sec: RpcSecurity, client_sec: RpcSecurity, calls: int) -> list[float]:
    """Per-call latencies (s) of ``calls`` heartbeats against a fresh coordinator with these settings."""
    spec = JobSpec(job="bench", nnodes=1, heartbeat_interval_s=1.0, store="memory://")
    srv = CoordinatorServer(spec, security=server_sec).start()
    try:
        with client_sec.channel(srv.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            info = common_pb2.NodeInfo(node_id="n0", topology=common_pb2.Topology(host="n0", device_count=1))
            lease = stub.RegisterNode(pb.RegisterNodeRequest(job="bench", node=info, free_port=30000),
                                      timeout=10).lease_id
            req = pb.NodeHeartbeatRequest(job="bench", node_id="n0", lease_id=lease, generation=-1,
                                          free_port=30001)
            for _ in range(50):  # warm-up: connection, handshake, first generation
                stub.Heartbeat(req, timeout=10)
            req.generation = 1
            out = []
            for _ in range(calls):
                t0 = time.perf_counter()
                stub.Heartbeat(req, timeout=10)
                out.append(time.perf_counter() - t0)
            return out
    finally:
        srv.stop(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="heartbeats per mode and round (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = ap.parse_args()
    pki = make_pki(Path(tempfile.mkdtemp(prefix="tg-bench-pki-")))
    secs = _securities(pki)
    lat: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            lat[mode] += run_mode(*secs[mode], args.calls)
    base = statistics.median(lat["plaintext"])
    print(f"{'mode':<12} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9} {'p50 / plaintext':>16}")
    for mode in MODES:
        xs = sorted(lat[mode])
        p50, p99 = statistics.median(xs), xs[int(0.99 * (len(xs) - 1))]
        print(f"{mode:<12} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {len(xs) / sum(xs):9.0f} {p50 / base:15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
