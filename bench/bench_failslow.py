"""Fail-slow benchmark: hook overhead, straggler detection and mitigation, healthy-run false alarms, hang
localisation accuracy, each against its baseline measured in the same run.

    python bench/bench_failslow.py overhead [--blocks 40]        # sections + step_done vs a bare loop
    python bench/bench_failslow.py drills [--soak-s 120] [--hang-rounds 3] [--out FILE]
    python bench/bench_failslow.py link [--link-rate 40mbit] [--out FILE]   # healthy links, then one capped
    python bench/bench_failslow.py lock [--ranks 16384] [--ranks-per-node 8] [--windows 4]

``lock`` drives a real :class:`~trainguard.recovery.coordinator.JobCoordinator` (in process, simulated clock,
memory store) with the heartbeats of ``--ranks`` ranks and times how long each call holds the coordinator's
lock: the window-closing heartbeat with scoring inside the lock (before; the same class with the whole call
under its lock) against scoring after it (now), plus the scoring time itself (still paid, off the lock).

``overhead`` runs one worker under ``trainguard run`` (a real agent receiving every heartbeat). The worker
alternates blocks of 20 steps of a small MLP: bare (no hook call at all) and hooked (five ``session.section``
blocks and ``session.step_done``, whose heartbeat carries the sections to the agent). Blocks interleave so load
changes on this shared machine hit both alike; it prints the median wall and CPU time per step of each and the
overhead in percent.

``drills`` runs, with real injection (:mod:`trainguard.drill.failslow`):
- a healthy soak of ``--soak-s`` seconds with two CPU burners as background load: false alarms counted;
- the single-node straggler drill (2 workers, one capped at 0.1 CPU by a cgroup v1 quota; action report):
  detection time, step time healthy / under the straggler (the no-detection baseline runs at that pace);
- the replace drill (2 nodes + a warm spare, action replace): step time before, under, after replacement;
- the hang drill (3 ranks, rank 2 hangs in its data loader in ``--hang-rounds`` generations in a row):
  localisation accuracy;
- the slow-link drill (3 nodes + a spare in network namespaces, n1's data veth capped with ``tbf`` at
  ``--link-rate``; action replace): time until the link probes name n1, step time healthy / slow link /
  after the replacement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from trainguard.hook import HEARTBEAT_MIN_INTERVAL_S  # noqa: E402


def _worker_overhead(blocks: int, out: str) -> None:
    """Worker side of ``overhead`` (runs under ``trainguard run``)."""
    import torch
    from torch import nn

    import trainguard

    torch.set_num_threads(1)
    # A small model: ~1.3 M parameters, a few ms per step on one core.
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    session = trainguard.init()

    def step_bare() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def step_hooked(i: int) -> None:
        with session.section("data"):
            xb, yb = x, y
        with session.section("forward"):
            loss = nn.functional.cross_entropy(model(xb), yb)
        with session.section("backward"):
            opt.zero_grad()
            loss.backward()
        with session.section("comm"):
            pass
        with session.section("optim"):
            opt.step()
        session.step_done(i)

    def step_heartbeat(i: int) -> None:
        step_bare()
        session.step_done(i)

    res: dict[str, list[tuple[float, float]]] = {"bare": [], "heartbeat": [], "hooked": []}
    i = 0
    for _ in range(5):  # warm-up
        step_bare()
        step_hooked(i)
        i += 1
    kinds = ("bare", "heartbeat", "hooked")
    # CPU of whole blocks: the heartbeat RPC runs on the hook's thread every 250 ms, i.e. in about one step of
    # 50, so a median of per-step CPU never saw it; block totals (all threads, every step) count it.
    cpu_total = {k: 0.0 for k in kinds}
    for b in range(blocks):
        for kind in kinds[b % 3:] + kinds[:b % 3]:
            block_c0 = time.process_time()
            for _ in range(20):
                w0, c0 = time.perf_counter(), time.process_time()
                if kind == "bare":
                    step_bare()
                elif kind == "heartbeat":
                    step_heartbeat(i)
                    i += 1
                else:
                    step_hooked(i)
                    i += 1
                res[kind].append((time.perf_counter() - w0, time.process_time() - c0))
            cpu_total[kind] += time.process_time() - block_c0
    res["cpu_total_s"] = cpu_total  # type: ignore[assignment]
    res["heartbeats_sent"] = session._agent.sent if session._agent is not None else 0  # type: ignore[assignment]
    res["steps_reported"] = i  # type: ignore[assignment]
    session.close()
    with open(out, "w") as f:
        json.dump(res, f)


def overhead(blocks: int) -> dict:
    """Runs the overhead worker under ``trainguard run`` and summarises it."""
    with tempfile.TemporaryDirectory(prefix="tg-bench-fs-") as tmp:
        out = os.path.join(tmp, "res.json")
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", "--no-standby", __file__,
               "_worker", "--blocks", str(blocks), "--out", out]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=600)
        with open(out) as f:
            res = json.load(f)
    doc = summarise_overhead(res)
    print(f"hook overhead ({doc['bare']['steps']} steps each, interleaved blocks of 20; {doc['heartbeats_sent']} "
          f"heartbeats for {doc['steps_reported']} reported steps; wall: median step, CPU: mean step, every "
          "thread):")
    print(f"  bare step        {doc['bare']['wall_ms']:.3f} ms wall, {doc['bare']['cpu_ms']:.3f} ms CPU")
    print(f"  step_done only   {doc['heartbeat']['wall_ms']:.3f} ms wall, {doc['heartbeat']['cpu_ms']:.3f} ms CPU "
          f"({doc['heartbeat_overhead_wall_pct']:+.2f}% wall, {doc['heartbeat_overhead_cpu_pct']:+.2f}% CPU; "
          f"heartbeats at most every {1000 * HEARTBEAT_MIN_INTERVAL_S:.0f} ms)")
    print(f"  5 sections + step_done {doc['hooked']['wall_ms']:.3f} ms wall, {doc['hooked']['cpu_ms']:.3f} ms CPU "
          f"({doc['hooked_overhead_wall_pct']:+.2f}% wall, {doc['hooked_overhead_cpu_pct']:+.2f}% CPU vs bare; "
          f"{doc['sections_over_heartbeat_cpu_pct']:+.2f}% CPU vs step_done only)")
    print(f"  one heartbeat RPC costs the worker ~{doc['cpu_us_per_heartbeat']:.0f} us of CPU (noise when negative)")
    return doc


def summarise_overhead(res: dict) -> dict:
    """The overhead figures from the worker's per-step (wall, CPU) samples and per-kind CPU totals.

    Wall time is the median step (robust to the shared machine's load); CPU is the mean step from whole-block
    totals, so the heartbeat thread's RPC, paid in one step of ~50, is counted (a per-step median dropped it).
    """
    doc = {"heartbeats_sent": res.pop("heartbeats_sent"), "steps_reported": res.pop("steps_reported")}
    cpu_total = res.pop("cpu_total_s")
    for kind, vals in res.items():
        doc[kind] = {"wall_ms": statistics.median(v[0] for v in vals) * 1000,
                     "cpu_ms": cpu_total[kind] / len(vals) * 1000,
                     "cpu_median_ms": statistics.median(v[1] for v in vals) * 1000, "steps": len(vals)}
    for kind in ("heartbeat", "hooked"):
        doc[f"{kind}_overhead_wall_pct"] = 100 * (doc[kind]["wall_ms"] / doc["bare"]["wall_ms"] - 1)
        doc[f"{kind}_overhead_cpu_pct"] = 100 * (doc[kind]["cpu_ms"] / doc["bare"]["cpu_ms"] - 1)
    doc["sections_over_heartbeat_cpu_pct"] = 100 * (doc["hooked"]["cpu_ms"] / doc["heartbeat"]["cpu_ms"] - 1)
    hooked_steps = doc["steps_reported"]
    doc["cpu_us_per_heartbeat"] = 1000 * (doc["heartbeat"]["cpu_ms"] - doc["bare"]["cpu_ms"]) * hooked_steps / \
        max(1, doc["heartbeats_sent"])
    return doc


def _burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    sum(range(10000)); "
                              "time.sleep(0.002)"]) for _ in range(n)]


def drills(soak_s: float, hang_rounds: int, link_rate: str) -> dict:
    """Runs the drills (see the module docstring) and prints the table."""
    from trainguard.drill.failslow import HangDrillConfig, StragglerDrillConfig, run_hang_drill, run_straggler_drill

    doc: dict = {}
    burners = _burners(2)
    try:
        soak = run_straggler_drill(StragglerDrillConfig(nproc=2, healthy_s=soak_s, after_s=2), progress=print)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    doc["healthy_soak"] = {"seconds": soak_s, "status_polls": soak.status_polls_healthy,
                           "false_alarms": soak.false_alarms, "background": "2 CPU burners on 2 shared cores"}
    doc["straggler_report"] = {"detected": soak.detected, "detection_s": soak.detection_s,
                               "step_healthy_s": soak.step_healthy_s, "step_straggler_s": soak.step_slow_s,
                               "ratio_listed": soak.slow_listed[0]["ratio"] if soak.slow_listed else None}
    rep = run_straggler_drill(StragglerDrillConfig(nodes=2, nproc=1, spare=True, action="replace", healthy_s=10,
                                                   after_s=10), progress=print)
    doc["straggler_replace"] = {"detected": rep.detected, "detection_s": rep.detection_s, "replaced": rep.replaced,
                                "replacement_after_detection_s": rep.replacement_s,
                                "step_healthy_s": rep.step_healthy_s, "step_straggler_s": rep.step_slow_s,
                                "step_after_s": rep.step_after_s, "false_alarms": rep.false_alarms}
    hang = run_hang_drill(HangDrillConfig(nproc=3, rounds=hang_rounds), progress=print)
    doc["hang"] = {"rounds": hang_rounds, "localised": len(hang.findings), "correct": hang.correct,
                   "accuracy": hang.accuracy,
                   "findings": [{k: f.get(k) for k in ("generation", "outlier_ranks", "outlier_frame",
                                                       "majority_frame", "groups")} for f in hang.findings]}
    link = None
    if link_rate:
        doc["link"], link = link_drill(link_rate)
    print()
    print(f"healthy soak {soak_s:.0f} s under background load: {soak.false_alarms} false alarm(s) in "
          f"{soak.status_polls_healthy} status polls")
    print(f"straggler (1 node, 2 ranks, rank 1 at 0.1 CPU): detected {soak.detected} in "
          f"{soak.detection_s or 0:.1f} s; step {1000 * (soak.step_healthy_s or 0):.0f} ms healthy -> "
          f"{1000 * (soak.step_slow_s or 0):.0f} ms at the straggler's pace (no-detection baseline)")
    print(f"replace (2 nodes + spare): detected in {rep.detection_s or 0:.1f} s, replaced {rep.replaced} "
          f"({rep.replacement_s or 0:.1f} s later); step {1000 * (rep.step_healthy_s or 0):.0f} ms healthy, "
          f"{1000 * (rep.step_slow_s or 0):.0f} ms straggling (baseline), {1000 * (rep.step_after_s or 0):.0f} ms "
          f"after replacement")
    print(f"hang localisation: {hang.correct}/{len(hang.findings)} rounds named the hung rank "
          f"({hang_rounds} injected)")
    if link is not None:
        _print_link(doc["link"])
    return doc


class _TimedLock:
    """An RLock that records how long each outermost hold lasted (seconds)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.RLock()
        self._depth = 0
        self._t0 = 0.0
        self.holds: list[float] = []

    def acquire(self, *a, **kw) -> bool:
        ok = self._lock.acquire(*a, **kw)
        if ok:
            self._depth += 1
            if self._depth == 1:
                self._t0 = time.perf_counter()
        return ok

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.holds.append(time.perf_counter() - self._t0)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()


def link_drill(link_rate: str) -> tuple[dict, object]:
    """The slow-link drill: 3 nodes + a warm spare in network namespaces, n1's data veth capped with tbf at
    ``link_rate``, action replace. Returns (figures, the drill's result)."""
    from trainguard.drill.failslow import StragglerDrillConfig, run_straggler_drill

    link = run_straggler_drill(StragglerDrillConfig(nodes=3, nproc=1, netns=True, link_rate=link_rate,
                                                    throttle_rank=1, spare=True, action="replace", healthy_s=8,
                                                    after_s=8, detect_timeout_s=120), progress=print)
    return {"rate": link_rate, "detected": link.detected, "named": link.named_node,
            "detection_s": link.detection_s, "replaced": link.replaced,
            "replacement_after_detection_s": link.replacement_s, "step_healthy_s": link.step_healthy_s,
            "step_slow_s": link.step_slow_s, "step_after_s": link.step_after_s,
            "false_alarms": link.false_alarms, "healthy_polls": link.status_polls_healthy,
            "probe": link.link_probe}, link


def healthy_links_drill() -> dict:
    """The same 3-node netns cluster with healthy links, slowed job-wide (every worker under one shared CPU quota):
    the coordinator probes the links, and must name no node."""
    from trainguard.drill.failslow import StragglerDrillConfig, run_straggler_drill

    r = run_straggler_drill(StragglerDrillConfig(nodes=3, nproc=1, netns=True, throttle_all=True,
                                                 throttle_fraction=0.15, healthy_s=8, after_s=1,
                                                 detect_timeout_s=150), progress=print)
    slowdown = f"{r.step_slow_s / r.step_healthy_s:.1f}x slower" if r.step_slow_s and r.step_healthy_s else "?"
    return {"named": r.named_node, "probe": r.link_probe, "outcome_after_s": r.detection_s,
            "step_healthy_s": r.step_healthy_s, "step_slow_s": r.step_slow_s, "job_slowdown": slowdown,
            "false_alarms": r.false_alarms}


def _print_link(d: dict) -> None:
    print(f"slow link (3 nodes + spare in netns, n1's data0 capped at {d['rate']} by tbf): named "
          f"{d['named'] or 'none'} in {d['detection_s'] or 0:.1f} s, replaced {d['replaced']} "
          f"({d['replacement_after_detection_s'] or 0:.1f} s later); step {1000 * (d['step_healthy_s'] or 0):.0f} ms "
          f"healthy, {1000 * (d['step_slow_s'] or 0):.0f} ms slow link (baseline), "
          f"{1000 * (d['step_after_s'] or 0):.0f} ms after replacement; {d['false_alarms']} false alarm(s) in "
          f"{d['healthy_polls']} healthy polls; {d['probe']}")


def lock_hold(ranks: int, per_node: int, windows: int) -> dict:
    """Lock hold time of heartbeats at ``ranks`` ranks, window scoring inside the lock (before) vs outside (now).

    Every node beats once per simulated 0.25 s with its ranks' timing; one rank is 2x slow so the windows have
    something to find. Reported: the longest hold of the heartbeat that closes a window, the median hold of the
    others, and the scoring time of a window measured on its own.
    """
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, Command, NodeRecord, RankTiming
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import MemoryStore
    from trainguard.recovery.straggler import StragglerConfig

    class LockedScoring(JobCoordinator):
        """The coordinator as it was: the whole heartbeat, window scoring included, under the lock."""

        def heartbeat(self, req):  # noqa: D102
            with self._lock:
                return super().heartbeat(req)

    nodes = ranks // per_node
    out: dict = {"ranks": ranks, "nodes": nodes, "ranks_per_node": per_node}
    for name, cls in (("before_scoring_under_lock", LockedScoring), ("now_scoring_off_lock", JobCoordinator)):
        clock = [0.0]
        core = cls(JobSpec(job="bench", nnodes=nodes, heartbeat_interval_s=0.25, lease_timeout_s=3600,
                           failslow=StragglerConfig(window_s=2.0)), store=MemoryStore(), clock=lambda: clock[0])
        lock = _TimedLock()
        core._lock = lock  # noqa: SLF001 - instrument the real lock
        names = [f"n{i}" for i in range(nodes)]
        lease = {n: core.register("bench", NodeRecord(n, "p", i, n, per_node, "127.0.0.1"), 20000 + i)[0]
                 for i, n in enumerate(names)}
        gen = dict.fromkeys(names, -1)
        step = dict.fromkeys(names, 0)
        first = {}

        def beat(n: str, timed: bool) -> float:
            t = ()
            if timed and gen[n] > 0:
                step[n] += 2
                r0 = first[n]
                t = tuple(RankTiming(r, step[n], 0.2, 0.2 - (0.2 if r == 5 else 0.1), 0.2 if r == 5 else 0.1, 2)
                          for r in range(r0, r0 + per_node))
            t0 = time.perf_counter()
            ins = core.heartbeat(Beat("bench", n, lease[n], gen[n], per_node if gen[n] > 0 else 0, False,
                                      step[n] if gen[n] > 0 else -1, 0, t)).response
            dt = time.perf_counter() - t0
            if ins.command in (Command.START, Command.RESTART):
                gen[n] = ins.table.generation
                first[n] = core.layout.slot_of(n).first_rank
            return dt

        for _ in range(2):
            for n in names:
                beat(n, False)
        assert all(g == 1 for g in gen.values()), "the bench job did not form"
        lock.holds.clear()
        closing: list[float] = []
        other: list[float] = []
        while core._failslow.detector._seq < windows + 1:  # noqa: SLF001 - count windows closed
            clock[0] += 0.25
            for n in names:
                seq = core._failslow.detector._seq  # noqa: SLF001
                n_holds = len(lock.holds)
                beat(n, True)
                holds = lock.holds[n_holds:]
                (closing if core._failslow.detector._seq != seq else other).append(max(holds))  # noqa: SLF001
        det = core._failslow.detector  # noqa: SLF001
        row = {"window_closing_hold_max_s": max(closing[1:] or closing),
               "window_closing_hold_median_s": statistics.median(closing[1:] or closing),
               "other_hold_median_s": statistics.median(other), "windows": len(closing),
               "slow_found": [f.rank for f in (det.last.slow_ranks if det.last else ())]}
        out[name] = row
        print(f"{name}: window-closing heartbeat holds the lock {1000 * row['window_closing_hold_median_s']:.1f} ms "
              f"(max {1000 * row['window_closing_hold_max_s']:.1f}); other heartbeats {1e6 * row['other_hold_median_s']:.0f} us")
    # Scoring alone (the work moved off the lock), on one window's worth of samples.
    from trainguard.recovery.straggler import StragglerDetector, Timing

    det = StragglerDetector(StragglerConfig(window_s=2.0))
    t = 0.0
    snap = None
    while snap is None:
        snap = det.collect(1, [Timing(r, f"n{r // per_node}", 0, 0.2, 0.1, 0.1, 2) for r in range(ranks)], t)
        t += 0.25
    t0 = time.perf_counter()
    det.score(snap)
    out["scoring_s"] = time.perf_counter() - t0
    b, a = out["before_scoring_under_lock"], out["now_scoring_off_lock"]
    out["hold_ratio_before_over_now"] = b["window_closing_hold_median_s"] / a["window_closing_hold_median_s"]
    print(f"{ranks} ranks: window-closing lock hold {1000 * b['window_closing_hold_median_s']:.1f} ms -> "
          f"{1000 * a['window_closing_hold_median_s']:.1f} ms ({out['hold_ratio_before_over_now']:.0f}x less); "
          f"the scoring itself, now off the lock: {1000 * out['scoring_s']:.0f} ms per window")
    return out


def ettr(detect_s: float, components: list[str] | None, gpus: int, episode_h: float) -> dict:
    """The ETTR model with its fail-slow term: trainguard (measured detection, node replacement) against the
    baseline (no detection: the job runs at the straggler's pace until someone notices), StepFun trace and
    Llama-3 rate."""
    from trainguard.drill.components import baseline_defaults, load_components
    from trainguard.drill.ettr import FailSlow, JobSize, simulate, with_failslow
    from trainguard.drill.report import load_traces

    job = JobSize(gpus)
    traces = load_traces(["stepfun", "llama3"], None, 348.0, 0)
    tg, bl = load_components(components, baseline=baseline_defaults(1800.0))
    doc: dict = {"gpus": gpus, "detect_s": detect_s, "episode_h": episode_h, "rows": []}
    episode = episode_h * 3600.0
    print(f"ETTR with fail-slow at {gpus} GPUs ({job.nodes} nodes). A slow episode lasts {episode_h:g} h unless "
          f"acted on (an operator notices); trainguard flags it in {detect_s:.1f} s and replaces the node "
          f"({tg.recovery_node_s:.0f} s + half a checkpoint interval of lost work); baseline: no detection")
    print(f"  {'rate/node-day':>13} {'slowdown':>8}  {'trace':<8} {'no fail-slow':>12} {'trainguard':>10} "
          f"{'tg, no fail-slow detection':>26} {'baseline':>9}")
    reports = {tr.name: (simulate(tr, job, tg), simulate(tr, job, bl)) for tr in traces}
    for rate in (0.003, 0.01, 0.03):
        for slowdown in (1.1, 1.3, 2.0):
            for name, (rt, rb) in reports.items():
                fs_tg = FailSlow(rate, slowdown, episode, detect_s, tg.recovery_node_s + rt.result.interval_s / 2)
                fs_none = FailSlow(rate, slowdown, episode, None)
                row = {"rate_per_node_day": rate, "slowdown": slowdown, "trace": name,
                       "ettr_trainguard_no_failslow": rt.result.ettr,
                       "ettr_trainguard": with_failslow(rt.result.ettr, job.nodes, fs_tg),
                       "ettr_trainguard_no_detection": with_failslow(rt.result.ettr, job.nodes, fs_none),
                       "ettr_baseline": with_failslow(rb.result.ettr, job.nodes, fs_none)}
                doc["rows"].append(row)
                print(f"  {rate:>13g} {slowdown:>8g}  {name[:8]:<8} {100 * row['ettr_trainguard_no_failslow']:>11.2f}% "
                      f"{100 * row['ettr_trainguard']:>9.2f}% {100 * row['ettr_trainguard_no_detection']:>25.2f}% "
                      f"{100 * row['ettr_baseline']:>8.2f}%")
    return doc


def main() -> None:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--blocks", type=int, default=40)
    o.add_argument("--out", default=None)
    w = sub.add_parser("_worker")
    w.add_argument("--blocks", type=int, default=40)
    w.add_argument("--out", required=True)
    d = sub.add_parser("drills")
    d.add_argument("--soak-s", type=float, default=120.0)
    d.add_argument("--hang-rounds", type=int, default=3)
    d.add_argument("--link-rate", default="40mbit", help="tbf rate of the slow-link drill ('' skips it; needs netns)")
    d.add_argument("--out", default=None)
    ln = sub.add_parser("link")
    ln.add_argument("--link-rate", default="40mbit")
    ln.add_argument("--out", default=None)
    lk = sub.add_parser("lock")
    lk.add_argument("--ranks", type=int, default=16_384)
    lk.add_argument("--ranks-per-node", type=int, default=8)
    lk.add_argument("--windows", type=int, default=4)
    lk.add_argument("--out", default=None)
    e = sub.add_parser("ettr")
    e.add_argument("--detect-s", type=float, default=10.0, help="measured straggler detection time, seconds")
    e.add_argument("--components", action="append", default=None, help="measured component JSON (repeatable)")
    e.add_argument("--gpus", type=int, default=16_384)
    e.add_argument("--episode-h", type=float, default=4.0, help="hours until someone notices a slow node by hand")
    e.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cmd == "_worker":
        _worker_overhead(args.blocks, args.out)
        return
    if args.cmd == "overhead":
        doc = overhead(args.blocks)
    elif args.cmd == "link":
        healthy = healthy_links_drill()
        doc = {"healthy_links": healthy, "slow_link": link_drill(args.link_rate)[0]}
        print()
        print(f"healthy links, every worker under one shared CPU quota (job {healthy['job_slowdown']}): probe "
              f"outcome after {healthy['outcome_after_s'] or 0:.1f} s: {healthy['probe']}; named: "
              f"{healthy['named'] or 'none'}")
        _print_link(doc["slow_link"])
    elif args.cmd == "lock":
        doc = lock_hold(args.ranks, args.ranks_per_node, args.windows)
    elif args.cmd == "ettr":
        doc = ettr(args.detect_s, args.components, args.gpus, args.episode_h)
    else:
        doc = drills(args.soak_s, args.hang_rounds, args.link_rate)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
