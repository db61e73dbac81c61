"""The trace-driven ETTR model: replay a fault trace against a job and account for every second of wall time.

Effective training time ratio (ETTR) = time spent on training progress that is kept / wall time. The model
replays a :class:`~trainguard.drill.trace.FaultTrace` (scaled to the job's node count) against a system's
:class:`~trainguard.drill.components.Components` and splits the wall time into:

- **useful**: compute whose result survives to the end;
- **stall**: checkpoint stalls (including the extra checkpoint taken before a predicted fault);
- **lost**: compute done after the newest checkpoint the recovery can use, thrown away by a fault;
- **down**: detection latency plus recovery time (a fault during a recovery starts it again).

Between faults the job runs cycles of ``interval`` seconds of compute followed by a ``stall``. A fault at
offset ``x`` into such a run keeps the compute up to the newest usable checkpoint: the newest snapshot for a
process-level restart with the in-memory tier, otherwise the newest one durable off the node, which is
``persist_s`` after its snapshot (while the writer is busy newer snapshots are not persisted). A predicted
fault keeps everything but costs one stall. For a class with a predicted share ``p`` the model takes the
expectation ``p * predicted + (1 - p) * unpredicted`` (deterministic, so the optimum is not sampling noise).

The interval that maximises ETTR is found numerically (log grid, then a fine grid around the best) and printed
next to Young's ``sqrt(2 * stall * MTBF)`` and Daly's refinement, where MTBF counts only work-losing faults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainguard.drill.components import Components
from trainguard.drill.errors import ComponentsError
from trainguard.faultfacts.taxonomy import FaultClass, RecoveryLevel
from trainguard.drill.trace import GPUS_PER_NODE, FaultTrace


@dataclass(frozen=True)
class JobSize:
    """The simulated job.

    Attributes:
        gpus: accelerators in the job. Default 16,384 (Llama 3's pre-training scale).
        gpus_per_node: accelerators per node. Default 8.
    """

    gpus: int = 16_384
    gpus_per_node: int = GPUS_PER_NODE

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ComponentsError(f"job size must be >= 1 GPU and >= 1 GPU per node, got {self.gpus}/"
                                  f"{self.gpus_per_node}")

    @property
    def nodes(self) -> int:
        """Nodes in the job (rounded up)."""
        return -(-self.gpus // self.gpus_per_node)


@dataclass
class Timeline:
    """The wall-time skeleton of one replay: when each run between faults starts and how long it lasts.

    It does not depend on the checkpoint interval (downtime does not), so the interval search reuses it.

    Attributes:
        times_s: fault times, seconds.
        classes: fault class of each fault.
        run_s: compute+stall time since the previous resume when the fault struck (<= 0: during a recovery).
        run_start_s: when that run started (the previous resume).
        predicted: predicted share of each fault.
        durable: whether each fault's recovery needs a durable (off-node) checkpoint.
        detect_s: expected detection latency of each fault.
        down_s: expected detection + recovery time of each fault.
        end_run_s: length of the last run, from the last resume to the end of the trace.
        span_s: wall time of the whole replay.
    """

    times_s: np.ndarray
    classes: list[FaultClass]
    run_s: np.ndarray
    run_start_s: np.ndarray
    predicted: np.ndarray
    durable: np.ndarray
    detect_s: np.ndarray
    down_s: np.ndarray
    end_run_s: float
    span_s: float


def build_timeline(trace: FaultTrace, comp: Components) -> Timeline:
    """Lays out runs and recoveries for ``trace`` under ``comp``.

    Args:
        trace: the faults the job sees (already scaled to the job, see :meth:`FaultTrace.for_job`).
        comp: the system's component times.

    Returns:
        The timeline.
    """
    n = len(trace.faults)
    times = np.empty(n)
    run = np.empty(n)
    start = np.empty(n)
    pred = np.empty(n)
    durable = np.empty(n, dtype=bool)
    detect = np.empty(n)
    down = np.empty(n)
    resume = 0.0
    for i, f in enumerate(trace.faults):
        fc = f.fault_class
        level = comp.level(fc)
        p = comp.predicted_fraction(fc)
        rec = comp.recovery_s(level)
        det = comp.detection_s(fc)
        times[i], start[i], run[i], pred[i] = f.time_s, resume, f.time_s - resume, p
        durable[i] = not (level is RecoveryLevel.PROCESS and comp.memory_restore)
        detect[i] = (1.0 - p) * det
        down[i] = rec + detect[i]
        if run[i] > 0:
            resume = f.time_s + down[i]
        else:  # struck during a recovery: that recovery starts again
            resume = max(resume, f.time_s + down[i])
    return Timeline(times_s=times, classes=[f.fault_class for f in trace.faults], run_s=run, run_start_s=start,
                    predicted=pred, durable=durable, detect_s=detect, down_s=down,
                    end_run_s=trace.span_s - resume, span_s=trace.span_s)


@dataclass
class EttrResult:
    """The accounting of one replay (seconds of wall time).

    Attributes:
        system: components name.
        trace: trace name.
        nodes: job nodes.
        interval_s: checkpoint interval used (compute seconds between checkpoints).
        ettr: useful / span.
        span_s: wall time replayed.
        faults: number of faults.
        useful_s: compute kept.
        stall_s: checkpoint stalls.
        lost_s: compute thrown away.
        detect_s: detection latency (expected, summed).
        down_s: detection + recovery, including recoveries restarted by another fault.
        retained_s: compute kept by each run that a fault ended (array, for plots).
        end_useful_s: compute kept by the last run.
    """

    system: str
    trace: str
    nodes: int
    interval_s: float
    ettr: float
    span_s: float
    faults: int
    useful_s: float
    stall_s: float
    lost_s: float
    detect_s: float
    down_s: float
    retained_s: np.ndarray
    end_useful_s: float

    @property
    def per_fault_cost_s(self) -> float:
        """Wall time not spent on kept compute or regular stalls, per fault, seconds."""
        return (self.lost_s + self.down_s) / self.faults


def _compute_done(x: np.ndarray, tau: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    c = tau + delta
    k = np.floor(x / c)
    return k * tau + np.minimum(x - k * c, tau), k


def evaluate(tl: Timeline, comp: Components, interval_s: float, *, system: str = "", trace: str = "",
             nodes: int = 0) -> EttrResult:
    """ETTR of a laid-out timeline at a given checkpoint interval.

    Args:
        tl: from :func:`build_timeline` with the same ``comp``.
        comp: the system's component times.
        interval_s: compute seconds between checkpoints (> 0).
        system: name for the result (default ``comp.name``).
        trace: trace name for the result.
        nodes: job nodes, for the result.

    Returns:
        The accounting.

    Raises:
        ComponentsError: a non-positive interval.
    """
    if not (interval_s > 0 and math.isfinite(interval_s)):
        raise ComponentsError(f"checkpoint interval must be a positive number of seconds, got {interval_s}")
    tau, delta, p = float(interval_s), comp.checkpoint_stall_s, comp.persist_s
    c = tau + delta
    x = np.maximum(tl.run_s, 0.0)
    done, k = _compute_done(x, tau, delta)
    kept_memory = k * tau
    if p > 0:
        kk = np.floor((x - p) / c)
        m = max(1, math.ceil(p / c))
        kd = np.where(kk >= 1, 1 + np.floor((np.maximum(kk, 1) - 1) / m) * m, 0.0)
        kept_durable = kd * tau
    else:
        kept_durable = kept_memory
    unpredicted = np.where(tl.durable, kept_durable, kept_memory)
    f = tl.predicted
    extra_stall = np.minimum(delta, done)
    retained = f * (done - extra_stall) + (1.0 - f) * unpredicted
    stall = (x - done) + f * extra_stall
    lost = x - stall - retained
    end_done = 0.0
    end_stall = 0.0
    if tl.end_run_s > 0:
        d, _ = _compute_done(np.array([tl.end_run_s]), tau, delta)
        end_done = float(d[0])
        end_stall = tl.end_run_s - end_done
    useful = float(retained.sum()) + end_done
    stall_total = float(stall.sum()) + end_stall
    lost_total = float(lost.sum())
    return EttrResult(
        system=system or comp.name, trace=trace, nodes=nodes, interval_s=tau, ettr=useful / tl.span_s,
        span_s=tl.span_s, faults=len(tl.times_s), useful_s=useful, stall_s=stall_total, lost_s=lost_total,
        detect_s=float(tl.detect_s.sum()), down_s=tl.span_s - useful - stall_total - lost_total,
        retained_s=retained, end_useful_s=end_done,
    )


def optimise_interval(tl: Timeline, comp: Components, *, lo_s: float = 1.0, hi_s: float | None = None,
                      points: int = 240) -> float:
    """The checkpoint interval that maximises ETTR, found numerically.

    Args:
        tl: laid-out timeline.
        comp: the system's component times.
        lo_s: smallest interval tried, seconds.
        hi_s: largest interval tried, seconds (default: the span, capped at 30 days).
        points: log-grid size; a 100-point linear grid then refines around the best.

    Returns:
        The best interval, seconds.
    """
    hi = hi_s or min(tl.span_s, 30 * 86_400.0)
    hi = max(hi, lo_s * 1.01)
    grid = np.geomspace(lo_s, hi, points)
    scores = [evaluate(tl, comp, t).ettr for t in grid]
    i = int(np.argmax(scores))
    fine = np.linspace(grid[max(i - 1, 0)], grid[min(i + 1, points - 1)], 101)
    fine_scores = [evaluate(tl, comp, t).ettr for t in fine]
    j = int(np.argmax(fine_scores))
    return float(fine[j]) if fine_scores[j] >= scores[i] else float(grid[i])


@dataclass(frozen=True)
class YoungDaly:
    """Analytic optimum checkpoint intervals.

    Attributes:
        mtbf_s: mean time between work-losing faults (expected unpredicted faults), seconds.
        young_s: Young (1974): sqrt(2 * stall * MTBF).
        daly_s: Daly (2006) higher-order estimate: sqrt(2dM) * (1 + sqrt(d/2M)/3 + d/18M) - d for d < 2M, else M.
    """

    mtbf_s: float
    young_s: float
    daly_s: float


def young_daly(tl: Timeline, comp: Components) -> YoungDaly:
    """Young's and Daly's optimum intervals for this timeline's fault rate and the system's stall.

    Args:
        tl: laid-out timeline.
        comp: the system's component times.

    Returns:
        The analytic optima (``inf`` when no fault loses work).
    """
    losing = float((1.0 - tl.predicted).sum())
    mtbf = tl.span_s / losing if losing > 0 else math.inf
    d = comp.checkpoint_stall_s
    if math.isinf(mtbf):
        return YoungDaly(mtbf, math.inf, math.inf)
    young = math.sqrt(2.0 * d * mtbf)
    if d < 2 * mtbf:
        daly = young * (1 + math.sqrt(d / (2 * mtbf)) / 3 + d / (18 * mtbf)) - d
    else:
        daly = mtbf
    return YoungDaly(mtbf, young, max(daly, 0.0))


@dataclass
class SystemReport:
    """One system replayed on one trace: the result at the chosen interval and the analytic check."""

    components: Components
    timeline: Timeline
    result: EttrResult
    young_daly: YoungDaly
    optimised: bool


def simulate(trace: FaultTrace, job: JobSize, comp: Components) -> SystemReport:
    """Replays ``trace`` (scaled to ``job``) against ``comp``, optimising the interval unless it is fixed.

    Args:
        trace: fault trace at its own population size (it is scaled here).
        job: the job.
        comp: the system's component times.

    Returns:
        The report.
    """
    scaled = trace.for_job(job.nodes)
    tl = build_timeline(scaled, comp)
    optimised = comp.checkpoint_interval_s is None
    interval = optimise_interval(tl, comp) if optimised else float(comp.checkpoint_interval_s)
    result = evaluate(tl, comp, interval, trace=trace.name, nodes=job.nodes)
    return SystemReport(components=comp, timeline=tl, result=result, young_daly=young_daly(tl, comp),
                        optimised=optimised)


def cumulative_useful(tl: Timeline, result: EttrResult) -> tuple[np.ndarray, np.ndarray]:
    """Kept compute as a piecewise-linear function of wall time (knots), for ETTR-over-time plots.

    Each run's kept compute is spread evenly over the run; downtime is flat.

    Args:
        tl: the timeline the result came from.
        result: the result.

    Returns:
        (wall times, cumulative kept compute) knots, seconds, non-decreasing.
    """
    ts, us = [0.0], [0.0]
    u = 0.0
    for start, t, run, kept in zip(tl.run_start_s, tl.times_s, tl.run_s, result.retained_s):
        if run <= 0:
            continue
        ts += [start, t]
        us += [u, u + kept]
        u += kept
    if tl.end_run_s > 0:
        ts += [tl.span_s - tl.end_run_s, tl.span_s]
        us += [u, u + result.end_useful_s]
    else:
        ts.append(tl.span_s)
        us.append(u)
    return np.asarray(ts), np.asarray(us)


def format_report(reports: list[SystemReport], title: str) -> str:
    """A plain-text table of several systems' results on one trace.

    Args:
        reports: the systems' reports (same trace and job).
        title: heading line.

    Returns:
        The table, with the interval optimum next to Young/Daly.
    """
    lines = [title]
    hdr = (f"  {'system':<12} {'ETTR':>7} {'interval':>10} {'Young':>9} {'Daly':>9} {'useful':>7} {'stall':>6} "
           f"{'lost':>6} {'down':>6} {'cost/fault':>10}")
    lines.append(hdr)
    for rep in reports:
        r, yd = rep.result, rep.young_daly
        pct = lambda v: f"{100 * v / r.span_s:5.2f}%"  # noqa: E731
        lines.append(
            f"  {r.system:<12} {100 * r.ettr:6.2f}% {_dur(r.interval_s):>10}{'' if rep.optimised else '*'}"
            f"{_dur(yd.young_s):>9} {_dur(yd.daly_s):>9} {pct(r.useful_s):>7} {pct(r.stall_s):>6} "
            f"{pct(r.lost_s):>6} {pct(r.down_s):>6} {_dur(r.per_fault_cost_s):>10}"
        )
    first = reports[0].result
    lines.append(f"  {first.faults} faults on {first.nodes} nodes over {first.span_s / 86_400:.1f} days "
                 f"(job MTBF {_dur(first.span_s / first.faults)}); interval = compute between checkpoints "
                 "(* = fixed, else ETTR-optimal); Young/Daly use the MTBF of work-losing faults")
    return "\n".join(lines)


def _dur(s: float) -> str:
    if math.isinf(s):
        return "inf"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}min"
    return f"{s / 3600:.2f}h"


@dataclass(frozen=True)
class FailSlow:
    """Fail-slow episodes: a node keeps running, slower, and synchronous training waits for it every step.

    Attributes:
        rate_per_node_day: episodes per node per day. Default 0.01 (an assumption: one per 100 node-days; at
            2,048 nodes that is ~20 a day).
        slowdown: the job's step time while the slow node is in, as a multiple of the healthy one. Default 1.3.
        episode_s: how long an episode lasts if nobody acts, seconds (None: until the run ends; a throttling
            GPU or a NIC at a lower speed stays so until someone replaces the part).
        detect_s: episode start -> straggler flagged, seconds; None: never (the baseline: no detection, the job
            runs at the straggler's pace).
        mitigate_s: flagged -> the job back at full speed, seconds, all of it lost (node-level restart with a
            warm spare plus the work since the last checkpoint). Only spent when the episode would outlast it.
    """

    rate_per_node_day: float = 0.01
    slowdown: float = 1.3
    episode_s: float | None = None
    detect_s: float | None = 10.0
    mitigate_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.rate_per_node_day >= 0 or not self.slowdown >= 1.0:
            raise ComponentsError(f"fail-slow rate {self.rate_per_node_day} must be >= 0 and slowdown "
                                  f"{self.slowdown} >= 1")
        for name in ("episode_s", "detect_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ComponentsError(f"fail-slow {name} must be seconds >= 0 or None, got {v!r}")
        if not (math.isfinite(self.mitigate_s) and self.mitigate_s >= 0):
            raise ComponentsError(f"fail-slow mitigate_s must be seconds >= 0, got {self.mitigate_s!r}")


def failslow_loss(nodes: int, fs: FailSlow) -> float:
    """Expected share of wall time lost to fail-slow episodes, at steady state (the fail-slow term of ETTR).

    Episodes start as a Poisson process of rate ``rate_per_node_day x nodes``. Synchronous training runs at the
    pace of its slowest node, so what matters is whether *any* slow node is in: with episodes of ``D`` slow
    seconds each, that is the case ``1 - exp(-rate x D)`` of the time, and each such second yields
    ``1/slowdown`` of progress. Without detection ``D`` is the whole episode (``episode_s``; None: it never ends,
    the job is always slowed). With detection, an episode that would outlast ``detect_s + mitigate_s`` (the
    replace policy acts only when that pays) is slow for ``detect_s`` and then costs ``mitigate_s`` of lost
    time; a shorter one runs its course slowly.

    Args:
        nodes: nodes in the job.
        fs: the episode model and the system's detection and mitigation times.

    Returns:
        The expected lost share of wall time, in [0, 1].
    """
    rate = fs.rate_per_node_day * nodes / 86400.0
    if rate == 0:
        return 0.0
    length = math.inf if fs.episode_s is None else fs.episode_s
    slow, down = length, 0.0
    if fs.detect_s is not None and length > fs.detect_s + fs.mitigate_s:
        slow, down = fs.detect_s, fs.mitigate_s
    slowed_share = 1.0 - math.exp(-rate * slow) if math.isfinite(slow) else 1.0
    up = max(0.0, 1.0 - rate * down)
    return 1.0 - up * (1.0 - slowed_share * (1.0 - 1.0 / fs.slowdown))


def with_failslow(ettr: float, nodes: int, fs: FailSlow) -> float:
    """ETTR after the fail-slow term (the replay's ETTR times the share fail-slow leaves).

    Args:
        ettr: ETTR from the fault replay (crash, hang, node and link faults).
        nodes: nodes in the job.
        fs: the fail-slow model.
    """
    return ettr * (1.0 - failslow_loss(nodes, fs))
