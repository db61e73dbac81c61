"""Synthetic fault traces for tests and benchmarks, following StepFun's published fault mix.

**Faults.** Kinds and their relative frequencies are those of StepFun's public trace (584 faults on 400
servers over 348 days, ``fault_trace.json``; the path is configurable, default
``<repo>/../shared/data/stepfun-fault-trace``). The trace's mean rate is 584 / (400 x 349) = 0.0042 faults
per node-day; ``rate_scale`` multiplies it (benchmarks use 20-40x so a few hundred node-days hold enough
failures to measure recall). Each node fails as a Poisson process; a failed node is down (no samples) for a
repair time drawn from the trace's own fault_start -> fault_end durations of that kind, times
``repair_scale``; its counters restart from zero when it comes back (a driver reload).

**Precursors.** Each fault kind maps to a precursor family, or to none, and a fault of a kind with a family
shows its precursor with probability ``p`` (not every DBE is preceded by a visible SBE trend). Shapes follow
published field studies: corrected-ECC rates that grow before uncorrectable errors and row remapping
(Sridharan et al. SC'13, Meta's HBM studies); XID bursts before GPU failure (Ostrouchov et al. SC'20,
Kokolis et al. 2024 "Revisiting reliability in large-scale ML research clusters"); rising PCIe replay /
AER-corrected rates before a link degrades; FEC-corrected and symbol errors plus carrier flaps before a link
goes down (Meta's RoCE paper, SIGCOMM'24; Alibaba HPN); thermal runaway after fan failures; step-time drift
of a straggler (Falcon, 2024); telemetry timeouts before a hung driver. ``FAMILIES`` lists onset lead,
growth time constant and peak amplitude for each. Kinds with no numeric warning (GPU lost / fell off the bus,
power supply, NIC lost, unknown errors, stress-test failures...) get no precursor.

| family     | kinds (StepFun "Desc")                                         | p    | onset before failure |
|------------|----------------------------------------------------------------|------|----------------------|
| ecc        | GPU DBE > Threshold, GPU SBE > Threshold                       | 0.8  | 60-240 min, exp ramp |
| xid        | GPU xid Error                                                  | 0.7  | 15-60 min bursts     |
| pcie       | GPU PCI link width low, NIC PCI link Width low                 | 0.7  | 30-120 min ramp      |
| link       | Link Down, NIC Link Speed low, Remote Optical Module Failure   | 0.7  | 20-90 min ramp+flaps |
| thermal    | GPU Temperature High, Fan Speed Critical, Fan Redundancy Lost  | 0.7  | 20-60 min rise       |
| step       | GPU P2P Bandwidth Low, Suspect Machine Offline                 | 0.6  | 20-90 min drift      |
| telemetry  | nvidia-smi Timeout                                             | 0.7  | 10-40 min gaps       |

**Decoys.** Healthy nodes are not flat: per-node heterogeneity (log-normal base rates: some nodes leak
corrected errors for ever without failing), benign transient episodes of every family at ``decoy_rate`` per
node-day (3-20 min long, 2-20% of a real precursor's peak, never followed by a failure), job-wide congestion episodes (RDMA retransmissions
and CNPs up on every node of a job, which peer z-scores should discount), and random telemetry dropouts.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.predictor.catalog import CATALOG, MetricKind
from trainguard.predictor.errors import DataFormatError
from trainguard.predictor.table import EventTable, MetricTable

#: Faults, servers and days of the published trace (its README).
STEPFUN_FAULTS, STEPFUN_SERVERS, STEPFUN_DAYS = 584, 400, 348.98


def default_trace_dir() -> Path:
    """The StepFun trace folder, found the way every trainguard command finds it
    (:func:`trainguard.drill.trace.trace_dir`: ``$TRAINGUARD_FAULT_TRACE_DIR``, the wheel's copy, the workspace)."""
    from trainguard.drill.trace import trace_dir

    return trace_dir()


@dataclass(frozen=True)
class Family:
    """A precursor shape.

    Attributes:
        name: family name.
        onset_min: (low, high) minutes before the failure the precursor starts (uniform).
        tau_min: (low, high) growth time constant, minutes (exponential ramp toward the failure).
        peak: (low, high) peak amplitude at the failure, in the family's unit (per-minute rate, degC, fraction).
    """

    name: str
    onset_min: tuple[float, float]
    tau_min: tuple[float, float]
    peak: tuple[float, float]


FAMILIES: dict[str, Family] = {
    "ecc": Family("ecc", (60, 240), (10, 40), (3, 60)),  # corrected ECC errors per minute
    "xid": Family("xid", (15, 60), (5, 20), (0.3, 4)),  # XID events per minute
    "pcie": Family("pcie", (30, 120), (10, 30), (2, 40)),  # replays per minute (AER corrected ~ 1/3)
    "link": Family("link", (20, 90), (8, 30), (5, 100)),  # symbol errors per minute (FEC x 200)
    "thermal": Family("thermal", (20, 60), (10, 30), (8, 25)),  # degC above normal
    "step": Family("step", (20, 90), (15, 40), (0.05, 0.4)),  # relative step-time increase
    "telemetry": Family("telemetry", (10, 40), (5, 15), (0.2, 0.7)),  # fraction of samples lost
}

#: Decoy episodes last this many minutes (uniform) and reach this fraction of a real precursor's peak.
DECOY_LENGTH_MIN = (3.0, 20.0)
DECOY_SCALE = (0.02, 0.2)

#: StepFun fault description -> (precursor family or None, probability a fault shows it).
KIND_FAMILY: dict[str, tuple[str | None, float]] = {
    "GPU DBE(Double Bit ECC) > Threshold": ("ecc", 0.8),
    "GPU SBE(Single Bit ECC) > Threshold": ("ecc", 0.8),
    "GPU xid Error": ("xid", 0.7),
    "GPU PCI link width low": ("pcie", 0.7),
    "NIC PCI link Width low": ("pcie", 0.7),
    "Link Down": ("link", 0.7),
    "NIC Link Speed low": ("link", 0.7),
    "Remote Optical Module Failure": ("link", 0.7),
    "GPU Temperature High": ("thermal", 0.7),
    "Speed Critical (Sensor)": ("thermal", 0.7),
    "GPU P2P Bandwidth Low": ("step", 0.6),
    "Suspect Machine Offline": ("step", 0.6),
    "nvidia-smi Timeout": ("telemetry", 0.7),
}
#: Fan "Redundancy Lost" shares its Desc with power supplies; the class decides (see :func:`_family_of`).


def _family_of(cls: str, desc: str) -> tuple[str | None, float]:
    if cls == "Fan":
        return ("thermal", 0.7)
    return KIND_FAMILY.get(desc, (None, 0.0))


#: Extra columns the rules tier reads (not features): set at the last sample before a fatal fault.
RULE_COLUMNS = ("gpu_xid_48_total", "gpu_xid_63_total", "gpu_xid_79_total", "pcie_aer_fatal_total",
                "pcie_link_width", "pcie_link_width_max", "nic_up")


@dataclass(frozen=True)
class FaultKind:
    """One fault kind of the trace with its count and repair durations (days)."""

    level: str
    cls: str
    desc: str
    count: int
    repair_days: tuple[float, ...]


def load_stepfun(trace_dir: str | Path | None = None) -> list[FaultKind]:
    """Reads the fault kinds, counts and repair durations of StepFun's trace.

    Args:
        trace_dir: folder holding ``fault_trace.json`` (default :func:`default_trace_dir`).

    Returns:
        Fault kinds, most frequent first.

    Raises:
        DataFormatError: the trace is absent or malformed.
    """
    path = Path(trace_dir) if trace_dir is not None else default_trace_dir()
    f = path / "fault_trace.json"
    try:
        events = json.loads(f.read_text())
    except OSError as exc:
        raise DataFormatError(f"{f}: StepFun fault trace not found; pass --trace DIR (or set "
                              "TRAINGUARD_FAULT_TRACE_DIR) to the folder holding fault_trace.json") from exc
    except json.JSONDecodeError as exc:
        raise DataFormatError(f"{f}: not valid JSON; restore the published fault_trace.json") from exc
    counts: Counter[tuple[str, str, str]] = Counter()
    open_: dict[tuple[str, str, str, str], float] = {}
    repairs: dict[tuple[str, str, str], list[float]] = {}
    try:
        for e in events:
            ft = e["fault_type"]
            k = (ft["Level"], ft["Class"], ft["Desc"])
            if not isinstance(ft["Desc"], str) or not ft["Desc"].strip():
                # it becomes the kind of the generated events, which refuse an empty one: said here, before
                # minutes of generation, not after them
                raise DataFormatError(f"{f}: a {e['event_type']} event of node {e.get('node_id')!r} has no fault "
                                      "Desc; expected the published StepFun format")
            if e["event_type"] == "fault_start":
                counts[k] += 1
                open_[(e["node_id"],) + k] = float(e["event_time"])
            elif e["event_type"] == "fault_end":
                start = open_.pop((e["node_id"],) + k, None)
                if start is not None:
                    repairs.setdefault(k, []).append(float(e["event_time"]) - start)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataFormatError(f"{f}: unexpected event layout ({exc}); expected the published StepFun format") from exc
    return [FaultKind(*k, c, tuple(repairs.get(k, [0.85]))) for k, c in counts.most_common()]


@dataclass(frozen=True)
class TraceConfig:
    """Parameters of a synthetic trace.

    Attributes:
        n_nodes: nodes (default 16).
        days: simulated days (default 2.0).
        interval_s: sampling interval, seconds (default 30).
        job_size: nodes per job; peers are nodes of the same job (default 8).
        rate_scale: multiplier of StepFun's fault rate of 0.0042 per node-day (default 1.0).
        repair_scale: multiplier of the trace's repair durations (default 1.0); a repair lasts >= 10 min.
        decoy_rate: benign precursor-like episodes per node-day (default 1.0).
        congestion_rate: job-wide congestion episodes per job-day (default 2.0).
        dropout_rate: benign telemetry dropouts (1-4 missed samples) per node-day (default 4.0).
        nan_prob: probability that a single cell is missing (default 0.001).
        rule_columns: also emit the rules-tier columns (:data:`RULE_COLUMNS`) (default True).
        seed: random seed (default 0).
        start_ts: Unix time of the first sample (default 1.7e9).
        trace_dir: StepFun trace folder (default :func:`default_trace_dir`).
    """

    n_nodes: int = 16
    days: float = 2.0
    interval_s: float = 30.0
    job_size: int = 8
    rate_scale: float = 1.0
    repair_scale: float = 1.0
    decoy_rate: float = 1.0
    congestion_rate: float = 2.0
    dropout_rate: float = 4.0
    nan_prob: float = 0.001
    rule_columns: bool = True
    seed: int = 0
    start_ts: float = 1.7e9
    trace_dir: str | None = None


@dataclass(frozen=True)
class FaultRecord:
    """Ground truth of one generated fault.

    Attributes:
        node: node name.
        ts: failure time (fault_start), seconds.
        level, cls, desc: StepFun fault type.
        family: precursor family of the kind, or None.
        predictable: whether this instance shows its precursor.
        precursor_start: when its precursor begins, seconds (None when not predictable).
        repair_s: downtime after the failure, seconds.
    """

    node: str
    ts: float
    level: str
    cls: str
    desc: str
    family: str | None
    predictable: bool
    precursor_start: float | None
    repair_s: float


@dataclass
class Trace:
    """A generated trace: metrics, observed failures and their ground truth."""

    config: TraceConfig
    metrics: MetricTable
    events: EventTable
    faults: list[FaultRecord] = field(default_factory=list)

    def predictable_keys(self) -> set[tuple[str, float]]:
        """(node, time) of the faults that show a precursor."""
        return {(f.node, f.ts) for f in self.faults if f.predictable}

    def save(self, folder: str | Path) -> None:
        """Writes ``metrics.csv``, ``events.csv`` and ``faults.json`` (ground truth + config) into a folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.metrics.to_csv(folder / "metrics.csv")
        self.events.to_csv(folder / "events.csv")
        (folder / "faults.json").write_text(json.dumps(
            {"config": asdict(self.config), "faults": [asdict(f) for f in self.faults]}, indent=1))


def _ramp(t: np.ndarray, f: float, onset: float, tau: float) -> np.ndarray:
    """0 before ``onset``, then exp((t - f) / tau) (1 at the failure), shape of t."""
    r = np.exp(np.minimum(t - f, 0.0) / tau)
    return np.where((t >= onset) & (t < f), r, 0.0)


class _NodeSim:
    """Rates and levels of one node, built up by adding effects, then sampled."""

    COLS = [m.name for m in CATALOG]

    def __init__(self, t: np.ndarray, rng: np.random.Generator, job_step: np.ndarray) -> None:
        self.t, self.rng = t, rng
        n = len(t)
        het = lambda s: float(rng.lognormal(0.0, s))  # noqa: E731 - node heterogeneity factor
        per_min = {  # healthy base rates per minute
            "gpu_ecc_sbe_total": 0.002 * het(1.5), "gpu_ecc_dbe_total": 0.0, "gpu_xid_total": 0.0005 * het(1.0),
            "pcie_replay_total": 0.01 * het(1.0), "pcie_aer_corrected_total": 0.005 * het(1.0),
            "nic_symbol_errors_total": 0.02 * het(1.0), "nic_fec_corrected_total": 50.0 * het(0.5),
            "nic_carrier_changes_total": 0.0, "rdma_retrans_total": 5.0 * het(0.5), "rdma_cnp_total": 100.0 * het(0.5),
        }
        self.rate = {k: np.full(n, v) for k, v in per_min.items()}
        day = 2 * np.pi * (t - t[0]) / 86400.0
        self.temp = 65.0 + rng.normal(0, 3) + 2.0 * np.sin(day + rng.uniform(0, 6)) + rng.normal(0, 1.0, n)
        self.remap = np.zeros(n)
        self.step_rel = np.ones(n)
        self.step_noise = rng.normal(0, 0.01, n)
        self.job_step = job_step
        self.drop = np.zeros(n, dtype=bool)
        self.gpu_nan = np.zeros(n, dtype=bool)

    def add_family(self, fam: str, f: float, onset: float, tau: float, peak: float) -> None:
        t, rng = self.t, self.rng
        r = _ramp(t, f, onset, tau)
        if fam == "ecc":
            self.rate["gpu_ecc_sbe_total"] += peak * r
            # pending row remaps step up a few times during the second half of the precursor
            k = int(rng.integers(1, 4))
            for ts in rng.uniform(onset + 0.5 * (f - onset), f, k):
                self.remap[t >= ts] += 1
        elif fam == "xid":
            # bursts: the rate is on only in a random half of the intervals, denser toward the failure
            on = rng.random(len(t)) < 0.5
            self.rate["gpu_xid_total"] += peak * r * on
        elif fam == "pcie":
            self.rate["pcie_replay_total"] += peak * r
            self.rate["pcie_aer_corrected_total"] += peak / 3.0 * r
        elif fam == "link":
            self.rate["nic_symbol_errors_total"] += peak * r
            self.rate["nic_fec_corrected_total"] += 200.0 * peak * r
            self.rate["rdma_retrans_total"] += 5.0 * peak * r
            # carrier flaps in the last 20 minutes: each adds an expected 2 changes (down, up) in one interval
            flaps = max(1, int(peak / 20))
            dt_min = (t[1] - t[0]) / 60.0 if len(t) > 1 else 1.0
            for ts in rng.uniform(max(onset, f - 1200.0), f, flaps):
                i = int(np.searchsorted(t, ts))
                if i < len(t):
                    self.rate["nic_carrier_changes_total"][i] += 2.0 / dt_min
        elif fam == "thermal":
            self.temp += peak * np.where((t >= onset) & (t < f), np.minimum((t - onset) / max(f - onset, 1), 1), 0) ** 1.5
        elif fam == "step":
            self.step_rel += peak * r
            self.rate["rdma_retrans_total"] += 2.0 * peak * 10 * r
        elif fam == "telemetry":
            lost = rng.random(len(t)) < peak * r
            self.drop |= lost
            self.gpu_nan |= rng.random(len(t)) < peak * r
            self.step_rel += 0.1 * peak * r

    def sample(self, dt: float, nan_prob: float) -> np.ndarray:
        t, rng = self.t, self.rng
        out = np.empty((len(t), len(self.COLS)))
        throttle = np.clip((self.temp - 83.0) / 10.0, 0.0, 1.0)
        for j, m in enumerate(CATALOG):
            if m.kind is MetricKind.COUNTER:
                out[:, j] = np.cumsum(rng.poisson(np.maximum(self.rate[m.name], 0.0) * dt / 60.0))
            elif m.name == "gpu_temp_c":
                out[:, j] = np.round(self.temp, 1)
            elif m.name == "gpu_throttle_frac":
                out[:, j] = np.round(throttle, 3)
            elif m.name == "gpu_row_remap_pending":
                out[:, j] = self.remap
            elif m.name == "step_time_s":
                out[:, j] = self.job_step * (self.step_rel + throttle * 0.3) + self.step_noise
        gpu_cols = [j for j, m in enumerate(CATALOG) if m.name.startswith("gpu_")]
        out[np.ix_(self.gpu_nan, gpu_cols)] = np.nan
        out[rng.random(out.shape) < nan_prob] = np.nan
        return out


_FATAL_SIGNATURE: dict[str, dict[str, float]] = {  # last sample before a failure: what the rules tier sees
    "ecc": {"gpu_xid_48_total": 1, "gpu_xid_63_total": 1},
    "GPU Lost": {"gpu_xid_79_total": 1},
    "GPU device not found": {"gpu_xid_79_total": 1},
    "pcie": {"pcie_aer_fatal_total": 1, "pcie_link_width": 8},
    "link": {"nic_up": 0},
    "NIC Lost": {"nic_up": 0},
}


def generate(cfg: TraceConfig) -> Trace:
    """Generates a trace (see the module docstring for the model).

    Args:
        cfg: parameters.

    Returns:
        The trace: metrics of every node, failure events, ground truth.

    Raises:
        DataFormatError: the StepFun trace cannot be read.
    """
    kinds = load_stepfun(cfg.trace_dir)
    total = sum(k.count for k in kinds)
    probs = np.array([k.count / total for k in kinds])
    rate_per_s = STEPFUN_FAULTS / (STEPFUN_SERVERS * STEPFUN_DAYS) * cfg.rate_scale / 86400.0
    rng = np.random.default_rng(cfg.seed)
    dt = cfg.interval_s
    t = cfg.start_ts + np.arange(int(cfg.days * 86400 / dt)) * dt
    end = t[-1] + dt
    n_jobs = max(1, -(-cfg.n_nodes // cfg.job_size))
    job_steps = []
    for _ in range(n_jobs):  # job-wide step time: base + slow wander; congestion episodes raise it for all
        base = rng.uniform(0.8, 1.5) * (1 + 0.02 * np.sin(2 * np.pi * (t - t[0]) / rng.uniform(3600, 14400)))
        job_steps.append(base)
    congestion = []
    for j in range(n_jobs):
        k = rng.poisson(cfg.congestion_rate * cfg.days)
        congestion.append([(s, s + rng.uniform(300, 2400), rng.uniform(2, 20)) for s in rng.uniform(t[0], end, k)])
        for s, e, amp in congestion[j]:
            job_steps[j] = job_steps[j] * (1 + 0.1 * ((t >= s) & (t < e)))
    blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    faults: list[FaultRecord] = []
    extra_names = list(RULE_COLUMNS) if cfg.rule_columns else []
    for i in range(cfg.n_nodes):
        node = f"node{i:04d}"
        j = i // cfg.job_size
        sim = _NodeSim(t, rng, job_steps[j])
        for s, e, amp in congestion[j]:
            win = (t >= s) & (t < e)
            sim.rate["rdma_retrans_total"][win] *= amp
            sim.rate["rdma_cnp_total"][win] *= amp
        # decoys: benign, shorter and weaker episodes of random families
        for _ in range(rng.poisson(cfg.decoy_rate * cfg.days)):
            fam = FAMILIES[str(rng.choice(list(FAMILIES)))]
            peak_t = rng.uniform(t[0], end)
            length = rng.uniform(*DECOY_LENGTH_MIN) * 60.0
            sim.add_family(fam.name, peak_t, peak_t - length, rng.uniform(*fam.tau_min) * 60.0,
                           rng.uniform(*fam.peak) * rng.uniform(*DECOY_SCALE))
        # failures and repairs: a Poisson process paused while the node is down
        down = np.zeros(len(t), dtype=bool)
        segment = np.zeros(len(t), dtype=np.int64)  # counters restart after each repair
        extra = np.zeros((len(t), len(extra_names)))
        if cfg.rule_columns:
            extra[:, extra_names.index("pcie_link_width")] = 16
            extra[:, extra_names.index("pcie_link_width_max")] = 16
            extra[:, extra_names.index("nic_up")] = 1
        clock = t[0]
        while rate_per_s > 0:
            clock += rng.exponential(1.0 / rate_per_s)
            if clock >= end:
                break
            k = kinds[int(rng.choice(len(kinds), p=probs))]
            fam_name, p = _family_of(k.cls, k.desc)
            repair = max(600.0, float(rng.choice(k.repair_days)) * 86400.0 * cfg.repair_scale)
            predictable = fam_name is not None and rng.random() < p
            onset = None
            if predictable:
                fam = FAMILIES[fam_name]
                onset = clock - rng.uniform(*fam.onset_min) * 60.0
                sim.add_family(fam_name, clock, onset, rng.uniform(*fam.tau_min) * 60.0, rng.uniform(*fam.peak))
            if cfg.rule_columns:
                last = np.searchsorted(t, clock, side="left") - 1
                # the failure itself shows in the rules-tier columns (its kind's, else its family's signature)
                sig = _FATAL_SIGNATURE.get(k.desc, _FATAL_SIGNATURE.get(fam_name or "", {}))
                if last >= 0:
                    for col, v in sig.items():
                        c = extra_names.index(col)
                        if col.endswith("_total"):
                            extra[last:, c] += v
                        else:
                            extra[last, c] = v
            faults.append(FaultRecord(node, float(clock), k.level, k.cls, k.desc, fam_name, predictable, onset, repair))
            win = (t >= clock) & (t < clock + repair)
            down |= win
            segment[t >= clock + repair] += 1
            clock += repair
        sim.drop |= _dropouts(t, rng, cfg.dropout_rate, cfg.days)
        values = sim.sample(dt, cfg.nan_prob)
        # counters restart from zero after a repair
        ci = [c for c, m in enumerate(CATALOG) if m.kind is MetricKind.COUNTER]
        for seg in range(1, int(segment.max()) + 1):
            rows = np.flatnonzero(segment == seg)
            if len(rows):
                base = np.nan_to_num(values[rows[0] - 1, ci]) if rows[0] > 0 else 0.0
                values[np.ix_(rows, ci)] -= base
        if cfg.rule_columns:
            for c, name in enumerate(extra_names):
                if name.endswith("_total"):
                    for seg in range(1, int(segment.max()) + 1):
                        rows = np.flatnonzero(segment == seg)
                        if len(rows):
                            extra[rows, c] = 0.0
            values = np.hstack([values, extra])
        keep = ~down & ~sim.drop
        keep[0] |= not down[0]
        blocks.append((t[keep], np.full(int(keep.sum()), node, dtype=object), np.full(int(keep.sum()), f"job{j}", dtype=object), values[keep]))
    columns = [m.name for m in CATALOG] + extra_names
    metrics = MetricTable(
        columns, np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks]),
        np.vstack([b[3] for b in blocks]), np.concatenate([b[2] for b in blocks]),
    )
    faults.sort(key=lambda f: f.ts)
    events = EventTable(np.array([f.ts for f in faults]), np.array([f.node for f in faults], dtype=object),
                        np.array([f.desc for f in faults], dtype=object))
    return Trace(cfg, metrics, events, faults)


def shifted_fleet(seed: int, n_nodes: int) -> tuple[MetricTable, Trace]:
    """A fleet generated differently from the default one, to test that a model transfers: ``n_nodes`` x 6 days
    at 60 s with 3x the benign decoys, 2x the congestion, 3x the telemetry dropouts, jobs of 4, and each node's
    GPU temperature offset (+-10 C) and step time scaled (0.6-1.6x), both with a daily pattern.

    Returns:
        The shifted metrics, and the generated trace (its events and faults; its ``metrics`` are unshifted).
    """
    tr = generate(TraceConfig(n_nodes=n_nodes, days=6, interval_s=60, rate_scale=100, repair_scale=0.05, seed=seed,
                              decoy_rate=3, congestion_rate=4, dropout_rate=12, job_size=4))
    mt = tr.metrics
    vals = mt.values.copy()
    rng = np.random.default_rng(seed)
    for node in np.unique(mt.node.astype(str)):
        r = mt.node.astype(str) == node
        day = np.sin(2 * np.pi * mt.ts[r] / 86400.0)
        j = mt.columns.index("gpu_temp_c")
        vals[r, j] += rng.uniform(-10, 10) + 3.0 * day
        j = mt.columns.index("step_time_s")
        vals[r, j] *= rng.uniform(0.6, 1.6) * (1 + 0.05 * day)
    return MetricTable(mt.columns, mt.ts, mt.node, vals, mt.job), tr


def _dropouts(t: np.ndarray, rng: np.random.Generator, per_day: float, days: float) -> np.ndarray:
    drop = np.zeros(len(t), dtype=bool)
    for s in rng.integers(0, len(t), rng.poisson(per_day * days)):
        drop[s : s + int(rng.integers(1, 5))] = True
    return drop


def stepfun_summary(trace_dir: str | Path | None = None) -> dict[str, Any]:
    """Fault counts per precursor family in the real trace (for documentation and tests).

    Returns:
        ``{"total": 584, "rate_per_node_day": ..., "families": {family or "none": count}, "predictable_share": ...}``
        where the share weights each kind by its family's probability ``p``.
    """
    kinds = load_stepfun(trace_dir)
    fam: Counter[str] = Counter()
    expected = 0.0
    for k in kinds:
        name, p = _family_of(k.cls, k.desc)
        fam[name or "none"] += k.count
        expected += k.count * p
    total = sum(k.count for k in kinds)
    return {
        "total": total, "rate_per_node_day": STEPFUN_FAULTS / (STEPFUN_SERVERS * STEPFUN_DAYS),
        "families": dict(fam), "predictable_share": expected / total,
    }
