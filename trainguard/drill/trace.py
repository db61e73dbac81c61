"""Fault traces: the real StepFun trace, a Llama-3-like rate, synthetic traces, and scaling to a job's size.

A :class:`FaultTrace` is a sorted list of faults (time, class, label, node) over a span of wall time on a
population of nodes. :meth:`FaultTrace.for_job` scales it to a job of another size by keeping the per-node
fault rate: the same sequence of faults (kinds, order, bursts) is replayed with the times multiplied by
``population_nodes / job_nodes``. A 2,048-node job thus sees the 348 days of the 400-node StepFun trace in 68 days.

Figures used (and where they come from):

- StepFun InfiniteHBD trace (SIGCOMM 2025, github.com/stepfun-ai/InfiniteHBD-Trace, Apache-2.0): 584
  ``fault_start`` events on a population of 400 GPU servers (README) over 348 days from 2024-03-30; we take 8
  GPUs per server. The span used is the time of the last event (348.98 days).
- Llama 3 (Dubey et al. 2024, section 3.3.4 and Table 5): 419 unexpected interruptions in a 54-day snapshot of
  pre-training on 16,384 H100 GPUs (2,048 servers of 8), with the root causes in
  :data:`~trainguard.faultfacts.taxonomy.LLAMA3_CATEGORIES`. We model it as a Poisson process at that rate with
  the categories' shares.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from trainguard.drill.errors import TraceError
from trainguard.faultfacts.taxonomy import LLAMA3_CATEGORIES, FaultClass, classify_stepfun

DAY_S = 86_400.0

#: Environment variable naming the StepFun trace folder (holding ``fault_trace.json``).
TRACE_DIR_ENV = "TRAINGUARD_FAULT_TRACE_DIR"

#: Where a wheel built next to the trace carries it, with its LICENSE (setup.py copies it in at build time).
PACKAGED_TRACE_DIR = Path(__file__).resolve().parent / "data" / "stepfun"

def _workspace_trace_dir() -> Path:
    """The nearest ``shared/data/stepfun-fault-trace`` above the repository root (``<root>/../shared`` in a
    checkout, higher up in a git worktree); the first candidate when none exists."""
    repo = Path(__file__).resolve().parents[2]
    candidates = [parent / "shared" / "data" / "stepfun-fault-trace" for parent in repo.parents]
    return next((c for c in candidates if (c / "fault_trace.json").is_file()), candidates[0])


#: Where the trace lies in the team's workspace: ``shared/data/stepfun-fault-trace`` beside the repo (or above it).
DEFAULT_TRACE_DIR = _workspace_trace_dir()

STEPFUN_POPULATION_NODES = 400
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16_384
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Fault:
    """One fault that interrupts the job.

    Attributes:
        time_s: wall time of the fault from the start of the trace, seconds.
        fault_class: how the job sees it.
        label: the trace's own name for it (``Level/Class/Desc`` for StepFun).
        node: the node it hit (anonymised id, or an index for synthetic traces).
    """

    time_s: float
    fault_class: FaultClass
    label: str
    node: str = ""


@dataclass(frozen=True)
class FaultTrace:
    """A sorted sequence of faults over a span of wall time on a population of nodes.

    Attributes:
        name: short name for reports (``stepfun``, ``llama3``, ...).
        faults: the faults, sorted by time.
        span_s: wall time the trace covers, seconds.
        population_nodes: nodes the faults were observed on.
        gpus_per_node: accelerators per node.
        source: where the figures come from, one line.
    """

    name: str
    faults: tuple[Fault, ...]
    span_s: float
    population_nodes: int
    gpus_per_node: int = GPUS_PER_NODE
    source: str = ""

    def __post_init__(self) -> None:
        if not self.faults:
            raise TraceError(f"trace {self.name!r} has no faults; point it at a trace with fault_start events")
        if not (self.span_s > 0 and math.isfinite(self.span_s)):
            raise TraceError(f"trace {self.name!r}: span must be a positive number of seconds, got {self.span_s}")
        if self.population_nodes < 1 or self.gpus_per_node < 1:
            raise TraceError(f"trace {self.name!r}: population_nodes and gpus_per_node must be >= 1")
        times = [f.time_s for f in self.faults]
        if any(b < a for a, b in zip(times, times[1:])):
            raise TraceError(f"trace {self.name!r}: faults are not sorted by time")
        if times[0] < 0 or times[-1] > self.span_s:
            raise TraceError(f"trace {self.name!r}: fault times must lie within [0, span]")

    @property
    def rate_per_node_day(self) -> float:
        """Faults per node per day."""
        return len(self.faults) / (self.population_nodes * self.span_s / DAY_S)

    @property
    def mtbf_s(self) -> float:
        """Mean time between faults of the whole population, seconds."""
        return self.span_s / len(self.faults)

    def class_counts(self) -> dict[FaultClass, int]:
        """How many faults of each class the trace holds."""
        return dict(Counter(f.fault_class for f in self.faults))

    def for_job(self, job_nodes: int) -> FaultTrace:
        """The trace as a job of ``job_nodes`` nodes lives it, at the same per-node fault rate.

        Args:
            job_nodes: nodes in the job (>= 1).

        Returns:
            A trace with the same faults in the same order, times scaled by ``population_nodes / job_nodes``.

        Raises:
            TraceError: ``job_nodes`` < 1.
        """
        if job_nodes < 1:
            raise TraceError(f"job must have at least one node, got {job_nodes}")
        k = self.population_nodes / job_nodes
        return replace(
            self,
            faults=tuple(replace(f, time_s=f.time_s * k) for f in self.faults),
            span_s=self.span_s * k,
            population_nodes=job_nodes,
            source=f"{self.source}; scaled to {job_nodes} nodes (time x{k:.4g})",
        )


def trace_dir(path: str | os.PathLike | None = None) -> Path:
    """The StepFun trace folder: ``path``, else ``$TRAINGUARD_FAULT_TRACE_DIR``, else the copy a wheel carries
    (:data:`PACKAGED_TRACE_DIR`), else the workspace's (:data:`DEFAULT_TRACE_DIR`)."""
    if path:
        return Path(path)
    env = os.environ.get(TRACE_DIR_ENV)
    if env:
        return Path(env)
    if (PACKAGED_TRACE_DIR / "fault_trace.json").is_file():
        return PACKAGED_TRACE_DIR
    return DEFAULT_TRACE_DIR


def load_stepfun(path: str | os.PathLike | None = None) -> FaultTrace:
    """Loads the StepFun InfiniteHBD fault trace, in place (it is never copied into the repository).

    Args:
        path: the folder holding ``fault_trace.json``, or the file itself; see :func:`trace_dir` for defaults.

    Returns:
        One :class:`Fault` per ``fault_start`` event, classified with
        :func:`~trainguard.faultfacts.taxonomy.classify_stepfun`, on a population of 400 nodes.

    Raises:
        TraceError: the file is missing, not JSON, has no faults, or holds an entry we cannot classify.
    """
    p = trace_dir(path)
    file = p / "fault_trace.json" if p.is_dir() else p
    try:
        events = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise TraceError(f"StepFun fault trace not found at {file}; pass --trace DIR or set {TRACE_DIR_ENV} to the "
                         "folder holding fault_trace.json (github.com/stepfun-ai/InfiniteHBD-Trace, Apache-2.0), or "
                         "install a wheel built with it") from exc
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read the fault trace {file}: {exc}; check that it is the StepFun JSON file") \
            from exc
    if not isinstance(events, list):
        raise TraceError(f"{file}: expected a JSON list of events, got {type(events).__name__}")
    faults = []
    last = 0.0
    for i, ev in enumerate(events):
        try:
            t = float(ev["event_time"]) * DAY_S
            kind = ev["event_type"]
            ft = ev["fault_type"]
            level, cls, desc = str(ft["Level"]), str(ft["Class"]), str(ft["Desc"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{file}: event {i} is malformed ({exc!r}); expected event_time, event_type and "
                             "fault_type with Level/Class/Desc") from exc
        if not math.isfinite(t) or t < 0:
            raise TraceError(f"{file}: event {i} has a bad event_time {ev['event_time']!r}")
        last = max(last, t)
        if kind != "fault_start":
            continue
        fc = classify_stepfun(level, cls, desc)
        if fc is None:
            raise TraceError(f"{file}: event {i}: no fault class for {level}/{cls}/{desc}; add it to "
                             "trainguard.faultfacts.taxonomy.STEPFUN_CLASSES")
        faults.append(Fault(time_s=t, fault_class=fc, label=f"{level}/{cls}/{desc}", node=str(ev.get("node_id", ""))))
    if not faults:
        raise TraceError(f"{file}: no fault_start events; is this the StepFun fault trace?")
    faults.sort(key=lambda f: f.time_s)
    return FaultTrace(
        name="stepfun", faults=tuple(faults), span_s=last, population_nodes=STEPFUN_POPULATION_NODES,
        source=f"StepFun InfiniteHBD trace ({len(faults)} faults, {STEPFUN_POPULATION_NODES} nodes, "
               f"{last / DAY_S:.1f} days)",
    )


def poisson_trace(
    name: str,
    rate_per_node_day: float,
    nodes: int,
    days: float,
    classes: dict[FaultClass | str, float],
    seed: int = 0,
    source: str = "",
) -> FaultTrace:
    """A synthetic trace: faults arrive as a Poisson process, each of a class drawn with the given weights.

    Args:
        name: trace name.
        rate_per_node_day: faults per node per day (> 0).
        nodes: population (>= 1).
        days: span (> 0), days.
        classes: fault class (or its label) -> relative weight (> 0); labels map through
            :data:`~trainguard.faultfacts.taxonomy.LLAMA3_CATEGORIES` when they are not a class name.
        seed: RNG seed; the same arguments give the same trace.
        source: where the figures come from.

    Returns:
        The trace (at least one fault: a draw with none is an error).

    Raises:
        TraceError: a non-positive rate, span or weight, or an empty draw.
    """
    if not (rate_per_node_day > 0 and days > 0 and nodes >= 1) or not classes:
        raise TraceError(f"trace {name!r}: rate, days and nodes must be positive and classes non-empty")
    labels, weights, kinds = [], [], []
    for key, w in classes.items():
        if not w > 0:
            raise TraceError(f"trace {name!r}: weight of {key!r} must be > 0, got {w}")
        if isinstance(key, FaultClass):
            kind, label = key, key.value
        elif key in LLAMA3_CATEGORIES:
            kind, label = LLAMA3_CATEGORIES[key][1], key
        else:
            try:
                kind, label = FaultClass(key), key
            except ValueError:
                raise TraceError(f"trace {name!r}: unknown fault class {key!r}") from None
        labels.append(label)
        weights.append(float(w))
        kinds.append(kind)
    rng = random.Random(seed)
    span = days * DAY_S
    mean_gap = DAY_S / (rate_per_node_day * nodes)
    faults, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mean_gap)
        if t > span:
            break
        i = rng.choices(range(len(labels)), weights=weights)[0]
        faults.append(Fault(time_s=t, fault_class=kinds[i], label=labels[i], node=str(rng.randrange(nodes))))
    if not faults:
        raise TraceError(f"trace {name!r}: no fault drawn in {days} days; raise the rate or the span")
    return FaultTrace(name=name, faults=tuple(faults), span_s=span, population_nodes=nodes, source=source)


def llama3_trace(days: float = 348.0, seed: int = 0) -> FaultTrace:
    """A Llama-3-like trace: 419 unexpected interruptions per 54 days on 16,384 GPUs, Llama 3's root causes.

    Args:
        days: span to draw, days (default 348, the StepFun span, so both traces average over as many faults).
        seed: RNG seed.

    Returns:
        A Poisson trace on 2,048 nodes of 8 GPUs.
    """
    nodes = LLAMA3_GPUS // GPUS_PER_NODE
    rate = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * nodes)
    return poisson_trace(
        "llama3", rate, nodes, days, {k: v[0] for k, v in LLAMA3_CATEGORIES.items()}, seed=seed,
        source=f"Llama 3 rate (419 interruptions / 54 days / 16,384 GPUs, Dubey et al. 2024), Poisson, "
               f"{days:g} days, seed {seed}",
    )
