"""Benchmarks of the node detectors.

1. **Link-down latency.** A network namespace with a veth pair; the RoCE detector runs in a DetectorRunner and
   listens to netlink. Each round runs ``ip link set <if> down`` and measures the time until the
   ``net.link_down`` event reaches ``on_event``. Baseline, in the same run: a bare pyroute2 socket bound to
   RTMGRP_LINK receiving the same kernel notification. Target: under 100 ms.
2. **Overhead.** In a separate process: every built-in detector on (process watching 8 real worker processes,
   roce watching the veth pair, kmsg on /dev/kmsg, disk on /), ``latest_metrics()`` read every 5 s as the
   predictor does. Reports the process's CPU time over the run as % of one core, and its RSS. Baseline: the same
   process before the runner starts (interpreter plus imports). Targets: < 1% of one core, < 100 MB.

Run as root: ``.venv/bin/python bench/bench_detectors.py [--rounds 20] [--seconds 60]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid


def ip(*args: str) -> None:
    """Runs ``ip ARGS``, raising on failure."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Netns:
    """A namespace holding an up veth pair, deleted on exit."""

    def __enter__(self) -> "Netns":
        self.name = f"tgbench-{uuid.uuid4().hex[:8]}"
        ip("netns", "add", self.name)
        try:
            ip("-n", self.name, "link", "add", "tgba", "type", "veth", "peer", "name", "tgbb")
            ip("-n", self.name, "link", "set", "tgba", "up")
            ip("-n", self.name, "link", "set", "tgbb", "up")
        except Exception:
            ip("netns", "del", self.name)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, timeout=10)


def bench_latency(rounds: int) -> dict[str, float]:
    """Measures link-down -> event latency of the detector and of a bare netlink socket.

    Args:
        rounds: down/up cycles per method (ip command, in-process request).

    Returns:
        Percentiles in milliseconds.
    """
    from pyroute2.netlink.rtnl import RTMGRP_LINK

    from trainguard.detectors.netlink import open_iproute
    from trainguard.detectors.roce import RoceConfig, RoceDetector
    from trainguard.detectors.runner import DetectorRunner

    with Netns() as ns:
        got = threading.Event()
        arrival: dict[str, float] = {}

        def on_event(ev) -> None:
            if ev.kind in ("net.link_down", "net.link_up") and ev.subject == "tgba":
                arrival["detector"] = time.time()
                got.set()

        raw_seen = threading.Event()
        raw_ready = threading.Event()
        holder: dict = {}

        def raw_loop() -> None:
            # pyroute2 0.9 sockets keep per-thread queues: open, bind and read in the same thread.
            raw = holder["raw"] = open_iproute(ns.name)
            raw.bind(groups=RTMGRP_LINK)
            raw_ready.set()
            while True:
                msgs = raw.get()
                if not msgs:
                    return
                for m in msgs:
                    if m.get_attr("IFLA_IFNAME") == "tgba" and "raw" not in arrival:
                        arrival["raw"] = time.time()
                        raw_seen.set()

        t_raw = threading.Thread(target=raw_loop, daemon=True)
        t_raw.start()
        if not raw_ready.wait(30):
            raise RuntimeError("the baseline netlink socket did not start")
        det = RoceDetector(RoceConfig(netns=ns.name, interfaces=("tgb*",), ethtool=False, flap_threshold=10**6))
        runner = DetectorRunner([det], on_event=on_event)
        runner.start()
        try:
            if not det.wait_ready(30):
                raise RuntimeError("the netlink listener did not start")
            det_lat, raw_lat, ip_cmd, direct = [], [], [], []
            setter = open_iproute(ns.name)
            index = setter.link_lookup(ifname="tgba")[0]
            for i in range(rounds * 4):
                state = "down" if i % 2 == 0 else "up"
                use_ip = i < rounds * 2  # first half: the ip command; second half: an in-process netlink request
                got.clear()
                raw_seen.clear()
                arrival.clear()
                t0 = time.time()
                if use_ip:
                    ip("-n", ns.name, "link", "set", "tgba", state)
                else:
                    setter.link("set", index=index, state=state)
                t1 = time.time()
                if not got.wait(5) or not raw_seen.wait(5):
                    raise RuntimeError(f"no event for link {state} within 5 s")
                if state == "down" and use_ip:
                    det_lat.append(arrival["detector"] - t0)
                    raw_lat.append(arrival["raw"] - t0)
                    ip_cmd.append(t1 - t0)
                elif state == "down":
                    direct.append(arrival["detector"] - t0)
            setter.close()
        finally:
            runner.stop()
            holder["raw"].close()
            t_raw.join(5)

    def ms(values: list[float], q: float) -> float:
        ordered = sorted(values)  # nearest-rank percentile: an observed value, never an extrapolation
        return 1000 * ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]

    return {
        "rounds": float(rounds),
        "detector_p50_ms": 1000 * statistics.median(det_lat),
        "detector_p95_ms": ms(det_lat, 95),
        "detector_max_ms": 1000 * max(det_lat),
        "raw_netlink_p50_ms": 1000 * statistics.median(raw_lat),
        "raw_netlink_p95_ms": ms(raw_lat, 95),
        "ip_command_p50_ms": 1000 * statistics.median(ip_cmd),
        "direct_p50_ms": 1000 * statistics.median(direct),
        "direct_p95_ms": ms(direct, 95),
    }


WORKER = "import time\nwhile True: time.sleep(3600)\n"


def overhead_child(seconds: float, netns: str) -> None:
    """Runs in a separate process: all detectors on, prints a JSON line with CPU and RSS figures."""
    import resource

    import psutil

    from trainguard.detectors.settings import DetectorSettings
    from trainguard.detectors.process import WorkerSnapshot
    from trainguard.detectors.runner import DetectorRunner

    me = psutil.Process()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER]) for _ in range(8)]
    try:
        class View:
            def __init__(self) -> None:
                self.t0 = time.monotonic()

            def workers(self):
                now = time.monotonic()
                # Workers stepping every 0.5 s: heartbeats are fresh, so no hang is reported.
                return [WorkerSnapshot(rank=i, pid=p.pid, started_at=self.t0, last_step=int(now - self.t0) * 2,
                                       last_heartbeat=now - 0.1, recent_step_times=(0.5,) * 20)
                        for i, p in enumerate(procs)]

        table: dict = {"roce": {"netns": netns, "interfaces": ["tgb*"]}} if netns else {}
        cfg = DetectorSettings.from_table(table, source="bench")
        baseline_rss = me.memory_info().rss
        events: list = []
        runner = DetectorRunner(cfg.create(worker_view=View()), on_event=events.append)
        # Idle baseline in the same process: the interpreter sleeping for the warm-up period.
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(3)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        idle_cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        runner.start()
        time.sleep(5)  # warm-up: first samples open devices, NVML, netlink
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = time.monotonic()
        deadline = w0 + seconds
        peak = me.memory_info().rss
        while time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
            runner.latest_metrics()  # what the predictor does every ~5 s
            peak = max(peak, me.memory_info().rss)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.monotonic() - w0
        final_rss = me.memory_info().rss
        peak = max(peak, final_rss)
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        statuses = {s.name: (s.state.label, s.samples, round(s.sample_s * 1000, 3)) for s in runner.statuses()}
        runner.stop()
        print(json.dumps({
            "wall_s": wall, "cpu_s": cpu, "cpu_pct_one_core": 100 * cpu / wall,
            "idle_cpu_pct_one_core": 100 * idle_cpu / 3,
            "rss_mb": final_rss / 2**20, "peak_rss_mb": peak / 2**20,
            "baseline_rss_mb": baseline_rss / 2**20, "detectors": statuses,
            "events": sorted({e.kind for e in events}),
        }))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def bench_overhead(seconds: float, netns: str) -> dict:
    """Runs :func:`overhead_child` in a fresh interpreter and returns its figures.

    Args:
        seconds: measurement window.
        netns: namespace whose veth pair the roce detector watches ("" for none).

    Returns:
        The child's JSON figures.
    """
    out = subprocess.run([sys.executable, __file__, "--child", str(seconds), "--netns", netns],
                         capture_output=True, text=True, timeout=seconds + 120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    """Runs both benchmarks and prints the figures.

    Returns:
        Exit code.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="link down/up rounds (default 20)")
    parser.add_argument("--seconds", type=float, default=60.0, help="overhead measurement window (default 60)")
    parser.add_argument("--child", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--netns", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        overhead_child(args.child, args.netns)
        return 0
    if os.geteuid() != 0:
        print("bench_detectors needs root (network namespaces)", file=sys.stderr)
        return 2
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    lat = bench_latency(args.rounds)
    print(f"link down -> event, {args.rounds} rounds (ip command spawn included; ip itself takes "
          f"{lat['ip_command_p50_ms']:.1f} ms p50):")
    print(f"  raw pyroute2 socket (baseline): p50 {lat['raw_netlink_p50_ms']:.1f} ms  p95 "
          f"{lat['raw_netlink_p95_ms']:.1f} ms")
    print(f"  trainguard roce detector      : p50 {lat['detector_p50_ms']:.1f} ms  p95 {lat['detector_p95_ms']:.1f} ms"
          f"  max {lat['detector_max_ms']:.1f} ms  (target < 100 ms)")
    print(f"  ratio detector / baseline p50 : {lat['detector_p50_ms'] / lat['raw_netlink_p50_ms']:.2f}x")
    print(f"  without the ip process spawn (in-process RTM_NEWLINK request -> event): p50 "
          f"{lat['direct_p50_ms']:.2f} ms  p95 {lat['direct_p95_ms']:.2f} ms")
    with Netns() as ns:
        ov = bench_overhead(args.seconds, ns.name)
    print(f"\nall detectors on, separate process, {ov['wall_s']:.0f} s window, 8 workers watched:")
    print(f"  CPU: {ov['cpu_pct_one_core']:.3f}% of one core (idle interpreter baseline "
          f"{ov['idle_cpu_pct_one_core']:.3f}%; target < 1%)")
    print(f"  RSS: {ov['rss_mb']:.1f} MB, peak {ov['peak_rss_mb']:.1f} MB (interpreter with imports before the "
          f"runner: {ov['baseline_rss_mb']:.1f} MB, ratio {ov['peak_rss_mb'] / ov['baseline_rss_mb']:.2f}x; "
          f"target < 100 MB)")
    print("  per detector (state, samples, last sample ms):")
    for name, (state, n, ms) in ov["detectors"].items():
        print(f"    {name:<8} {state:<12} {n:>5} {ms:>8.3f}")
    print(f"  event kinds seen: {ov['events']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
