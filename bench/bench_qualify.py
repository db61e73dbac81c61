"""Benchmark of the pre-flight node qualification: what the check costs a node before it takes a slot.

Setup: a fake sysfs tree shaped like an 8-GPU node (8 GPUs and 8 NICs on PCIe, the 8 NICs' netdevs at 400 Gb/s,
8 RDMA ports, in the kernel's formats, :mod:`trainguard.testing.sysfs`), the peer check's 1 MiB exchange with
three echo servers on loopback (the exchange's own cost; a data network adds its wire time), a real fsync'd disk
write of ``--disk-mib`` MiB into ``--dir``, and every built-in detector sampled once
on the real machine. Each round runs :func:`~trainguard.agent.qualify.runner.qualify_node` with every check.

Baseline, measured in the same run: a fresh interpreter importing torch (``python -c "import torch"``), the cost
every worker start already pays before its first step. Prints per-check medians, the total's median and p90, and
the total as a ratio of the baseline and of the default 5 s budget.

Run: ``.venv/bin/python bench/bench_qualify.py [--rounds 10] [--dir /data/ckpt]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from trainguard.agent.qualify import QualifySection
from trainguard.agent.qualify.base import QualifyContext
from trainguard.agent.echo_probe import EchoProbeServer
from trainguard.agent.qualify.peers import Peer, PeerSet
from trainguard.agent.qualify.runner import qualify_node
from trainguard.detectors.base import DEFAULT_DETECTORS
from trainguard.testing.sysfs import write_pci_device


def eight_gpu_node(root: str) -> None:
    """Writes 8 GPUs, 8 NICs (x16, 32 GT/s) and 8 active 400 Gb/s RDMA ports under ``root``."""
    write_pci_device(root, "0000:00:01.0", cls="0x060400")
    for i in range(8):
        write_pci_device(root, f"0000:{0x10 + i:02x}:00.0", above="0000:00:01.0")
        write_pci_device(root, f"0000:{0x30 + i:02x}:00.0", cls="0x020000", above="0000:00:01.0")
        net = os.path.join(root, f"sys/class/net/ens{i}f0np0")
        os.makedirs(net, exist_ok=True)
        for name, text in (("speed", "400000"), ("operstate", "up"), ("carrier", "1")):
            with open(os.path.join(net, name), "w") as f:
                f.write(text + "\n")
        port = os.path.join(root, f"sys/class/infiniband/mlx5_{i}/ports/1")
        os.makedirs(port, exist_ok=True)
        for name, text in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("rate", "400 Gb/sec (4X NDR)")):
            with open(os.path.join(port, name), "w") as f:
                f.write(text + "\n")


def main() -> int:
    """Runs the benchmark and prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk test writes (default: temp dir)")
    ap.add_argument("--disk-mib", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-bench-qualify-") as root:
        eight_gpu_node(root)
        section = QualifySection(root=root, net_root=root, nics=["ens*"], nic_speed_mbps=400000, disk_dir=args.dir,
                                 disk_mib=args.disk_mib, disk_min_mib_s=0.0, rdma_rate_gbps=400)
        section.validate()
        echoes = [EchoProbeServer("127.0.0.1") for _ in range(3)]  # three qualified peers (loopback: no wire)
        found = PeerSet(tuple(Peer(f"p{i}", "127.0.0.1", e.port) for i, e in enumerate(echoes)), 0.0, 0)
        ctx = QualifyContext("bench", section, detector_names=DEFAULT_DETECTORS, detector_root="/",
                             peer_source=lambda count: found)
        qualify_node(ctx)  # warm-up: imports of the detector modules, not a node's steady cost
        per_check: dict[str, list[float]] = {name: [] for name in section.checks}
        totals: list[float] = []
        verdict = None
        for _ in range(args.rounds):
            verdict = qualify_node(ctx)
            totals.append(verdict.duration_s)
            for r in verdict.results:
                per_check[r.name].append(r.duration_s)
        for e in echoes:
            e.close()
    base: list[float] = []
    for _ in range(max(3, args.rounds // 3)):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        base.append(time.monotonic() - t0)
    assert verdict is not None
    print(f"qualification of one node, {args.rounds} rounds (checks: {', '.join(section.checks)}):")
    for r in verdict.results:
        print(f"  {r.name:9} median {statistics.median(per_check[r.name]) * 1000:8.1f} ms   {r.status.value}: "
              f"{r.detail[:90]}")
    total = statistics.median(totals)
    p90 = sorted(totals)[max(0, int(len(totals) * 0.9) - 1)]
    baseline = statistics.median(base)
    print(f"  total     median {total * 1000:8.1f} ms, p90 {p90 * 1000:.1f} ms")
    print(f"baseline: fresh interpreter + import torch, median {baseline * 1000:.1f} ms")
    print(f"ratio qualification / baseline: {total / baseline:.2f}x; of the 5 s default budget: {total / 5.0:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
