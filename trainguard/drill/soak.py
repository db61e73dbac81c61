"""The soak drill: a real training job under ``trainguard run`` with faults drawn from the StepFun trace.

A 2-worker DDP job (:mod:`trainguard.drill.soak_worker`, gloo on CPU) runs under ``trainguard run`` for about
``wall_s`` seconds. Its fault schedule comes from the StepFun trace as a job of ``represent_gpus`` GPUs lives it
(the trace scaled to that many nodes, see :meth:`FaultTrace.for_job`), a window starting at a seeded random
offset, with time compressed by a factor chosen so the window holds ``trace_faults`` faults on average: the kinds,
their order and their relative spacing are the trace's. Each fault class maps to what can be injected here for
real, or is skipped with the reason:

=============  =====================================================================================
class          injected as
=============  =====================================================================================
crash          SIGKILL of a random worker (from outside, like the kernel's OOM killer)
node_fault     SIGKILL of a random worker (the Xid kills the process; no spare node here to swap in)
hang           SIGSTOP of a random worker; the agent's process detector finds it (``trainguard run
               --hang-floor-s hang_bound_s``) and restarts the generation
node_down      skipped: see :data:`SKIPPED`
link           skipped
degraded       skipped
=============  =====================================================================================

With ``nodes`` >= 2 the drill runs on a small cluster instead (standalone coordinator, node agents in network
namespaces with fake hardware trees, spares) where every class is injected for real: see
:mod:`trainguard.drill.soak_cluster`.

``extra`` kinds are injected once each on top, at evenly spaced free moments, so every drill exercises them:
``stop`` (a hang, as above), ``kill`` and ``enospc`` (the checkpoint directory is a small tmpfs mounted by the
drill, filled to ENOSPC for ``enospc_window_s``, then freed; training must go on and saves must resume).

When the wall time is up the drill writes the step count (current step + a margin) to a stop file the workers
read, the job finishes, and a fault-free run of the same number of steps (no delay, no checkpoints) must end with
bitwise-equal parameters. ETTR = steps x fault-free step time / wall time, where the fault-free step time is the
median step-to-step time of the run itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainguard.drill.errors import SoakError
from trainguard.faultfacts.taxonomy import FaultClass
from trainguard.drill.trace import FaultTrace, load_stepfun

log = logging.getLogger(__name__)

#: Fault classes the drill cannot inject yet, and why (printed in every report).
SKIPPED: dict[str, str] = {
    FaultClass.NODE_DOWN.value: "a single-node drill has no second node agent or spare; a cluster drill "
                                "(--nodes 2) kills a node agent and a spare takes its place",
    FaultClass.LINK.value: "a single-node drill's workers share the host namespace; a cluster drill (--nodes 2) "
                           "takes a node's data link down between network namespaces",
    FaultClass.DEGRADED.value: "a single-node drill has no spare to drain to; a cluster drill (--nodes 2) writes "
                               "the predictor's precursor signals into each node's fake hardware tree",
    "coordinator_kill": "the coordinator is embedded in the single-node `trainguard run` process; a cluster drill "
                        "(--nodes 2 --extra coordinator) kills and restarts its standalone coordinator",
}

INJECTED: dict[str, str] = {
    FaultClass.CRASH.value: "kill",
    FaultClass.NODE_FAULT.value: "kill",
    FaultClass.HANG.value: "stop",
}

#: Cluster drills (``nodes`` >= 2, :mod:`trainguard.drill.soak_cluster`) inject every class for real.
CLUSTER_INJECTED: dict[str, str] = {
    FaultClass.CRASH.value: "kill",
    FaultClass.NODE_FAULT.value: "hwfault",
    FaultClass.HANG.value: "stop",
    FaultClass.NODE_DOWN.value: "agentkill",
    FaultClass.LINK.value: "linkdown",
    FaultClass.DEGRADED.value: "precursor",
}

EXTRA_KINDS = ("kill", "stop", "enospc")
#: Heartbeat interval of the cluster drill's coordinator, seconds.
CLUSTER_HEARTBEAT_S = 0.2
CLUSTER_EXTRA_KINDS = EXTRA_KINDS + ("hwfault", "agentkill", "linkdown", "precursor", "coordinator")
NO_NETNS_REASON = ("the nodes run on loopback (--no-netns): there is no separate data link to take down; run as "
                   "root with network namespaces")
STOP_MARGIN_STEPS = 30


@dataclass
class SoakConfig:
    """Settings of one soak drill.

    Attributes:
        wall_s: how long the faulted job trains before the drill asks it to finish, seconds. Default 180.
        nproc: workers. Default 2.
        step_delay_s: extra seconds per step, to mimic compute. Default 0.1.
        save_every: checkpoint every N steps. Default 10.
        trace_faults: mean number of trace faults in the drill window (sets the time compression). Default 8.
        represent_gpus: size of the job whose fault stream is replayed, GPUs. Default 16,384.
        gpus_per_node: GPUs per node of that job. Default 8.
        extra: kinds injected once each on top of the trace's (``kill``, ``stop``, ``enospc``).
            Default ``("stop", "enospc")``.
        hang_bound_s: the agent's hang floor (``--hang-floor-s``; production default 60 s). Default 15.
        enospc_window_s: how long the checkpoint directory stays full, seconds. Default 10.
        tmpfs_mib: size of the checkpoint tmpfs, MiB. Default 16.
        seed: seeds the trace window and the victim ranks. Default 0.
        trace_dir: StepFun trace folder (default: see :func:`trainguard.drill.trace.trace_dir`).
        workdir: where logs and checkpoints go (default: a fresh temp folder, removed at the end).
        max_restarts: restart budget of the job. Default 50.
        verify: run the fault-free reference and compare parameters. Default True.
        nodes: 0 runs the job under one ``trainguard run`` with ``nproc`` workers; >= 2 runs it on that many node
            agents with one worker each, a standalone coordinator and spares (:mod:`trainguard.drill.soak_cluster`).
            Default 0.
        spares: spare node agents kept ready (cluster drills). Default 1.
        netns: put every node in its own network namespace (cluster drills; needs root). Default True.
        lease_timeout_s: the coordinator's lease timeout, seconds (production default 10). Default 3.
        drain_grace_s: seconds between a predictor alarm's checkpoint advisory and the drain request
            (``trainguard run --drain-grace-s``; production default 30). Default 2.
        precursor_lead_s: drill seconds between a precursor and the fault it announces. Default 10.
        memory_tier: the nodes' ``trainguard run --memory-tier`` (cluster drills): ``job`` restores from every
            node's memory and buddies' replicas; ``host`` is the behaviour before (disk after any multi-node
            fault). Default ``job``.
        strike_after_replication: inject a restarting fault only once every rank's newest snapshot lies in
            another node's memory as a verified replica (cluster drills with the job memory tier; pins a test to
            "the snapshot had replicated": on a loaded machine the niced persist process alone can take longer
            than a save interval to publish a snapshot). Default False (any time).
        early_reference: start the fault-free reference as soon as the stop step is written, so its start-up
            (seconds of interpreter and torch imports) overlaps the faulted job's last steps instead of following
            them. Its imports then compete with those steps for the CPU, which lowers the measured ETTR a little:
            meant for short drills and tests, not for figures. Default False (after the job ended).
    """

    wall_s: float = 180.0
    nproc: int = 2
    step_delay_s: float = 0.1
    save_every: int = 10
    trace_faults: float = 8.0
    represent_gpus: int = 16_384
    gpus_per_node: int = 8
    extra: tuple[str, ...] = ("stop", "enospc")
    hang_bound_s: float = 15.0
    enospc_window_s: float = 10.0
    tmpfs_mib: int = 16
    seed: int = 0
    trace_dir: str | None = None
    workdir: str | None = None
    max_restarts: int = 50
    verify: bool = True
    nodes: int = 0
    spares: int = 1
    netns: bool = True
    lease_timeout_s: float = 3.0
    drain_grace_s: float = 2.0
    precursor_lead_s: float = 10.0
    memory_tier: str = "job"
    strike_after_replication: bool = False
    early_reference: bool = False

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            SoakError: a value out of range or an unknown extra kind.
        """
        # Named by their `trainguard drill` flags. A NaN passes every comparison and an infinite span never ends
        # (a drill of --minutes inf trained until killed), so each is checked finite first.
        seconds = {"--minutes": self.wall_s, "--step-delay": self.step_delay_s, "--trace-faults": self.trace_faults,
                   "--hang-bound": self.hang_bound_s, "--enospc-window": self.enospc_window_s,
                   "--lease-timeout": self.lease_timeout_s, "--drain-grace": self.drain_grace_s,
                   "--precursor-lead": self.precursor_lead_s}
        bad = [f"{flag} {value:g}: must be a finite number" for flag, value in seconds.items()
               if not math.isfinite(value)]
        if bad:
            raise SoakError("; ".join(bad))
        bad = [why for wrong, why in (
            (self.wall_s <= 0, f"--minutes {self.wall_s / 60:g}: must be > 0"),
            (self.nproc < 2, f"--nproc {self.nproc}: the drill needs at least 2 workers"),
            (self.step_delay_s < 0, f"--step-delay {self.step_delay_s:g}: must be >= 0 seconds"),
            (self.save_every < 1, f"--save-every {self.save_every}: must be >= 1 step"),
            (self.trace_faults < 0, f"--trace-faults {self.trace_faults:g}: must be >= 0"),
            (self.hang_bound_s <= 0, f"--hang-bound {self.hang_bound_s:g}: must be > 0 seconds"),
            (self.enospc_window_s <= 0, f"--enospc-window {self.enospc_window_s:g}: must be > 0 seconds"),
            (self.tmpfs_mib < 1, f"tmpfs_mib {self.tmpfs_mib}: must be >= 1"),
            (self.represent_gpus < 1, f"--represent-gpus {self.represent_gpus}: must be >= 1 GPU"),
            # checked here: a file there failed only after the trace was loaded, with a FileExistsError traceback
            (self.workdir is not None and os.path.exists(self.workdir) and not os.path.isdir(self.workdir),
             f"--workdir {self.workdir}: is a file, not a folder; name a folder (it is created if missing)"),
        ) if wrong]
        if bad:
            raise SoakError("; ".join(bad))
        kinds = CLUSTER_EXTRA_KINDS if self.nodes else EXTRA_KINDS
        bad = set(self.extra) - set(kinds)
        if bad:
            hint = " (the others need a cluster drill: --nodes 2 or more)" if not self.nodes else ""
            raise SoakError(f"unknown extra fault kind(s) {sorted(bad)}; use {', '.join(kinds)}{hint}")
        if self.nodes == 1 or self.nodes < 0:
            raise SoakError(f"nodes must be 0 (one node, --nproc workers) or >= 2, got {self.nodes}")
        if self.nodes:
            bad = [why for wrong, why in (
                (self.spares < 1, f"--spares {self.spares}: a cluster drill needs at least 1 spare"),
                (self.lease_timeout_s <= 2 * CLUSTER_HEARTBEAT_S,
                 f"--lease-timeout {self.lease_timeout_s:g}: must exceed two of the drill's "
                 f"{CLUSTER_HEARTBEAT_S:g} s heartbeat intervals"),
                (self.drain_grace_s < 0, f"--drain-grace {self.drain_grace_s:g}: must be >= 0 seconds"),
                (self.precursor_lead_s <= 0, f"--precursor-lead {self.precursor_lead_s:g}: must be > 0 seconds"),
                (self.memory_tier not in ("job", "host"), f"--memory-tier {self.memory_tier}: use job or host"),
                (self.strike_after_replication and self.memory_tier != "job",
                 "strike_after_replication needs the job memory tier (replicas)"),
            ) if wrong]
            if bad:
                raise SoakError("; ".join(bad))
        if self.nodes and not self.netns and "linkdown" in self.extra:
            raise SoakError("the linkdown fault needs network namespaces; drop it from --extra or drop --no-netns")


@dataclass
class PlannedFault:
    """One fault of the schedule.

    Attributes:
        at_s: drill time (seconds after the first step) it is due.
        kind: ``kill``, ``stop``, ``enospc``, or ``skip``.
        fault_class: the trace's class (or ``extra``).
        label: the trace's name for it.
        reason: why it was skipped.
    """

    at_s: float
    kind: str
    fault_class: str
    label: str
    reason: str = ""


@dataclass
class FaultOutcome:
    """What happened to one injected fault (drill times in seconds after the first step).

    Attributes:
        kind, fault_class, label: as planned.
        planned_s: when it was due; injected_s: when it struck (later if a recovery was still running).
        rank: victim rank (-1 for enospc and coordinator).
        node: victim node (cluster drills).
        predicted: for a precursor: whether the node was replaced before the announced fault struck.
        generation: generation it struck.
        detected_s: detection latency (agent saw the exit / detector flagged the hang / the hook logged the error).
        recovery_s: fault to first step of the next generation (enospc: space freed to the next committed save).
        steps_lost: steps done again after the restart.
        level: recovery level (``process``, ``node``; ``none`` for enospc and coordinator, where training goes on).
        restore_tiers: rank -> the checkpoint tier its restore in the next generation read (``memory``, ``disk``,
            ``remote``), from the workers' ``rank<R>.restores`` lines.
        restore_s: the slowest rank's restore time in the next generation, seconds.
    """

    kind: str
    fault_class: str
    label: str
    planned_s: float
    injected_s: float
    rank: int = -1
    generation: int = 0
    detected_s: float | None = None
    recovery_s: float | None = None
    steps_lost: int | None = None
    level: str = "process"
    node: str = ""
    predicted: bool | None = None
    restore_tiers: dict[int, str] = field(default_factory=dict)
    restore_s: float | None = None


@dataclass
class SoakReport:
    """Outcome of a soak drill."""

    config: dict
    compression: float
    window_days: tuple[float, float]
    steps: int
    wall_s: float
    step_time_s: float
    ettr: float
    ettr_steady: float
    generations: int
    exit_code: int
    faults: list[FaultOutcome]
    skipped: list[PlannedFault]
    skip_reasons: dict[str, str]
    params_sha256: str
    reference_sha256: str | None
    equal_to_reference: bool | None
    stall_s: float | None
    timeline: list[tuple[float, int, int]] = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-ready."""
        d = asdict(self)
        d["timeline"] = []  # large; the plot holds it
        return d


class _StepLog:
    """Reads the workers' step lines incrementally."""

    def __init__(self, events: Path, nproc: int) -> None:
        self._files = [events / f"rank{r}.steps" for r in range(nproc)]
        self._pos = [0] * nproc
        self.rows: list[list[tuple[float, int, int, int, float, int]]] = [[] for _ in range(nproc)]

    def poll(self) -> None:
        for r, path in enumerate(self._files):
            try:
                with open(path) as f:
                    f.seek(self._pos[r])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind("\n")
            if end < 0:
                continue
            self._pos[r] += end + 1
            for line in data[:end].splitlines():
                p = line.split()
                if len(p) == 6:
                    self.rows[r].append((float(p[0]), int(p[1]), int(p[2]), int(p[3]), float(p[4]), int(p[5])))

    def last(self, rank: int) -> tuple[float, int, int, int, float, int] | None:
        return self.rows[rank][-1] if self.rows[rank] else None

    def generation(self) -> int:
        return max((rows[-1][1] for rows in self.rows if rows), default=0)

    def max_step(self) -> int:
        return max((rows[-1][2] for rows in self.rows if rows), default=-1)


def read_restores(events: Path, nproc: int, generation: int) -> tuple[dict[int, str], float | None]:
    """(rank -> tier, slowest restore seconds) of the restores the workers logged in ``generation``."""
    tiers: dict[int, str] = {}
    slowest = None
    for r in range(nproc):
        for line in _read_lines(events / f"rank{r}.restores"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("generation") == generation:
                tiers[r] = str(rec.get("tier"))
                slowest = max(slowest or 0.0, float(rec.get("restore_s", 0.0)))
    return tiers, slowest


def load_schedule(cfg: SoakConfig, progress) -> tuple[list[PlannedFault], list[PlannedFault], float,
                                                      tuple[float, float]]:
    """Loads the trace and plans the drill, announcing the schedule through ``progress``.

    Returns:
        (faults to inject, faults skipped, time compression, replayed window in days).

    Raises:
        SoakError: the trace cannot be loaded.
    """
    schedule, compression, window = plan_schedule(load_stepfun(cfg.trace_dir), cfg)
    skipped = [p for p in schedule if p.kind == "skip"]
    todo = [p for p in schedule if p.kind != "skip"]
    if compression:
        where = (f"; {cfg.nodes} nodes + {cfg.spares} spare(s) " + ("in network namespaces" if cfg.netns
                                                                    else "on loopback")) if cfg.nodes else ""
        progress(f"schedule: StepFun trace as a {cfg.represent_gpus}-GPU job lives it, days {window[0]:.2f}-"
                 f"{window[1]:.2f}, time compressed {compression:,.0f}x (1 drill second = {compression / 60:,.1f} "
                 f"job minutes): {len(todo)} to inject, {len(skipped)} skipped{where}")
    return todo, skipped, compression, window


def plan_schedule(trace: FaultTrace, cfg: SoakConfig) -> tuple[list[PlannedFault], float, tuple[float, float]]:
    """Draws the drill's fault schedule from ``trace``.

    Args:
        trace: the StepFun trace (population scale).
        cfg: drill settings.

    Returns:
        (schedule sorted by time, time compression factor, the replayed window in days of the represented job).
    """
    job = trace.for_job(math.ceil(cfg.represent_gpus / cfg.gpus_per_node))
    rng = random.Random(cfg.seed)
    injected = CLUSTER_INJECTED if cfg.nodes else INJECTED
    usable = 0.8 * cfg.wall_s  # leave the last fifth for the stop margin and the last recovery
    schedule: list[PlannedFault] = []
    if cfg.trace_faults > 0:
        compression = job.mtbf_s * cfg.trace_faults / usable
        window = usable * compression
        start = rng.uniform(0.0, max(job.span_s - window, 0.0))
        for f in job.faults:
            if start <= f.time_s < start + window:
                at = 0.1 * cfg.wall_s + (f.time_s - start) / compression
                kind = injected.get(f.fault_class.value)
                reason = "" if kind else SKIPPED[f.fault_class.value]
                if kind == "linkdown" and not cfg.netns:
                    kind, reason = None, NO_NETNS_REASON
                schedule.append(PlannedFault(at, kind or "skip", f.fault_class.value, f.label, reason))
        window_days = (start / 86_400.0, (start + window) / 86_400.0)
    else:
        compression, window_days = 0.0, (0.0, 0.0)
    for i, kind in enumerate(cfg.extra):
        at = 0.1 * cfg.wall_s + usable * (i + 0.5) / max(len(cfg.extra), 1)
        schedule.append(PlannedFault(at, kind, "extra", f"extra: {kind}"))
    schedule.sort(key=lambda p: p.at_s)
    return schedule, compression, window_days


class _Tmpfs:
    """A small tmpfs mounted for the checkpoint directory; always unmounted on exit."""

    def __init__(self, path: Path, mib: int) -> None:
        self.path = path
        self.mib = mib
        self.mounted = False
        self._filler: Path | None = None

    def __enter__(self) -> _Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.mib}m", "tmpfs", str(self.path)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise SoakError(f"cannot mount a tmpfs at {self.path} ({res.stderr.strip()}); the ENOSPC fault needs "
                            "root, or drop enospc from --extra")
        self.mounted = True
        return self

    def fill(self) -> None:
        """Fills the filesystem until ENOSPC."""
        self._filler = self.path / ".drill-filler"
        chunk = b"\0" * (1 << 16)
        with open(self._filler, "wb") as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass

    def free(self) -> None:
        """Removes the filler."""
        if self._filler is not None:
            self._filler.unlink(missing_ok=True)
            self._filler = None

    def __exit__(self, *exc) -> None:
        self.free()
        if self.mounted:
            res = subprocess.run(["umount", str(self.path)], capture_output=True, text=True)
            if res.returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True, text=True)
            self.mounted = False


def _agent_detections(stderr_text: str) -> list[tuple[float, str]]:
    """When and why the agent stopped a generation, from its log lines.

    Args:
        stderr_text: the ``trainguard run`` log.

    Returns:
        ``(unix time, "exit" | "hang")`` for every ``... stopping local workers`` line, in order.
    """
    out = []
    for line in stderr_text.splitlines():
        if "stopping local workers" not in line:
            continue
        try:
            t = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        except ValueError:
            continue
        out.append((t, "hang" if "no step heartbeat" in line else "exit"))
    return out


def _committed_step(ckpt: Path) -> int:
    from trainguard.checkpoint.location import CheckpointLocation

    record = CheckpointLocation.parse(str(ckpt)).open_store("soak").record() or {}
    try:
        return int(record["step"])
    except (KeyError, TypeError, ValueError):
        return -1


def _launch(cfg: SoakConfig, workdir: Path, events: Path, extra_args: list[str], env: dict,
            ckpt: Path | None, log_name: str, run_args: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainguard.cli", "--log-level", "INFO", "run", "--nproc-per-node", str(cfg.nproc),
           "--max-restarts", str(cfg.max_restarts), "--job", "soak", "--log-dir", str(workdir / log_name),
           "--hang-floor-s", str(cfg.hang_bound_s), *run_args]
    if ckpt is not None:
        cmd += ["--checkpoint-dir", str(ckpt)]
    cmd += ["-m", "trainguard.drill.soak_worker", "--events", str(events), *extra_args]
    errf = open(workdir / f"{log_name}.stderr", "w")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)


def run_soak(cfg: SoakConfig, progress=print) -> SoakReport:
    """Runs the drill.

    Args:
        cfg: settings.
        progress: called with one line per notable event.

    Returns:
        The report.

    Raises:
        SoakError: bad settings, no trace, the tmpfs cannot be mounted, or the job never started.
    """
    cfg.validate()
    if cfg.nodes:
        from trainguard.drill.soak_cluster import run_cluster_soak

        return run_cluster_soak(cfg, progress)
    todo, skipped, compression, window = load_schedule(cfg, progress)
    own_tmp = cfg.workdir is None
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="tg-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events"
    ckpt = workdir / "ckpt"
    shm = Path("/dev/shm") / f"tg-soak-{os.getpid()}"
    marker = f"tg-soak-{os.getpid()}-{time.time_ns()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TRAINGUARD_CHECKPOINT_SHM_DIR=str(shm),
               TG_DRILL_MARKER=marker)
    stop_file = workdir / "stop_at"
    out_file = workdir / "final.json"
    need_tmpfs = any(p.kind == "enospc" for p in todo)
    tmpfs = _Tmpfs(ckpt, cfg.tmpfs_mib) if need_tmpfs else None
    proc = None
    reference = Reference(cfg, workdir, env, cfg.nproc) if cfg.verify else None
    try:
        if tmpfs is not None:
            tmpfs.__enter__()
        else:
            ckpt.mkdir(parents=True, exist_ok=True)
        steps = _StepLog(events, cfg.nproc)
        rng = random.Random(cfg.seed + 1)
        t_launch = time.time()
        proc = _launch(cfg, workdir, events, ["--stop-file", str(stop_file), "--step-delay", str(cfg.step_delay_s),
                                              "--save-every", str(cfg.save_every), "--out", str(out_file)],
                       env, ckpt, "run")
        outcomes: list[FaultOutcome] = []
        t0 = None
        pending: FaultOutcome | None = None  # a restart fault waiting for the next generation
        enospc: dict | None = None
        stop_written = False
        deadline_start = time.monotonic() + 600
        finish_by = math.inf
        known_gen = 1
        while proc.poll() is None:
            time.sleep(0.05)
            if time.monotonic() > finish_by:
                raise SoakError(f"the soak job did not finish after the stop step was set; see the logs in {workdir}")
            steps.poll()
            now = time.time()
            if t0 is None:
                first = [rows[0][0] for rows in steps.rows if rows]
                if not first:
                    if time.monotonic() > deadline_start:
                        raise SoakError("the soak job completed no step in 600 s; see the logs in " + str(workdir))
                    continue
                t0 = min(first)
                progress(f"job training (first step {t0 - t_launch:.1f} s after launch)")
            gen = steps.generation()
            if pending is not None and gen > pending.generation:
                first_new = min(row[0] for rows in steps.rows for row in rows if row[1] > pending.generation)
                resumed = min(row[2] for rows in steps.rows for row in rows if row[1] > pending.generation)
                last_old = max((row[2] for rows in steps.rows for row in rows if row[1] == pending.generation),
                               default=-1)
                pending.recovery_s = first_new - (t0 + pending.injected_s)
                pending.steps_lost = max(0, last_old + 1 - resumed)
                progress(f"  recovered: generation {gen} resumed at step {resumed} ({pending.steps_lost} steps "
                         f"lost), {pending.recovery_s:.2f} s after the fault")
                pending = None
                known_gen = gen
            if pending is None and gen > known_gen:
                pending = unplanned_restart(steps, known_gen, gen, t0, now, progress)
                outcomes.append(pending)
            known_gen = max(known_gen, gen)
            if enospc is not None:
                enospc = follow_enospc(enospc, cfg, tmpfs, ckpt, events, t0, now, cfg.nproc, progress)
            elapsed = now - t0
            extras_left = any(q.fault_class == "extra" for q in todo) and elapsed < cfg.wall_s + 300.0
            if not stop_written and elapsed >= cfg.wall_s and pending is None and enospc is None and not extras_left:
                finish_by, target = write_stop(steps, stop_file, progress)
                stop_written = True
                if reference is not None and cfg.early_reference:
                    reference.start(target, progress)
            if elapsed >= cfg.wall_s:  # past the wall time only the extras still run, so each drill has them
                todo = [q for q in todo if q.fault_class == "extra"]
            if todo and not stop_written and todo[0].at_s <= elapsed and pending is None and enospc is None:
                p = todo.pop(0)
                committed_at_fill = _committed_step(ckpt) if p.kind == "enospc" else -1
                o = _inject(p, steps, rng, cfg, elapsed, tmpfs)
                if o is None:
                    todo.insert(0, p)
                    continue
                outcomes.append(o)
                progress(f"t={elapsed:6.1f}s inject {p.kind:<6} ({p.label}) -> rank {o.rank}, generation "
                         f"{o.generation}" + (f", {o.injected_s - o.planned_s:.1f} s late" if
                                              o.injected_s - o.planned_s > 1 else ""))
                if p.kind == "enospc":
                    o.level = "none"
                    enospc = enospc_state(o, committed_at_fill)
                else:
                    pending = o
        wall = time.time() - t_launch
        steps.poll()
        stderr_text = (workdir / "run.stderr").read_text()
        if proc.returncode != 0:
            tail = " | ".join(stderr_text.strip().splitlines()[-3:])
            raise SoakError(f"the soak job failed with exit code {proc.returncode}: {tail[:400]}")
        detections = _agent_detections(stderr_text)
        for o in outcomes:
            if o.kind in ("kill", "stop"):
                want = "hang" if o.kind == "stop" else "exit"
                after = [t for t, why in detections if why == want and t >= t0 + o.injected_s - 0.01]
                if after:
                    o.detected_s = after[0] - (t0 + o.injected_s)
        final = json.loads(out_file.read_text())
        n_steps = int(final["steps"])
        step_time, stall, t_last = step_stats(steps)
        ref_sha = reference.params_sha256(n_steps, progress) if reference is not None else None
        timeline = [(row[0] - t_launch, row[1], row[2]) for row in steps.rows[0]]
        return SoakReport(
            config=asdict(cfg), compression=compression, window_days=window, steps=n_steps, wall_s=wall,
            step_time_s=step_time, ettr=n_steps * step_time / wall, ettr_steady=n_steps * step_time / (t_last - t0),
            generations=steps.generation(), exit_code=proc.returncode, faults=outcomes, skipped=skipped,
            skip_reasons={k: v for k, v in SKIPPED.items()
                          if k == "coordinator_kill" or any(p.fault_class == k for p in skipped)},
            params_sha256=final["params_sha256"], reference_sha256=ref_sha,
            equal_to_reference=(ref_sha == final["params_sha256"]) if ref_sha else None, stall_s=stall,
            timeline=timeline,
        )
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if reference is not None:
            reference.stop()
        _reap_marked(marker)
        if tmpfs is not None:
            tmpfs.__exit__(None, None, None)
        shutil.rmtree(shm, ignore_errors=True)
        if reference is not None:
            shutil.rmtree(reference.shm, ignore_errors=True)
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)


def enospc_state(outcome: FaultOutcome, committed_at_fill: int) -> dict:
    """What :func:`follow_enospc` follows for a checkpoint disk just filled.

    Args:
        outcome: the injected fault.
        committed_at_fill: the job's committed step just before the disk was filled.
    """
    return {"outcome": outcome, "freed": None, "committed": -1, "at_fill": committed_at_fill}


def follow_enospc(state: dict, cfg: SoakConfig, tmpfs: _Tmpfs, ckpt: Path, events: Path, t0: float, now: float,
                  nproc: int, progress) -> dict | None:
    """Follows a full checkpoint disk: times the first checkpoint warning or error the hook logged, frees the
    space after ``enospc_window_s`` and times until the next committed checkpoint. When checkpoints were still
    committed while the disk was full (the checkpoint service made room by removing older steps), saves never
    stopped: the recovery is 0 and says so, not "resumed" at the next periodic save after the space came back.

    Args:
        state: :func:`enospc_state` from the injection, updated here.

    Returns:
        The state while the fault is still followed, None once saves have resumed (or never stopped).
    """
    o = state["outcome"]
    if o.detected_s is None:
        for r in range(nproc):
            for line in _read_lines(events / f"rank{r}.events"):
                ev = json.loads(line)
                if ev["t"] >= t0 + o.injected_s:
                    o.detected_s = ev["t"] - (t0 + o.injected_s)
                    progress(f"  checkpoint {str(ev.get('level', 'error')).lower()} reported after "
                             f"{o.detected_s:.2f} s (training goes on): {str(ev.get('message', ''))[:120]}")
                    break
            if o.detected_s is not None:
                break
    if state["freed"] is None and now - (t0 + o.injected_s) >= cfg.enospc_window_s:
        tmpfs.free()
        state["freed"] = now
        state["committed"] = _committed_step(ckpt)
        progress("  checkpoint space freed")
        if state["committed"] > state.get("at_fill", state["committed"]):
            o.recovery_s = 0.0
            progress(f"  saves went on while the disk was full: step {state['committed']} was committed after the "
                     "fill (older steps removed to make room), nothing to resume")
            return None
    if state["freed"] is not None and _committed_step(ckpt) > state["committed"]:
        o.recovery_s = now - state["freed"]
        progress(f"  saves resumed {o.recovery_s:.2f} s after the space was freed")
        return None
    return state


def unplanned_restart(steps: _StepLog, known_gen: int, gen: int, t0: float, now: float, progress) -> FaultOutcome:
    """A restart nobody injected (a real crash, or a hang flagged under load): counted, never hidden.

    Returns:
        Its outcome, struck at the last step of generation ``known_gen`` (drill seconds since ``t0``).
    """
    struck = max((row[0] for rows in steps.rows for row in rows if row[1] == known_gen), default=now)
    progress(f"t={now - t0:6.1f}s restart not injected by the drill (generation {gen})")
    return FaultOutcome(kind="unplanned", fault_class="none", label="restart not injected by the drill",
                        planned_s=struck - t0, injected_s=struck - t0, generation=known_gen)


def step_stats(steps: _StepLog) -> tuple[float, float | None, float]:
    """(fault-free step time: the median step-to-step time within a generation; checkpoint stall: median time of
    a saving ``step_done`` minus a plain one, None without both; time of the last step), seconds."""
    deltas = [b[0] - a[0] for rows in steps.rows for a, b in zip(rows, rows[1:]) if a[1] == b[1]]
    saves = [row[4] for rows in steps.rows for row in rows if row[5]]
    plain = [row[4] for rows in steps.rows for row in rows if not row[5]]
    stall = max(statistics.median(saves) - statistics.median(plain), 0.0) if saves and plain else None
    return statistics.median(deltas), stall, max(rows[-1][0] for rows in steps.rows if rows)


class Reference:
    """The fault-free reference run: ``nproc`` workers on one node, no checkpoints, for a given number of steps.

    With ``early_reference`` it is started as soon as the step count is known (when the drill writes the stop
    step), so its start-up (interpreters, torch and DDP imports: seconds, most of its cost) overlaps the faulted
    job's last steps rather than following them. It reads nothing of the faulted job (no checkpoint directory; its own shared-memory
    folder) and keeps no warm standby: it never restarts, and a standby's imports would compete with its workers'.

    Args:
        cfg: the drill's settings.
        workdir: the drill's folder (``reference.json``, ``reference.stderr``, ``ref-events/`` go there).
        env: the drill's environment for its processes.
        nproc: workers of the reference (the faulted job's world size).
    """

    def __init__(self, cfg: SoakConfig, workdir: Path, env: dict, nproc: int) -> None:
        self.cfg = SoakConfig(**{**asdict(cfg), "nproc": nproc})
        self.workdir = workdir
        self.shm = Path(f"{env['TRAINGUARD_CHECKPOINT_SHM_DIR']}-ref")
        self.env = dict(env, TRAINGUARD_CHECKPOINT_SHM_DIR=str(self.shm))
        self.out = workdir / "reference.json"
        self.proc: subprocess.Popen | None = None
        self.steps = -1
        self._deadline = math.inf

    def start(self, n_steps: int, progress) -> None:
        """Starts the run for ``n_steps`` steps (stopping one started for another count)."""
        self.stop()
        progress(f"verifying: fault-free run of {n_steps} steps ({self.cfg.nproc} workers on one node)")
        self.out.unlink(missing_ok=True)
        self.proc = _launch(self.cfg, self.workdir, self.workdir / "ref-events",
                            ["--steps", str(n_steps), "--save-every", "1000000000", "--out", str(self.out)],
                            self.env, None, "reference", run_args=("--no-standby",))
        self.steps = n_steps
        self._deadline = time.monotonic() + max(300.0, 2 * self.cfg.wall_s)

    def params_sha256(self, n_steps: int, progress) -> str:
        """Waits for the run of ``n_steps`` steps (started now if none was, or one of another count).

        Returns:
            Its parameters' sha256.

        Raises:
            SoakError: it failed or did not finish in time.
        """
        if self.proc is None or self.steps != n_steps:
            self.start(n_steps, progress)
        try:
            self.proc.wait(timeout=max(self._deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired as exc:
            self.stop()
            raise SoakError("the fault-free reference run did not finish in time") from exc
        if self.proc.returncode != 0:
            raise SoakError(f"the fault-free reference run failed with exit code {self.proc.returncode}")
        return json.loads(self.out.read_text())["params_sha256"]

    def stop(self) -> None:
        """Kills a run still going (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def write_stop(steps: _StepLog, stop_file: Path, progress) -> tuple[float, int]:
    """Tells the workers to finish :data:`STOP_MARGIN_STEPS` after the furthest step so far.

    Returns:
        (the ``time.monotonic()`` by which the job must have finished, the step count it finishes at).
    """
    target = steps.max_step() + 1 + STOP_MARGIN_STEPS
    tmp = stop_file.with_suffix(".tmp")
    tmp.write_text(str(target))
    os.replace(tmp, stop_file)
    progress(f"wall time reached: the job finishes at step {target}")
    return time.monotonic() + 300.0 + 20 * STOP_MARGIN_STEPS * max(step_time_guess(steps), 0.05), target


def step_time_guess(steps: _StepLog) -> float:
    """Median step-to-step time seen so far (rank 0), seconds; 0 before two steps."""
    rows = steps.rows[0][-50:]
    d = [b[0] - a[0] for a, b in zip(rows, rows[1:]) if a[1] == b[1]]
    return statistics.median(d) if d else 0.0


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _inject(p: PlannedFault, steps: _StepLog, rng: random.Random, cfg: SoakConfig, elapsed: float,
            tmpfs: _Tmpfs | None) -> FaultOutcome | None:
    """Strikes one fault; None when no worker of the current generation is stepping yet (try again later)."""
    gen = steps.generation()
    o = FaultOutcome(kind=p.kind, fault_class=p.fault_class, label=p.label, planned_s=p.at_s, injected_s=elapsed,
                     generation=gen)
    if p.kind == "enospc":
        tmpfs.fill()
        return o
    # Strike only in steady state: every rank has done 3 steps in this generation, so its step time is known.
    live = [r for r in range(cfg.nproc) if sum(1 for row in steps.rows[r][-3:] if row[1] == gen) >= 3]
    if len(live) < cfg.nproc:
        return None
    rank = rng.choice(live)
    pid = steps.last(rank)[3]
    try:
        os.kill(pid, signal.SIGSTOP if p.kind == "stop" else signal.SIGKILL)
    except ProcessLookupError:
        return None
    o.rank = rank
    return o


def _reap_marked(marker: str) -> list[int]:
    """Kills any process left with the drill's marker in its environment; returns their pids."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TG_DRILL_MARKER") == marker:
                left.append(proc.pid)
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    if left:
        log.warning("soak drill: killed %d leftover process(es): %s", len(left), left)
    return left
