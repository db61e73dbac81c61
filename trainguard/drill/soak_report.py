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
from trainguard.drill.taxonomy import FaultClass
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


def measured_components(rep: SoakReport) -> dict[str, float]:
    """Component times the drill measured, as overrides for :class:`Components` (only what it measured)."""
    kills = [f for f in rep.faults if f.kind == "kill"]
    stops = [f for f in rep.faults if f.kind == "stop"]
    restarts = [f for f in rep.faults if f.kind in ("kill", "stop") and f.recovery_s is not None]
    out: dict[str, float] = {}
    d_kill = _median([f.detected_s for f in kills])
    if d_kill is not None:
        out["detect_crash_s"] = out["detect_node_fault_s"] = round(max(d_kill, 0.0), 4)
    d_hang = _median([f.detected_s for f in stops])
    if d_hang is not None:
        out["detect_hang_s"] = round(d_hang, 3)
    rec = _median([f.recovery_s - (f.detected_s or 0.0) for f in restarts])
    if rec is not None:
        out["recovery_process_s"] = round(max(rec, 0.0), 3)
    if rep.stall_s is not None:
        out["checkpoint_stall_s"] = round(rep.stall_s, 5)
    return out


def at_scale(measured: dict[str, float]) -> dict[str, float]:
    """The measured figures that carry over to a large job.

    The checkpoint stall of the drill's tiny model and the hang bound the drill configured (time-compressed) say
    nothing about a 16k-GPU job, so they are left to the defaults.
    """
    return {k: v for k, v in measured.items() if k not in ("checkpoint_stall_s", "detect_hang_s")}


def drill_schedule_trace(rep: SoakReport) -> FaultTrace | None:
    """The drill's injected restart faults as a trace from its first to its last step (None when none restarted).

    Job start-up is left out on purpose: the model has no start-up cost, so it is compared with the measured ETTR
    over the same span (:attr:`SoakReport.ettr_steady`).
    """
    faults = []
    for f in rep.faults:
        if f.kind in ("kill", "stop", "unplanned"):
            fc = FaultClass.HANG if f.kind == "stop" else FaultClass.CRASH
            faults.append(Fault(time_s=f.injected_s, fault_class=fc, label=f.label))
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
    tg = trainguard_defaults(**m, checkpoint_interval_s=interval, persist_s=0.0, predicted_share=0.0,
                             levels={c.value: "process" for c in FaultClass})
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
    w(f"  {'#':>2} {'at':>7} {'kind':<7} {'class':<11} {'detected':>9} {'recovered':>10} {'lost':>5}  origin")
    for i, f in enumerate(rep.faults, 1):
        det = f"{f.detected_s:.2f}s" if f.detected_s is not None else "-"
        rec = f"{f.recovery_s:.2f}s" if f.recovery_s is not None else "-"
        lost = str(f.steps_lost) if f.steps_lost is not None else "-"
        w(f"  {i:>2} {f.injected_s:6.1f}s {f.kind:<7} {f.fault_class:<11} {det:>9} {rec:>10} {lost:>5}  {f.label}")
    w("  (detected: fault to the agent seeing the exit / the process detector flagging the hang / the hook "
      "logging the checkpoint error; recovered: fault to the first step of the next generation, for enospc: space "
      "freed to the next committed checkpoint; lost: steps done again)")
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
    w("model at 16,384 GPUs with these measured figures (defaults for the rest, see trainguard ettr --help):")
    job = JobSize()
    tg16 = trainguard_defaults().with_overrides(at_scale(m))
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
