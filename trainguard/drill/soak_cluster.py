"""The soak drill on a small cluster: a standalone coordinator, node agents in network namespaces, warm spares.

``trainguard drill --nodes N`` runs the drill's training job as a multi-node job: a ``trainguard coordinator``
process, ``N`` node agents (``trainguard run --coordinator``, one worker each) and ``spares`` spare agents, each
node in its own network namespace (:mod:`trainguard.drill.netns`: a management link for the coordinator, a data
link for the collectives) with its own fake PCIe hardware tree (:mod:`trainguard.testing.sysfs`) that the agent's
real PCIe detector and predictor read. That makes every fault class of the StepFun trace injectable for real:

=============  =====================================================================================
class          injected as (kind)
=============  =====================================================================================
crash          ``kill``: SIGKILL of a worker; the agent restarts the generation in place (process level)
node_fault     ``hwfault``: a fatal AER error written to the node's PCIe tree and its worker SIGKILLed (the
               device failure takes the process down); the agent finds the hardware cause and asks for a
               spare (node level)
hang           ``stop``: SIGSTOP of a worker; the process detector flags it (process level)
node_down      ``agentkill``: the node agent and everything under it SIGKILLed; the coordinator's lease
               expires and a spare takes the slot (node level)
link           ``linkdown``: the node's data link taken down; the agent's RoCE detector and predictor see it
               over netlink and ask for a spare (node level)
degraded       ``precursor``: the GPU's PCIe link narrowed (x16 -> x4) in the node's tree; the predictor's
               rules tier advises a checkpoint and drains the node after ``drain_grace_s``. If the node is
               still in the job ``precursor_lead_s`` later, the fault it announced strikes (``hwfault``)
=============  =====================================================================================

``extra`` kinds add, once each: any of the above, ``coordinator`` (the coordinator SIGKILLed and started again
on the same address and store, as systemd's ``Restart=`` would; the job must go on without a restart) and
``enospc`` (the shared checkpoint directory, a tmpfs, filled for ``enospc_window_s``).

After each node-level recovery the drill retires the replaced node (kills what is left of it, deletes its
namespace) and brings up a new spare, so the next node fault has one: the repair loop of a real cluster.

Without namespaces (not root) ``--no-netns`` runs the nodes on loopback; ``linkdown`` is then skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainguard.drill.errors import SoakError
from trainguard.testing.sysfs import FakeNodeHardware
from trainguard.drill.netns import Fabric, NodeNet
from trainguard.drill.soak import (
    CLUSTER_HEARTBEAT_S,
    SKIPPED,
    FaultOutcome,
    PlannedFault,
    SoakConfig,
    SoakReport,
    _read_lines,
    _reap_marked,
    _StepLog,
    _Tmpfs,
    _committed_step,
    enospc_state,
    follow_enospc,
    load_schedule,
    read_restores,
    step_stats,
    unplanned_restart,
    Reference,
    write_stop,
)

log = logging.getLogger(__name__)

#: Kinds that end in a new generation (a restart at some level); the others leave training running.
RESTART_KINDS = ("kill", "stop", "hwfault", "agentkill", "linkdown", "precursor")
NODE_KINDS = ("hwfault", "agentkill", "linkdown", "precursor")
#: A new spare counts as ready once its warm standby worker has imported torch and waits for its orders (a real
#: cluster's spares have been up for hours). Where that cannot be seen (no readable ``/proc/<pid>/syscall``) or the
#: spare keeps no standby, it counts as ready this long after it registered.
SPARE_WARMUP_S = 8.0
#: ... and at the latest this long after it registered, warm or not: a standby still importing after that (a very
#: loaded machine) must not hold the drill's remaining node faults back.
SPARE_READY_MAX_S = 30.0
#: x86-64 and arm64 syscall numbers of ``read``: a standby done importing blocks in ``read(0, ...)`` on its stdin.
_READ_SYSCALLS = {"x86_64": "0", "aarch64": "63"}
_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")

#: Agent/coordinator log lines that mark detection, per kind (searched in the victim's log unless noted).
DETECTION_PATTERNS: dict[str, str] = {
    "kill": r"ended with .*stopping local workers",
    "stop": r"no step heartbeat",
    "hwfault": r"hardware fault|node-level fault",
    "linkdown": r"node-level fault|predictor alarm|predicted failure",
    "precursor": r"predictor alarm|predicted failure",
    "agentkill": r"node {node} lost",  # in the coordinator's log
}


def log_time(line: str) -> float | None:
    """Unix time of a ``YYYY-mm-dd HH:MM:SS,mmm`` log line (local time, as the CLI logs), or None."""
    m = _TS.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def first_log_match(path: Path, pattern: str, after: float) -> float | None:
    """Time of the first line of ``path`` at or after ``after`` (unix time) matching ``pattern``, or None."""
    rx = re.compile(pattern)
    for line in _read_lines(path):
        t = log_time(line)
        if t is not None and t >= after - 0.002 and rx.search(line):
            return t
    return None


def standbys_waiting(pids: set[int]) -> tuple[int, int] | None:
    """(how many of ``pids`` are standby workers (``python -u -c ...``) blocked reading their stdin, i.e. done with
    their imports (:mod:`trainguard.agent.standby`); how many standby workers there are), or None when a process's
    syscall cannot be read here."""
    nr = _READ_SYSCALLS.get(os.uname().machine)
    if nr is None:
        return None
    count = total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if argv[1:3] != [b"-u", b"-c"]:
                continue
            with open(f"/proc/{pid}/syscall") as f:
                call = f.read().split()
        except FileNotFoundError:
            continue  # ended meanwhile
        except OSError:
            return None  # not ours to read (no ptrace access): fall back to the fixed delay
        total += 1
        count += call[:2] == [nr, "0x0"]
    return count, total


@dataclass
class _Node:
    """One node agent of the drill."""

    name: str
    index: int
    role: str  # "active", "spare", "retired"
    proc: subprocess.Popen
    log_path: Path
    hw: FakeNodeHardware
    net: NodeNet | None = None
    registered_at: float | None = None

    def warm(self, now: float, nproc: int = 1) -> bool:
        """Registered with the coordinator, and its ``nproc`` warm standby workers done importing (blocked reading
        their orders); where that cannot be seen or it keeps no standby, registered at least
        :data:`SPARE_WARMUP_S` ago; in any case once registered :data:`SPARE_READY_MAX_S` ago."""
        if self.registered_at is None:
            self.registered_at = first_log_match(self.log_path, r"registered node .* with coordinator", 0.0)
        if self.registered_at is None:
            return False
        since = now - self.registered_at
        if since >= SPARE_READY_MAX_S:
            return True
        counted = standbys_waiting(self.tree_pids() - {self.proc.pid})
        if counted is None or counted[1] == 0:
            return since >= SPARE_WARMUP_S  # nothing to watch: the fixed delay
        return counted[0] >= nproc

    def tree_pids(self) -> set[int]:
        """The agent's pid and every descendant's."""
        import psutil

        try:
            p = psutil.Process(self.proc.pid)
            return {self.proc.pid} | {c.pid for c in p.children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()

    def kill_tree(self) -> None:
        """SIGKILLs the agent, its process group and every descendant (workers run in their own sessions)."""
        import psutil

        pids = self.tree_pids()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class _Cluster:
    """The coordinator and node agents of one drill."""

    cfg: SoakConfig
    workdir: Path
    env: dict
    worker_args: list[str]
    ckpt: Path
    fabric: Fabric | None
    nodes: list[_Node] = field(default_factory=list)
    coordinator: subprocess.Popen | None = None
    coord_host: str = "127.0.0.1"
    coord_port: int = 0
    coord_logs: list[Path] = field(default_factory=list)
    repeat_window_s: float = 600.0
    _spawned: int = 0

    def start_coordinator(self, port: int = 0) -> None:
        """Starts the coordinator (on ``port``, or a free one) and waits until it serves."""
        k = len(self.coord_logs)
        pf = self.workdir / f"coordinator{k}.port"
        logp = self.workdir / f"coordinator{k}.log"
        cmd = [sys.executable, "-m", "trainguard.cli", "--log-level", "INFO", "coordinator", "--job", "soak",
               "--listen", f"{self.coord_host}:{port}", "--store", f"sqlite://{self.workdir}/coordinator.db",
               "--nnodes", str(self.cfg.nodes), "--max-restarts", str(self.cfg.max_restarts),
               "--heartbeat-interval", str(CLUSTER_HEARTBEAT_S), "--lease-timeout", str(self.cfg.lease_timeout_s), "--backoff", "0",
               "--repeat-window", f"{self.repeat_window_s:.3f}", "--port-file", str(pf)]
        self.coordinator = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=open(logp, "w"),
                                            start_new_session=True)
        self.coord_logs.append(logp)
        deadline = time.monotonic() + 60
        while not pf.exists():
            if self.coordinator.poll() is not None or time.monotonic() > deadline:
                tail = " | ".join(logp.read_text().strip().splitlines()[-3:])
                raise SoakError(f"the drill's coordinator did not start: {tail[:300]}")
            time.sleep(0.05)
        self.coord_port = int(pf.read_text())

    def kill_coordinator(self) -> None:
        """SIGKILLs the coordinator."""
        if self.coordinator is not None and self.coordinator.poll() is None:
            os.killpg(self.coordinator.pid, signal.SIGKILL)
            self.coordinator.wait()

    def add_node(self, spare: bool) -> _Node:
        """Creates a node (namespace, fake hardware) and starts its agent."""
        k = self._spawned
        self._spawned += 1
        name = f"spare{k}" if spare else f"n{k}"
        net = self.fabric.add(name) if self.fabric else None
        hwroot = self.workdir / "hw" / name
        hw = FakeNodeHardware(hwroot)
        conf = self.workdir / "hw" / f"{name}.toml"
        conf.write_text(
            f'root = "{hwroot}"\n\n[pcie]\ninterval_s = 0.5\n\n'
            + ('[roce]\nroot = "/"\ninterfaces = ["data0"]\ninterval_s = 0.5\ndown_grace_s = 0.0\n'
               'rdma = false\nethtool = false\n' if net else "")
        )
        detectors = "process,pcie" + (",roce" if net else "")
        logp = self.workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "trainguard.cli", "--log-level", "INFO", "run",
               "--coordinator", f"{self.coord_host}:{self.coord_port}", "--job", "soak", "--node-id", name,
               "--host", name, "--pod", "pod-0", "--node-index", str(k), "--address",
               net.data_ip if net else "127.0.0.1", "--nproc-per-node", "1", "--max-restarts",
               str(self.cfg.max_restarts), "--checkpoint-dir", str(self.ckpt), "--log-dir",
               str(self.workdir / "logs" / name), "--hang-floor-s", str(self.cfg.hang_bound_s), "--detectors",
               detectors, "--detector-config", str(conf), "--drain-grace-s", str(self.cfg.drain_grace_s),
               "--predictor-interval-s", "0.5", "--memory-tier", self.cfg.memory_tier]
        if spare:
            cmd.append("--spare")
        cmd += ["-m", "trainguard.drill.soak_worker", *self.worker_args]
        if net:
            cmd = ["ip", "netns", "exec", net.netns, *cmd]
        env = dict(self.env, GLOO_SOCKET_IFNAME="data0" if net else "lo",
                   TRAINGUARD_CHECKPOINT_SHM_DIR=f"{self.env['TRAINGUARD_CHECKPOINT_SHM_DIR']}-{name}")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(logp, "w"),
                                start_new_session=True)
        node = _Node(name, k, "spare" if spare else "active", proc, logp, hw, net)
        self.nodes.append(node)
        return node

    def node_of_pid(self, pid: int) -> _Node | None:
        """The live node whose agent's process tree holds ``pid``."""
        for n in self.nodes:
            if n.role != "retired" and pid in n.tree_pids():
                return n
        return None

    def retire(self, node: _Node) -> None:
        """Kills what is left of ``node`` and removes it from the fabric."""
        node.role = "retired"
        node.kill_tree()
        if self.fabric is not None and node.net is not None:
            self.fabric.remove(node.name)

    def live(self) -> list[_Node]:
        """Nodes not retired."""
        return [n for n in self.nodes if n.role != "retired"]

    def shutdown(self) -> None:
        """Kills every agent and the coordinator."""
        for n in self.nodes:
            if n.proc.poll() is None:
                n.kill_tree()
        self.kill_coordinator()


def check_exits(nodes: list[_Node]) -> None:
    """Checks how the job's node agents ended (the report's exit code is 0 only when every one exited 0).

    Raises:
        SoakError: an agent exited non-zero (or by a signal); names the first and its log's last lines.
    """
    for n in nodes:
        code = n.proc.poll()
        if code is not None and code != 0:
            tail = " | ".join(_read_lines(n.log_path)[-3:])
            raise SoakError(f"the soak job failed: node agent {n.name} exited with code {code}: {tail[:400]}")


def _hosting(cluster: _Cluster, steps: _StepLog, gen: int) -> dict[int, _Node]:
    """rank -> node for the ranks that stepped in generation ``gen`` (found from the worker pids)."""
    out = {}
    for r, rows in enumerate(steps.rows):
        pids = [row[3] for row in rows if row[1] == gen]
        if pids:
            node = cluster.node_of_pid(pids[-1])
            if node is not None:
                out[r] = node
    return out


def _victim(cluster: _Cluster, steps: _StepLog, rng: random.Random, nproc: int) -> tuple[int, int, _Node] | None:
    """(rank, worker pid, node) of a random rank stepping steadily in the current generation, or None."""
    gen = steps.generation()
    live = [r for r in range(nproc) if sum(1 for row in steps.rows[r][-3:] if row[1] == gen) >= 3]
    if len(live) < nproc:
        return None
    rank = rng.choice(live)
    pid = steps.last(rank)[3]
    node = cluster.node_of_pid(pid)
    if node is None:
        return None
    return rank, pid, node


def _strike(kind: str, cluster: _Cluster, rank_pid_node: tuple[int, int, _Node]) -> None:
    rank, pid, node = rank_pid_node
    if kind in ("kill", "stop"):
        os.kill(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
    elif kind == "hwfault":
        node.hw.aer_fatal()
        os.kill(pid, signal.SIGKILL)
    elif kind == "agentkill":
        node.kill_tree()
    elif kind == "linkdown":
        cluster.fabric.link_down(node.name)
    elif kind == "precursor":
        node.hw.narrow_link(4)
    else:
        raise SoakError(f"kind {kind!r} is not a worker or node fault")


def run_cluster_soak(cfg: SoakConfig, progress=print) -> SoakReport:
    """Runs the drill on a cluster of ``cfg.nodes`` node agents (see the module docstring).

    Args:
        cfg: settings (``nodes`` >= 2).
        progress: called with one line per notable event.

    Returns:
        The report; every outcome carries its recovery ``level`` and ``node``.

    Raises:
        SoakError: bad settings, no namespaces when asked for, no trace, or the job never started / failed.
    """
    cfg.validate()
    todo, skipped, compression, window = load_schedule(cfg, progress)
    own_tmp = cfg.workdir is None
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="tg-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    events, ckpt = workdir / "events", workdir / "ckpt"
    shm = Path("/dev/shm") / f"tg-soak-{os.getpid()}"
    marker = f"tg-soak-{os.getpid()}-{time.time_ns()}"
    # The drill's job runs as a secured deployment would: its coordinator and every node's replica server demand
    # this job token, so faults and recoveries are measured with the token checks in the path.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TRAINGUARD_CHECKPOINT_SHM_DIR=str(shm),
               TG_DRILL_MARKER=marker, GRPC_VERBOSITY="ERROR", TRAINGUARD_JOB_TOKEN=secrets.token_hex(16))
    stop_file, out_file = workdir / "stop_at", workdir / "final.json"
    worker_args = ["--events", str(events), "--stop-file", str(stop_file), "--step-delay", str(cfg.step_delay_s),
                   "--save-every", str(cfg.save_every), "--out", str(out_file)]
    tmpfs = _Tmpfs(ckpt, cfg.tmpfs_mib) if any(p.kind == "enospc" for p in todo) else None
    fabric = Fabric() if cfg.netns else None
    cluster: _Cluster | None = None
    reference = Reference(cfg, workdir, env, cfg.nodes) if cfg.verify else None
    try:
        if fabric is not None:
            fabric.__enter__()
            # Named so that whoever finds them after a drill that was killed knows whose they are.
            progress(f"network fabric {fabric.tag}: node namespaces tg{fabric.tag}n<k>, bridges tgM{fabric.tag} "
                     f"and tgD{fabric.tag}")
        if tmpfs is not None:
            tmpfs.__enter__()
        else:
            ckpt.mkdir(parents=True, exist_ok=True)
        # Repeats escalate within 10 minutes of job time; compressed, that window shrinks by the same factor.
        cluster = _Cluster(cfg, workdir, env, worker_args, ckpt, fabric,
                           coord_host=fabric.coordinator_host if fabric else "127.0.0.1",
                           repeat_window_s=600.0 / compression if compression > 1 else 600.0)
        t_launch = time.time()
        cluster.start_coordinator()
        for _ in range(cfg.nodes):
            cluster.add_node(spare=False)
        for _ in range(cfg.spares):
            cluster.add_node(spare=True)
        return _drive(cfg, cluster, todo, skipped, compression, window, t_launch, tmpfs, events, stop_file,
                      out_file, reference, progress)
    finally:
        if reference is not None:
            reference.stop()
        if cluster is not None:
            cluster.shutdown()
        _reap_marked(marker)
        if tmpfs is not None:
            tmpfs.__exit__(None, None, None)
        if fabric is not None:
            fabric.close()
        for p in Path("/dev/shm").glob(f"tg-soak-{os.getpid()}*"):
            shutil.rmtree(p, ignore_errors=True)
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)


def _drive(cfg: SoakConfig, cluster: _Cluster, todo: list[PlannedFault], skipped: list[PlannedFault],
           compression: float, window: tuple[float, float], t_launch: float, tmpfs: _Tmpfs | None, events: Path,
           stop_file: Path, out_file: Path, reference: Reference | None, progress) -> SoakReport:
    """The drill's main loop: inject on schedule, follow recoveries, repair the cluster, finish, verify."""
    nproc = cfg.nodes
    steps = _StepLog(events, nproc)
    rng = random.Random(cfg.seed + 1)
    outcomes: list[FaultOutcome] = []
    t0: float | None = None
    pending: FaultOutcome | None = None
    pending_node: _Node | None = None
    strike_at: float | None = None  # a precursor's announced fault, due at this unix time
    enospc: dict | None = None
    coord: dict | None = None
    stop_written = False
    deadline_start = time.monotonic() + 600
    finish_by = math.inf
    known_gen = 1
    while True:
        time.sleep(0.05)
        steps.poll()
        now = time.time()
        active = cluster.live()
        if stop_written and out_file.exists() and all(n.proc.poll() is not None for n in active):
            check_exits(active)
            break
        if time.monotonic() > finish_by:
            raise SoakError(f"the soak job did not finish after the stop step was set; see the logs in "
                            f"{cluster.workdir}")
        failed = [n for n in active if n.proc.poll() not in (None, 0)]
        if failed and pending is None:
            n = failed[0]
            tail = " | ".join(_read_lines(n.log_path)[-3:])
            raise SoakError(f"node agent {n.name} failed with exit code {n.proc.returncode}: {tail[:400]}")
        if t0 is None:
            first = [rows[0][0] for rows in steps.rows if rows]
            if len(first) < nproc:
                if time.monotonic() > deadline_start:
                    raise SoakError(f"the soak job completed no step in 600 s; see the logs in {cluster.workdir}")
                continue
            t0 = min(first)
            progress(f"job training on {cfg.nodes} nodes (first step {t0 - t_launch:.1f} s after launch)")
        gen = steps.generation()
        if pending is not None and strike_at is not None and now >= strike_at:
            strike_at = None
            if pending_node is not None and pending_node.role == "active" and gen == pending.generation:
                pending.predicted = False
                v = _victim(cluster, steps, rng, nproc)
                if v is not None and v[2] is pending_node:
                    _strike("hwfault", cluster, v)
                    progress(f"  not drained in time: the announced fault strikes {pending_node.name}")
        if pending is not None and gen > pending.generation:
            rows_new = [row for rows in steps.rows for row in rows if row[1] > pending.generation]
            if len({r for r, rows in enumerate(steps.rows) if any(row[1] > pending.generation for row in rows)}) \
                    == nproc:
                first_new = min(row[0] for row in rows_new)
                resumed = min(row[2] for row in rows_new)
                last_old = max((row[2] for rows in steps.rows for row in rows if row[1] == pending.generation),
                               default=-1)
                pending.recovery_s = first_new - (t0 + pending.injected_s)
                pending.steps_lost = max(0, last_old + 1 - resumed)
                hosting = _hosting(cluster, steps, gen)
                replaced = pending_node is not None and pending_node not in hosting.values()
                pending.level = "node" if replaced else "process"
                pending.restore_tiers, pending.restore_s = read_restores(events, nproc, gen)
                if pending.kind == "precursor" and pending.predicted is None:
                    pending.predicted = replaced
                progress(f"  recovered at {pending.level} level: generation {gen} resumed at step {resumed} "
                         f"({pending.steps_lost} steps lost), {pending.recovery_s:.2f} s after the fault; restored "
                         f"from {_tiers_text(pending.restore_tiers)}"
                         + (f"; {pending_node.name} replaced by "
                            f"{', '.join(n.name for n in hosting.values() if n.role == 'spare')}" if replaced else ""))
                _repair(cluster, hosting, progress)
                pending, pending_node, strike_at = None, None, None
                known_gen = gen
        if pending is None and gen > known_gen:
            o = unplanned_restart(steps, known_gen, gen, t0, now, progress)
            outcomes.append(o)
            o.recovery_s = min(row[0] for rows in steps.rows for row in rows if row[1] > known_gen) - (t0 + o.injected_s)
            _repair(cluster, _hosting(cluster, steps, gen), progress)
        known_gen = max(known_gen, gen)
        if enospc is not None:
            enospc = follow_enospc(enospc, cfg, tmpfs, cluster.ckpt, events, t0, now, nproc, progress)
        if coord is not None:
            coord = _follow_coordinator(coord, cluster, steps, t0, now, progress)
        elapsed = now - t0
        extras_left = any(q.fault_class == "extra" for q in todo) and elapsed < cfg.wall_s + 300.0
        if (not stop_written and elapsed >= cfg.wall_s and pending is None and enospc is None and coord is None
                and not extras_left):
            finish_by, target = write_stop(steps, stop_file, progress)
            stop_written = True
            if reference is not None and cfg.early_reference:
                reference.start(target, progress)
        if elapsed >= cfg.wall_s:
            todo = [q for q in todo if q.fault_class == "extra"]
        if not todo or stop_written or todo[0].at_s > elapsed or pending is not None or enospc is not None \
                or coord is not None:
            continue
        spare_ready = any(n.role == "spare" and n.proc.poll() is None and n.warm(now, 1) for n in cluster.nodes)
        if todo[0].kind in NODE_KINDS and not spare_ready:
            continue  # wait for the repaired spare before another node fault
        p = todo.pop(0)
        o = FaultOutcome(kind=p.kind, fault_class=p.fault_class, label=p.label, planned_s=p.at_s,
                         injected_s=elapsed, generation=gen)
        if p.kind == "enospc":
            committed_at_fill = _committed_step(cluster.ckpt)
            tmpfs.fill()
            o.level = "none"
            enospc = enospc_state(o, committed_at_fill)
        elif p.kind == "coordinator":
            cluster.kill_coordinator()
            o.level = "none"
            coord = {"outcome": o, "killed": now, "restarted": None, "gen": gen, "step": steps.max_step()}
        else:
            v = _victim(cluster, steps, rng, nproc)
            if v is not None and p.kind in RESTART_KINDS and cfg.strike_after_replication \
                    and not _replicated(cluster, steps, nproc, cfg.save_every):
                v = None
            if v is None or (p.kind == "linkdown" and cluster.fabric is None):
                todo.insert(0, p)
                continue
            try:
                _strike(p.kind, cluster, v)
            except ProcessLookupError:
                todo.insert(0, p)
                continue
            o.rank, o.node = v[0], v[2].name
            o.level = "node" if p.kind in NODE_KINDS else "process"
            pending, pending_node = o, v[2]
            if p.kind == "precursor":
                strike_at = now + cfg.precursor_lead_s
        outcomes.append(o)
        progress(f"t={elapsed:6.1f}s inject {p.kind:<10} ({p.label})" + (f" -> {o.node} rank {o.rank}" if o.node
                                                                          else "")
                 + (f", {o.injected_s - o.planned_s:.1f} s late" if o.injected_s - o.planned_s > 1 else ""))
    return _finish(cfg, cluster, outcomes, skipped, compression, window, t_launch, t0, steps, out_file, reference,
                   progress)


def _replicated(cluster: _Cluster, steps: _StepLog, nproc: int, save_every: int) -> bool:
    """Whether every rank's newest snapshot is a published replica in some other live node's memory (the files
    :mod:`trainguard.checkpoint.replica_store` publishes under each node's arena root), with the next snapshot
    still a few steps away: a strike just after a newer snapshot of one rank lands but before its peer's is
    replicated leaves the ranks' newest listed copies at different steps (``memory.keep = 1`` lists one step per
    rank), and the restore goes to disk (1 run in 5 under a loaded CI)."""
    newest = []
    for r in range(nproc):
        saved = [row[2] for row in steps.rows[r] if row[5]]
        if not saved:
            return False
        newest.append(max(saved))
    step = min(newest)  # a step every rank saved
    gen = steps.generation()
    reached = max((row[2] for r in range(nproc) for row in steps.rows[r] if row[1] == gen), default=step)
    if reached >= step + save_every - 3:
        return False
    for r in range(nproc):
        rows = [row for row in steps.rows[r] if row[1] == gen]
        owner = cluster.node_of_pid(rows[-1][3]) if rows else None
        if not any(n is not owner and (_replica_dir(cluster, n, r) / f"step_{step:012d}.manifest.json").exists()
                   for n in cluster.live()):
            return False
    # The step log lags the workers: a rank whose next snapshot is replicated already has replaced its replica of
    # ``step`` (one kept per rank), and a strike before its peer's lands leaves no step every rank holds in
    # memory (the restore went to disk, once in a loaded run of the suite).
    for n in cluster.live():
        for r in range(nproc):
            for manifest in _replica_dir(cluster, n, r).glob("step_*.manifest.json"):
                try:
                    if int(manifest.name[5:17]) > step:
                        return False
                except ValueError:
                    continue
    return True


def _replica_dir(cluster: _Cluster, node, rank: int) -> Path:
    """Where ``node``'s agent publishes the replicas of ``rank`` it holds."""
    return (Path(f"{cluster.env['TRAINGUARD_CHECKPOINT_SHM_DIR']}-{node.name}") / "soak" / "replicas"
            / f"rank_{rank:05d}")


def _tiers_text(tiers: dict[int, str]) -> str:
    """``memory (ranks 0, 1)``-style summary of where the ranks restored from."""
    by: dict[str, list[int]] = {}
    for r, t in sorted(tiers.items()):
        by.setdefault(t, []).append(r)
    return ", ".join(f"{t} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for t, rs in by.items()) \
        or "nothing logged yet"


def _repair(cluster: _Cluster, hosting: dict[int, _Node], progress) -> None:
    """Retires the nodes that lost their place, promotes the spares that took one, starts new spares."""
    in_job = set(id(n) for n in hosting.values())
    for n in cluster.live():
        if id(n) in in_job:
            n.role = "active"
        elif n.role == "active":
            cluster.retire(n)
            progress(f"  {n.name} retired (namespace and processes removed)")
    while sum(1 for n in cluster.live() if n.role == "spare") < cluster.cfg.spares:
        n = cluster.add_node(spare=True)
        progress(f"  new spare {n.name} started")


def _follow_coordinator(state: dict, cluster: _Cluster, steps: _StepLog, t0: float, now: float,
                        progress) -> dict | None:
    """Restarts the killed coordinator after a second; done once it serves and training went on past it."""
    o = state["outcome"]
    if state["restarted"] is None and now - state["killed"] >= 1.0:
        cluster.start_coordinator(cluster.coord_port)
        state["restarted"] = time.time()
        o.recovery_s = state["restarted"] - state["killed"]
        progress(f"  coordinator back on port {cluster.coord_port} {o.recovery_s:.2f} s after the kill")
    if state["restarted"] is not None and now - state["restarted"] >= 3.0:
        o.steps_lost = 0 if steps.generation() == state["gen"] else None
        o.detected_s = 0.0
        went_on = steps.max_step() - state["step"]
        progress(f"  training went on: {went_on} steps since the kill, generation "
                 f"{'unchanged' if steps.generation() == state['gen'] else 'changed'}")
        return None
    return state


def _finish(cfg: SoakConfig, cluster: _Cluster, outcomes: list[FaultOutcome], skipped: list[PlannedFault],
            compression: float, window: tuple[float, float], t_launch: float, t0: float, steps: _StepLog,
            out_file: Path, reference: Reference | None, progress) -> SoakReport:
    wall = time.time() - t_launch
    steps.poll()
    coord_logs = [p for p in cluster.coord_logs]
    for o in outcomes:
        if o.detected_s is not None or o.kind not in DETECTION_PATTERNS:
            continue
        at = t0 + o.injected_s
        node = next((n for n in cluster.nodes if n.name == o.node), None)
        if o.kind == "agentkill":
            pattern = DETECTION_PATTERNS["agentkill"].format(node=re.escape(o.node))
            hits = [t for p in coord_logs if (t := first_log_match(p, pattern, at)) is not None]
            t = min(hits) if hits else None
        elif o.kind == "stop":  # a stopped worker stalls its peers too: whichever agent flags it first
            hits = [t for n in cluster.nodes if (t := first_log_match(n.log_path, DETECTION_PATTERNS["stop"], at))]
            t = min(hits) if hits else None
        else:
            t = first_log_match(node.log_path, DETECTION_PATTERNS[o.kind], at) if node else None
        if t is not None:
            o.detected_s = max(t - at, 0.0)
    final = json.loads(out_file.read_text())
    n_steps = int(final["steps"])
    step_time, stall, t_last = step_stats(steps)
    ref_sha = reference.params_sha256(n_steps, progress) if reference is not None else None
    timeline = [(row[0] - t_launch, row[1], row[2]) for row in steps.rows[0]]
    return SoakReport(
        config=asdict(cfg), compression=compression, window_days=window, steps=n_steps, wall_s=wall,
        step_time_s=step_time, ettr=n_steps * step_time / wall, ettr_steady=n_steps * step_time / (t_last - t0),
        generations=steps.generation(), exit_code=0, faults=outcomes, skipped=skipped,
        skip_reasons={k: v for k, v in SKIPPED.items() if any(p.fault_class == k for p in skipped)},
        params_sha256=final["params_sha256"], reference_sha256=ref_sha,
        equal_to_reference=(ref_sha == final["params_sha256"]) if ref_sha else None, stall_s=stall,
        timeline=timeline,
    )
