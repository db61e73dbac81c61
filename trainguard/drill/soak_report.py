"""Turns a soak drill's outcome into tables, measured component times, model figures and a plot.

The measured figures (detection latency per injected kind, process-level recovery time, checkpoint stall) are fed
into the ETTR model twice: replaying the drill's own fault schedule (a check of the model against the measured
ETTR, with the baseline's figure on the same schedule next to it), and at 16k GPUs on the StepFun trace and the
Llama-3 rate, with the shipped defaults for what the drill cannot measure on one machine.
"""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time

from trainguard.drill.components import Components, baseline_defaults, trainguard_defaults
from trainguard.drill.ettr import JobSize, build_timeline, cumulative_useful, evaluate, simulate
from trainguard.drill.soak import SoakReport
from trainguard.faultfacts.taxonomy import FaultClass
from trainguard.drill.trace import Fault, FaultTrace, llama3_trace, load_stepfun


def _median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def measure_torch_save_stall(nbytes_hint: int = 0) -> float:
    """Seconds a synchronous ``torch.save`` + fsync of the drill model's state takes here (the baseline's stall).

    Args:
        nbytes_hint: unused size hint (the state is the drill's MLP and its SGD momentum).

    Returns:
        Median of 5 saves, seconds.
    """
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    times = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(5):
            t = time.perf_counter()
            path = os.path.join(d, f"ckpt{i}.pt")
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            times.append(time.perf_counter() - t)
    return statistics.median(times)


#: Drill fault kind -> the detection field of :class:`Components` it measures.
DETECT_FIELDS = {"kill": "detect_crash_s", "hwfault": "detect_node_fault_s", "stop": "detect_hang_s",
                 "agentkill": "detect_node_down_s", "linkdown": "detect_link_s", "precursor": "detect_degraded_s"}

#: Communicator start-up of a 16k-rank job, seconds, added to every measured restart when scaling up: a restart
#: here re-forms a 2-rank gloo group in milliseconds, while NCCL initialisation at tens of thousands of ranks takes
#: dozens of seconds (Meta measured 26 s in one ring-building step alone at 96k ranks before optimising it,
#: NVIDIA/nccl pull 1789). A stated assumption, not a measurement.
COMMUNICATOR_INIT_AT_SCALE_S = 30.0

#: The coordinator's production lease timeout, seconds (``trainguard coordinator --lease-timeout`` default).
PRODUCTION_LEASE_S = 10.0


def measured_components(rep: SoakReport) -> dict[str, float]:
    """Component times the drill measured, as overrides for :class:`Components` (only what it measured).

    Detection per kind is the median of the injected faults of that kind (:data:`DETECT_FIELDS`); restart times
    are fault to first resumed step minus detection, by the level the drill observed; ``predicted_share`` is the
    share of precursors whose node was replaced before the announced fault struck.
    """
    out: dict[str, float] = {}
    for kind, name in DETECT_FIELDS.items():
        d = _median([f.detected_s for f in rep.faults if f.kind == kind])
        if d is not None:
            out[name] = round(max(d, 0.0), 4)
    if "detect_crash_s" in out and "detect_node_fault_s" not in out and not rep.config.get("nodes"):
        out["detect_node_fault_s"] = out["detect_crash_s"]  # one node: an Xid shows as the worker's exit
    for level in ("process", "node"):
        done = [f for f in rep.faults if f.level == level and f.recovery_s is not None
                and f.kind not in ("unplanned", "precursor")]
        rec = _median([f.recovery_s - (f.detected_s or 0.0) for f in done])
        if rec is not None:
            out[f"recovery_{level}_s"] = round(max(rec, 0.0), 3)
    pre = [f.predicted for f in rep.faults if f.kind == "precursor" and f.predicted is not None]
    if pre:
        out["predicted_share"] = round(sum(pre) / len(pre), 3)
    if rep.stall_s is not None:
        out["checkpoint_stall_s"] = round(rep.stall_s, 5)
    return out


def at_scale(measured: dict[str, float], lease_s: float | None = None,
             communicator_init_s: float = COMMUNICATOR_INIT_AT_SCALE_S) -> dict[str, float]:
    """The measured figures carried over to a 16k-GPU job.

    Kept as measured: detection of crashes, hardware faults and link loss (each is the agent's own reaction
    time on its node, independent of the job's size). Rescaled: node-loss detection (the drill's short lease is
    swapped for the production lease of :data:`PRODUCTION_LEASE_S`) and restarts (plus
    ``communicator_init_s``, which a 2-rank drill cannot show). Left to the defaults: the checkpoint stall of
    the drill's tiny model, the time-compressed hang bound and precursor lead, and the predicted share of a
    handful of precursors.

    Args:
        measured: :func:`measured_components` output.
        lease_s: the drill's lease timeout, seconds (None: keep ``detect_node_down_s`` out).
        communicator_init_s: seconds added to each measured restart for communicator start-up at scale.
    """
    out = {k: v for k, v in measured.items()
           if k in ("detect_crash_s", "detect_node_fault_s", "detect_link_s")}
    if "detect_node_down_s" in measured and lease_s is not None:
        out["detect_node_down_s"] = round(max(measured["detect_node_down_s"] - lease_s, 0.0) + PRODUCTION_LEASE_S, 3)
    for k in ("recovery_process_s", "recovery_node_s"):
        if k in measured:
            out[k] = round(measured[k] + communicator_init_s, 3)
    return out


def drill_schedule_trace(rep: SoakReport) -> FaultTrace | None:
    """The drill's injected restart faults as a trace from its first to its last step (None when none restarted).

    Job start-up is left out on purpose: the model has no start-up cost, so it is compared with the measured ETTR
    over the same span (:attr:`SoakReport.ettr_steady`).
    """
    faults = []
    classes = {"kill": FaultClass.CRASH, "unplanned": FaultClass.CRASH, "stop": FaultClass.HANG,
               "hwfault": FaultClass.NODE_FAULT, "agentkill": FaultClass.NODE_DOWN, "linkdown": FaultClass.LINK,
               "precursor": FaultClass.DEGRADED}
    for f in rep.faults:
        if f.kind in classes:
            faults.append(Fault(time_s=f.injected_s, fault_class=classes[f.kind], label=f.label))
    if not faults or not rep.timeline:
        return None
    faults.sort(key=lambda f: f.time_s)
    span = max(t for t, _, _ in rep.timeline) - rep.timeline[0][0]
    return FaultTrace(name="drill", faults=tuple(faults), span_s=max(span, faults[-1].time_s),
                      population_nodes=1, source="the soak drill's injected faults")


def drill_components(rep: SoakReport, torch_save_s: float,
                     baseline_restart_s: float | None = None) -> tuple[Components, Components]:
    """trainguard (measured) and the baseline on the drill's own machine and schedule.

    The baseline saves synchronously with the measured ``torch.save`` time, has no in-memory tier, finds hangs by
    gloo's default 30-minute timeout, and restarts the job in ``baseline_restart_s`` (e.g. torchrun's recovery
    measured by ``bench/bench_restart.py``); by default in the restart time trainguard measured, which flatters
    the baseline.
    """
    m = measured_components(rep)
    interval = rep.config["save_every"] * rep.step_time_s
    levels = {c.value: "process" for c in FaultClass}
    cluster = bool(rep.config.get("nodes"))
    if cluster:  # what the cluster drill did: hardware, node, link and precursor faults replace the node
        levels.update({c: "node" for c in ("node_fault", "node_down", "link", "degraded")})
    tg = trainguard_defaults(**{**m, "checkpoint_interval_s": interval, "persist_s": 0.0,
                                "predicted_share": m.get("predicted_share", 0.0),
                                "predictable": ("degraded",) if cluster else (), "levels": levels,
                                # --memory-tier host: a multi-node job's memory tier is per host, so it restores
                                # from the shared disk; job (the default): from every node's memory
                                "memory_restore": not cluster or rep.config.get("memory_tier", "job") == "job"})
    bl = baseline_defaults(checkpoint_interval_s=interval, checkpoint_stall_s=torch_save_s,
                           recovery_job_s=baseline_restart_s if baseline_restart_s is not None
                           else m.get("recovery_process_s", tg.recovery_process_s),
                           detect_crash_s=m.get("detect_crash_s", 0.1))
    return tg, bl


def format_soak(rep: SoakReport, torch_save_s: float, trace_dir: str | None = None,
                baseline_restart_s: float | None = None) -> str:
    """The drill's report: faults, ETTR, verification, and the model fed with the measured figures."""
    out = io.StringIO()
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(f"soak drill: {rep.steps} steps in {rep.wall_s:.1f} s wall, {rep.generations} generation(s), exit "
      f"{rep.exit_code}; fault-free step time {1000 * rep.step_time_s:.1f} ms")
    if rep.compression:
        w(f"faults: StepFun trace as a {rep.config['represent_gpus']}-GPU job lives it, days "
          f"{rep.window_days[0]:.2f}-{rep.window_days[1]:.2f}, time compressed {rep.compression:,.0f}x")
    w(f"  {'#':>2} {'at':>7} {'kind':<11} {'class':<11} {'node':<7} {'level':<8} {'detected':>9} {'recovered':>10} "
      f"{'lost':>5} {'restored from':<14} origin")
    for i, f in enumerate(rep.faults, 1):
        det = f"{f.detected_s:.2f}s" if f.detected_s is not None else "-"
        rec = f"{f.recovery_s:.2f}s" if f.recovery_s is not None else "-"
        lost = str(f.steps_lost) if f.steps_lost is not None else "-"
        pred = {True: " [predicted in time]", False: " [NOT drained in time]", None: ""}[f.predicted]
        tiers = sorted(set(f.restore_tiers.values()))
        source = "-" if not tiers else tiers[0] if len(tiers) == 1 else "+".join(tiers)
        w(f"  {i:>2} {f.injected_s:6.1f}s {f.kind:<11} {f.fault_class:<11} {f.node or '-':<7} {f.level:<8} {det:>9} "
          f"{rec:>10} {lost:>5} {source:<14} {f.label}{pred}")
    w("  (detected: fault to the agent seeing the exit / the process detector flagging the hang / the agent naming "
      "the hardware cause / the coordinator's lease expiring / the predictor's alarm / the hook logging the "
      "checkpoint warning or error; recovered: fault to the first step of the next generation, for enospc: space "
      "freed to the next committed checkpoint (0 when checkpoints were still committed while the disk was full), "
      "for coordinator: kill to the new coordinator serving; lost: steps done "
      "again; restored from: the checkpoint tier every rank's restore read)")
    if rep.skipped:
        counts: dict[str, int] = {}
        for p in rep.skipped:
            counts[p.fault_class] = counts.get(p.fault_class, 0) + 1
        w(f"skipped {len(rep.skipped)} trace fault(s): " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    for k, why in rep.skip_reasons.items():
        w(f"  not injected: {k}: {why}")
    eq = {True: "EQUAL", False: "DIFFERENT", None: "not checked"}[rep.equal_to_reference]
    w(f"model vs fault-free run of {rep.steps} steps: {eq} (params sha256 {rep.params_sha256[:16]}...)")
    w(f"ETTR measured: {100 * rep.ettr:.1f}% of wall time (launch to exit), {100 * rep.ettr_steady:.1f}% from the "
      "first to the last step")
    m = measured_components(rep)
    w("measured components: " + ", ".join(f"{k}={v:g}" for k, v in m.items())
      + f"; torch.save+fsync of the same state: {1000 * torch_save_s:.2f} ms")
    tr = drill_schedule_trace(rep)
    if tr is not None:
        tg, bl = drill_components(rep, torch_save_s, baseline_restart_s)
        r_tg = evaluate(build_timeline(tr, tg), tg, tg.checkpoint_interval_s)
        r_bl = evaluate(build_timeline(tr, bl), bl, bl.checkpoint_interval_s)
        w(f"model on the drill's own schedule, first to last step: trainguard {100 * r_tg.ettr:.1f}% (measured "
          f"{100 * rep.ettr_steady:.1f}%) vs baseline {100 * r_bl.ettr:.1f}% (job restarts, synchronous torch.save, hangs "
          f"found by gloo's 30 min timeout, job restart {bl.recovery_job_s:.2f} s)")
    lease = rep.config.get("lease_timeout_s") if rep.config.get("nodes") else None
    w(f"model at 16,384 GPUs with these measured figures (restarts + {COMMUNICATOR_INIT_AT_SCALE_S:.0f} s of "
      "communicator start-up, node loss detected by the production lease; defaults for the rest, see trainguard "
      "ettr --help): " + ", ".join(f"{k}={v:g}" for k, v in at_scale(m, lease).items()))
    job = JobSize()
    tg16 = trainguard_defaults().with_overrides(at_scale(m, lease))
    traces = [llama3_trace()]
    try:
        traces.insert(0, load_stepfun(trace_dir))
    except Exception:  # noqa: BLE001 - the drill already loaded it; this only guards a vanished file
        pass
    for t in traces:
        a = simulate(t, job, tg16).result
        b = simulate(t, job, baseline_defaults()).result
        w(f"  {t.name:<8} trainguard {100 * a.ettr:.2f}% vs baseline {100 * b.ettr:.2f}%")
    return out.getvalue().rstrip()


def plot_soak(path: str, rep: SoakReport, torch_save_s: float, baseline_restart_s: float | None = None) -> str:
    """Draws the drill's measured ETTR over time (kept steps), the modelled baseline, and the fault timeline."""
    import numpy as np

    from trainguard.drill.plot import FaultMark, Series, plot_ettr

    # A step execution is kept when it is the last execution of that step number.
    last: dict[int, float] = {}
    for t, _gen, step in rep.timeline:
        last[step] = t
    kept = np.sort(np.array(list(last.values())))
    times = np.concatenate([[0.0], kept, [rep.wall_s]])
    useful = np.concatenate([[0.0], np.arange(1, len(kept) + 1) * rep.step_time_s, [len(kept) * rep.step_time_s]])
    series = [Series("trainguard (measured)", times, useful, rep.ettr)]
    t_first = rep.timeline[0][0] if rep.timeline else 0.0
    tr = drill_schedule_trace(rep)
    if tr is not None:
        _, bl = drill_components(rep, torch_save_s, baseline_restart_s)
        tl = build_timeline(tr, bl)
        r = evaluate(tl, bl, bl.checkpoint_interval_s)
        t_b, u_b = cumulative_useful(tl, r)
        t_b = t_b + t_first  # the model's clock starts at the first step
        # Same denominator as the measured curve: launch to exit (the model has no start-up; it shows as idle).
        series.append(Series("baseline (model, same faults)", t_b, u_b, r.useful_s / rep.wall_s))
    marks = [FaultMark(t_first + f.injected_s, f.kind, (f.recovery_s or 0.0)) for f in rep.faults]
    title = f"soak drill: {rep.steps} steps, {len(rep.faults)} faults, ETTR {100 * rep.ettr:.1f}% (wall {rep.wall_s:.0f} s)"
    return plot_ettr(path, series, marks, rep.wall_s, title, time_unit="seconds", bins=40)
