"""Fail-slow drills with real injection: a CPU-throttled straggler, and a rank hung in its data loader.

**Straggler drill** (:func:`run_straggler_drill`). A job of :mod:`trainguard.drill.failslow_worker` runs under
``trainguard run``: one node with ``nproc`` workers, or (``nodes > 1``) a standalone coordinator and one
``trainguard run --coordinator`` per node, plus a warm spare when asked. After a healthy phase (every second
``trainguard status --json`` is asked on every node; any slow rank listed then is a false alarm) one rank's
worker is capped at a fraction of a core through a cgroup v1 CPU quota (:class:`~trainguard.drill.slowdown.
CpuThrottle`). The drill measures when ``trainguard status`` first lists that rank (detection time), the job's
step time healthy, under the straggler (the baseline without detection: the job runs at the straggler's pace),
and after mitigation (``--failslow-action replace``: the straggler's node is swapped for the spare).
With ``link_rate`` the node holding ``throttle_rank`` gets its data link capped by a ``tbf`` qdisc instead (nodes in
network namespaces); no rank's own work changes, so detection is the coordinator's link probe naming that node
(a ``link`` finding in ``trainguard status``).

**Hang drill** (:func:`run_hang_drill`). Rank ``hang_rank`` hangs in its data loader at a given step in each
of ``rounds`` generations while the others wait for it in their all-reduce; the process detector declares the
hang, every rank's stack is grouped at the coordinator, and the drill checks the outlier named in ``trainguard
status`` against the injected rank (hang-localisation accuracy).

Every process the drill starts runs in its own session and is killed at the end; the cgroup is removed even
after a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainguard.drill.errors import SoakError
from trainguard.drill.slowdown import CpuThrottle, LinkRateCap


#: Seconds of healthy training before the job's own step-time baseline has formed (the detector's 2 warm-up and
#: 5 baseline windows of 2 s, plus margin), counted from the job's first step; slow-link and job-wide injections
#: wait at least this long.
BASELINE_FORMS_S = 18.0


@dataclass
class StragglerDrillConfig:
    """Knobs of the straggler drill.

    Attributes:
        nodes: node agents (1: one ``trainguard run`` with an embedded coordinator).
        nproc: workers per node.
        spare: add a warm spare node (multi-node only).
        action: ``report`` or ``replace`` (``--failslow-action``).
        throttle_rank: the rank to slow down.
        throttle_fraction: CPU share left to it (0.25: a quarter of one core).
        healthy_s: seconds of healthy training watched for false alarms before the injection.
        detect_timeout_s: give up waiting for detection after this long, seconds.
        after_s: seconds of training measured after detection (or after the replacement).
        width: MLP width of the worker (compute per step).
        workdir: folder for logs (a temporary one when empty; kept when given).
        netns: run each node in its own network namespace with management and data links (multi-node only;
            :class:`~trainguard.drill.netns.Fabric`).
        link_rate: instead of the CPU quota, cap the data link of the node holding ``throttle_rank`` at this
            tc rate (e.g. ``"100mbit"``) with a tbf qdisc on its ``data0`` inside its namespace (needs netns).
        throttle_all: instead, put every worker under one shared CPU quota (``throttle_fraction`` x workers): the
            whole job slows down, no rank more than the others and no link: with 3+ nodes the coordinator probes
            the (healthy) links, and the drill waits for the campaign's outcome (it must name no node).
    """

    nodes: int = 1
    nproc: int = 2
    spare: bool = False
    action: str = "report"
    throttle_rank: int = 1
    throttle_fraction: float = 0.1
    healthy_s: float = 12.0
    detect_timeout_s: float = 60.0
    after_s: float = 8.0
    width: int = 1024
    workdir: str = ""
    netns: bool = False
    link_rate: str = ""
    throttle_all: bool = False


@dataclass
class StragglerDrillResult:
    """What the straggler drill measured (seconds unless named otherwise)."""

    config: dict
    detected: bool = False
    detection_s: float | None = None
    false_alarms: int = 0
    status_polls_healthy: int = 0
    status_polls_unanswered: int = 0
    step_healthy_s: float | None = None
    step_slow_s: float | None = None
    step_after_s: float | None = None
    replaced: bool = False
    replacement_s: float | None = None
    named_node: str = ""
    link_probe: str = ""
    metrics: dict = field(default_factory=dict)
    status_text: str = ""
    slow_listed: list = field(default_factory=list)
    events: list = field(default_factory=list)
    final_status: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """The result as indented JSON."""
        return json.dumps(asdict(self), indent=2, default=str)


class _Job:
    """The processes of one drill job and their files."""

    def __init__(self, workdir: Path, nodes: int, nproc: int, spare: bool, action: str, worker_args: list[str],
                 hang_floor_s: float = 60.0, fabric=None, standby: bool = True) -> None:
        self.dir = workdir
        self.events = workdir / "events"
        self.events.mkdir(parents=True, exist_ok=True)
        self.stop_file = workdir / "stop"
        self.job = f"failslow-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.procs: list[subprocess.Popen] = []
        self.nodes = [f"n{i}" for i in range(nodes)] + (["spare0"] if spare and nodes > 1 else [])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.env = env
        self.fabric = fabric
        worker = ["-m", "trainguard.drill.failslow_worker", "--events", str(self.events), "--stop-file",
                  str(self.stop_file), *worker_args]
        common = ["--nproc-per-node", str(nproc), "--hang-floor-s", str(hang_floor_s), "--max-restarts", "5",
                  "--failslow-action", action, "--job", self.job, *([] if standby else ["--no-standby"])]
        self.metrics_url = ""
        if nodes == 1:
            from trainguard.agent.coordinator_link import find_free_port

            port = find_free_port("127.0.0.1")
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
            self._spawn("run-n0", ["run", "--node-id", "n0", "--metrics-listen", f"127.0.0.1:{port}", *common,
                                   *worker])
            return
        port_file = workdir / "coordinator.port"
        host = fabric.coordinator_host if fabric is not None else "127.0.0.1"
        self._spawn("coordinator", ["coordinator", "--job", self.job, "--listen", f"{host}:0", "--store",
                                    "memory://", "--nnodes", str(nodes), "--heartbeat-interval", "0.25",
                                    "--lease-timeout", "3", "--port-file", str(port_file), "--failslow-action",
                                    action, "--failslow-horizon", "600", "--failslow-cooldown", "30"])
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise SoakError("the drill's coordinator did not start within 30 s")
            time.sleep(0.05)
        target = f"{host}:{port_file.read_text().strip()}"
        for i, node in enumerate(self.nodes):
            spare_flag = ["--spare"] if node.startswith("spare") else []
            net = fabric.add(node) if fabric is not None else None
            addr = ["--address", net.data_ip] if net is not None else []
            self._spawn(f"run-{node}", ["run", "--coordinator", target, "--node-id", node, "--node-index", str(i),
                                        "--host", f"host{i}", *addr, *spare_flag, *common, *worker],
                        netns=net.netns if net is not None else "")

    def _spawn(self, name: str, args: list[str], netns: str = "") -> None:
        log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        cmd = [sys.executable, "-m", "trainguard.cli", "--log-level", "INFO", *args]
        env = self.env
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
            env = {**env, "GLOO_SOCKET_IFNAME": "data0"}
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def node_of_rank(self, rank: int, nproc: int) -> str:
        """The node holding ``rank`` in the first generation (nodes take ranks in index order)."""
        return self.nodes[rank // nproc]

    def steps(self, rank: int = 0) -> list[tuple[float, int, int, float, float]]:
        """(time, generation, step, step_s, comm_s) lines of ``rank``'s step log."""
        path = self.events / f"rank{rank}.steps"
        out = []
        try:
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 5:
                    out.append((float(parts[0]), int(parts[1]), int(parts[2]), float(parts[3]), float(parts[4])))
        except OSError:
            pass
        return out

    def pid_of(self, rank: int) -> tuple[int, int] | None:
        """(pid, generation) of ``rank``'s current worker."""
        try:
            pid, gen = (self.events / f"rank{rank}.pid").read_text().split()
            return int(pid), int(gen)
        except (OSError, ValueError):
            return None

    def status(self, node: str) -> dict | None:
        """What ``trainguard status --json`` shows for ``node``'s agent (the same GetHealth call, made in this
        process: a CLI start per poll would cost ~2 s here); None while it does not answer."""
        import grpc
        from google.protobuf import json_format

        from trainguard.proto import agent_pb2, agent_pb2_grpc

        try:
            sock = (self.events / f"agent-{node}.sock").read_text().strip()
        except OSError:
            return None
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            try:
                h = agent_pb2_grpc.NodeAgentStub(ch).GetHealth(agent_pb2.GetHealthRequest(max_events=20), timeout=5)
            except grpc.RpcError:
                return None
        return json_format.MessageToDict(h, preserving_proto_field_name=True)

    def status_text(self, node: str) -> str:
        """``trainguard status`` of ``node`` as an operator sees it."""
        try:
            sock = (self.events / f"agent-{node}.sock").read_text().strip()
        except OSError:
            return ""
        r = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", "--socket", sock], capture_output=True,
                           text=True, env=self.env, timeout=30)
        return r.stdout

    def failslow_metrics(self) -> dict[str, float]:
        """The ``trainguard_failslow_*`` samples of the node's ``/metrics`` (single-node drill; {} otherwise)."""
        if not self.metrics_url:
            return {}
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("trainguard_failslow_")}

    def kill(self) -> None:
        """Kills every process group the drill started (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _median_step(steps: list, t_from: float, t_to: float, gen: int | None = None) -> float | None:
    vals = [s[3] for s in steps if t_from <= s[0] < t_to and s[3] > 0 and (gen is None or s[1] == gen)]
    return statistics.median(vals) if len(vals) >= 3 else None


def _wait_steps(job: _Job, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(job.steps(0)) < n:
        if time.monotonic() > deadline:
            logs = "; ".join(f"{p.name}: {p.read_text()[-400:]}" for p in job.dir.glob("*.log"))
            raise SoakError(f"the drill job did not reach step {n} within {timeout:.0f} s ({logs})")
        if any(p.poll() is not None for p in job.procs):
            raise SoakError(f"a drill process exited early: see {job.dir}")
        time.sleep(0.2)


def poll_healthy(job: _Job, nodes: list[str], res: StragglerDrillResult) -> None:
    """One round of ``trainguard status`` polls in the healthy phase: every slow rank an answer lists is a false
    alarm. Only answers count as polls: an agent that did not answer saw nothing, and counting it as a clean poll
    reported "0 false alarms in N polls" for a healthy phase nobody watched."""
    for node in nodes:
        status = job.status(node)
        if status is None:
            res.status_polls_unanswered += 1
            continue
        res.status_polls_healthy += 1
        res.false_alarms += len(_slow_listed(status))


def _slow_listed(status: dict | None) -> list[dict]:
    return list(((status or {}).get("failslow") or {}).get("slow") or [])


def run_straggler_drill(cfg: StragglerDrillConfig, progress=print) -> StragglerDrillResult:
    """Runs the straggler drill (see the module docstring).

    Raises:
        SoakError: the job did not start, or the CPU throttle cannot be set up here.
    """
    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="tg-failslow-"))
    workdir.mkdir(parents=True, exist_ok=True)
    res = StragglerDrillResult(config=asdict(cfg))
    fabric = None
    if cfg.netns or cfg.link_rate:
        from trainguard.drill.netns import Fabric, netns_unavailable_reason

        why = netns_unavailable_reason()
        if why or cfg.nodes < 2:
            raise SoakError(f"the netns/link drill needs >= 2 nodes and network namespaces: {why or 'nodes < 2'}")
        fabric = Fabric().__enter__()
    throttle: CpuThrottle | LinkRateCap | None = None
    try:
        # Warm standbys only speed up a restart; a report-only drill restarts nothing, and each standby's imports
        # (torch, torch._dynamo: seconds of CPU) would land in the healthy phase whose step times form the baseline.
        job = _Job(workdir, cfg.nodes, cfg.nproc, cfg.spare, cfg.action, ["--width", str(cfg.width)],
                   fabric=fabric, standby=cfg.action == "replace")
    except BaseException:
        if fabric is not None:
            fabric.close()
        raise
    watched = [n for n in job.nodes if not n.startswith("spare")]
    try:
        _wait_steps(job, 20, timeout=120)
        progress(f"job running; watching {cfg.healthy_s:.0f} s of healthy training for false alarms")
        t_healthy = time.time()
        healthy_until = t_healthy + cfg.healthy_s
        if cfg.link_rate or cfg.throttle_all:
            # A slow link or a job-wide slowdown shows only against the job's own baseline, which forms over the
            # first windows of timing (2 warm-up + 5 baseline windows of 2 s) from the first step on: injecting
            # earlier spoils it. (Counted from when the drill saw step 20, it waited those 20 steps twice.)
            healthy_until = max(healthy_until, job.steps(0)[0][0] + BASELINE_FORMS_S)
        while time.time() < healthy_until:
            poll_healthy(job, watched, res)
            time.sleep(1.0)
        victim = job.pid_of(cfg.throttle_rank)
        if victim is None:
            raise SoakError(f"rank {cfg.throttle_rank} wrote no pid file: is the world that large?")
        t_inject = time.time()
        capped = job.node_of_rank(cfg.throttle_rank, cfg.nproc)
        if cfg.link_rate:
            throttle = LinkRateCap("data0", cfg.link_rate, netns=fabric.nodes[capped].netns)
            progress(f"node {capped}'s data link capped at {cfg.link_rate} (tbf)")
        elif cfg.throttle_all:
            world = cfg.nproc * len(watched)
            pids = [p[0] for p in (job.pid_of(r) for r in range(world)) if p is not None]
            throttle = CpuThrottle(cfg.throttle_fraction * len(pids))
            throttle.add(pids)
            progress(f"all {len(pids)} workers share {cfg.throttle_fraction * len(pids):g} CPU (job-wide slowdown)")
        else:
            throttle = CpuThrottle(cfg.throttle_fraction)
            throttle.add([victim[0]])
            progress(f"rank {cfg.throttle_rank} (pid {victim[0]}) capped at {cfg.throttle_fraction:g} CPU")
        deadline = t_inject + cfg.detect_timeout_s
        while time.time() < deadline:
            for node in watched:
                slow = _slow_listed(job.status(node))
                if cfg.throttle_all:  # healthy links: wait for a probe campaign to finish, whatever it says
                    res.link_probe = ((job.status(node) or {}).get("failslow") or {}).get("link_probe", "")
                    if res.link_probe and not res.link_probe.startswith("probing"):
                        res.detection_s = time.time() - t_inject
                        res.named_node = next((s.get("node_id", "") for s in slow if s.get("basis") == "link"), "")
                        res.slow_listed = slow
                        break
                    continue
                if cfg.link_rate:  # a slow link is a node finding (rank -1, basis "link")
                    hit = [s for s in slow if s.get("basis") == "link" and s.get("node_id") == capped]
                    res.link_probe = ((job.status(node) or {}).get("failslow") or {}).get("link_probe", "")
                else:
                    hit = [s for s in slow if int(s.get("rank", 0)) == cfg.throttle_rank]
                if hit:
                    res.detected, res.detection_s, res.slow_listed = True, time.time() - t_inject, slow
                    res.named_node = hit[0].get("node_id", "")
                    res.metrics = job.failslow_metrics()
                    break
            if res.detected or (cfg.throttle_all and res.detection_s is not None):
                break
            time.sleep(0.5)
        t_detect = time.time()
        progress(f"detected: {res.detected} after {res.detection_s or 0:.1f} s")
        steps = job.steps(0)
        res.step_healthy_s = _median_step(steps, t_healthy, t_inject)
        res.step_slow_s = _median_step(steps, t_inject + 2.0, t_detect)
        if res.step_slow_s is None and cfg.action == "report":
            # Detection came before three slow steps (a loaded machine: each step at the slow pace takes long).
            # A report changes nothing in the job, so the steps after it are still at the slow pace.
            deadline = time.time() + 60.0
            while res.step_slow_s is None and time.time() < deadline:
                time.sleep(0.5)
                res.step_slow_s = _median_step(job.steps(0), t_inject + 2.0, time.time())
        gen0 = max((s[1] for s in steps), default=1)
        if cfg.action == "replace" and res.detected:
            deadline = time.time() + cfg.detect_timeout_s
            while time.time() < deadline and max((s[1] for s in job.steps(0)), default=gen0) == gen0:
                time.sleep(0.25)
            new = [s for s in job.steps(0) if s[1] > gen0]
            res.replaced = bool(new)
            if new:
                res.replacement_s = new[0][0] - t_detect
                time.sleep(cfg.after_s)
                res.step_after_s = _median_step(job.steps(0), new[0][0] + 2.0, time.time())
        else:
            time.sleep(cfg.after_s)
            res.step_after_s = _median_step(job.steps(0), t_detect, time.time())
        res.status_text = job.status_text(watched[0])
        st = job.status(watched[0]) or {}
        res.events = [e for e in st.get("recent_events", []) if e.get("source") == "failslow"]
        res.final_status = {n: (job.status(n) or {}).get("failslow", {}) for n in watched}
        res.link_probe = next((f.get("link_probe", "") for f in res.final_status.values() if f.get("link_probe")),
                              res.link_probe)
        return res
    finally:
        if throttle is not None:
            throttle.close()
        job.kill()
        if fabric is not None:
            fabric.close()
        failed = (res.detection_s is None or bool(res.named_node)) if cfg.throttle_all else \
            (not res.detected or (cfg.action == "replace" and not res.replaced))
        if not cfg.workdir and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        elif failed:
            progress(f"logs kept in {workdir}")


@dataclass
class HangDrillConfig:
    """Knobs of the hang drill.

    Attributes:
        nodes: node agents (1: one ``trainguard run``); with more, one rank per node.
        nproc: workers per node.
        spare: add a spare node (multi-node only; the repeated outlier's node is then replaced).
        hang_rank: the rank that hangs.
        hang_step: the step at which it hangs (in each round's generation).
        rounds: generations in a row in which it hangs.
        hang_floor_s: the process detector's hang bound, seconds.
        workdir: folder for logs (a temporary one when empty; kept when given).
    """

    nodes: int = 1
    nproc: int = 3
    spare: bool = False
    hang_rank: int = 2
    hang_step: int = 25
    rounds: int = 1
    hang_floor_s: float = 4.0
    timeout_s: float = 90.0
    workdir: str = ""


@dataclass
class HangDrillResult:
    """What the hang drill found: one localisation per round."""

    config: dict
    findings: list = field(default_factory=list)
    correct: int = 0
    node_replaced: bool = False
    status_text: str = ""
    events: list = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        """Share of rounds whose outlier is exactly the hung rank."""
        return self.correct / len(self.findings) if self.findings else 0.0


def run_hang_drill(cfg: HangDrillConfig, progress=print) -> HangDrillResult:
    """Runs the hang drill (see the module docstring).

    Raises:
        SoakError: the job did not start.
    """
    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="tg-hang-"))
    workdir.mkdir(parents=True, exist_ok=True)
    res = HangDrillResult(config=asdict(cfg))
    gens = ",".join(str(g) for g in range(1, cfg.rounds + 1))
    job = _Job(workdir, cfg.nodes, cfg.nproc, cfg.spare, "report",
               ["--width", "128", "--hang-rank", str(cfg.hang_rank), "--hang-step", str(cfg.hang_step),
                "--hang-generations", gens], hang_floor_s=cfg.hang_floor_s,
               standby=cfg.rounds > 1 or cfg.spare)  # standbys serve the restarts between rounds only
    watched = [n for n in job.nodes if not n.startswith("spare")]
    try:
        _wait_steps(job, 5, timeout=120)
        seen: set[tuple] = set()
        deadline = time.monotonic() + cfg.timeout_s * cfg.rounds
        while len(res.findings) < cfg.rounds and time.monotonic() < deadline:
            for node in job.nodes:
                hang = ((job.status(node) or {}).get("failslow") or {}).get("hang")
                if not hang:
                    continue
                key = (int(hang.get("generation", 0)), hang.get("time"))
                if key in seen:
                    continue
                seen.add(key)
                outliers = [int(r) for r in hang.get("outlier_ranks", [])]
                res.findings.append(hang)
                res.correct += outliers == [cfg.hang_rank]
                progress(f"hang of generation {key[0]} localised to rank(s) {outliers} "
                         f"({hang.get('outlier_frame')})")
            time.sleep(0.5)
        for node in job.nodes:
            st = job.status(node) or {}
            res.events += [e for e in st.get("recent_events", []) if e.get("source") == "failslow"]
        res.status_text = job.status_text(watched[0])
        if cfg.spare and cfg.nodes > 1:
            logs = "".join(p.read_text(errors="replace") for p in job.dir.glob("coordinator.log"))
            res.node_replaced = "fail-slow: replacing node" in logs or "hang outlier" in logs
        return res
    finally:
        job.kill()
        if not cfg.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
