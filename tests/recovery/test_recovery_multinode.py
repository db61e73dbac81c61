"""Multi-node jobs for real: a standalone coordinator, one node agent per node, a gloo DDP job across them.

Nodes are either agents on loopback, or agents each in its own network namespace with a veth pair on a bridge
and its own IP (created here; skipped with the reason when namespaces are not permitted). Scenarios:

- a worker SIGKILLed (process level) and then the coordinator SIGKILLed and restarted mid-run (loopback);
- a node lost: its link taken down (netns) or its whole agent and workers SIGKILLed (loopback); a spare takes
  its slot (node level).

After each, training finishes with parameters bitwise equal to a fault-free run, and the recovery time
(fault to the new generation's resume) is printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

import tg_testutil

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train.py"
STEPS = 24
TRAIN_ARGS = ["--steps", str(STEPS), "--save-every", "4", "--step-delay", "0.05"]


class Proc:
    """A child process in its own session whose output lines are kept with their arrival times."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, cwd=REPO)
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.lines.append((time.time(), line.rstrip()))

    def wait_line(self, pattern: str, timeout: float, after: float = 0.0) -> float:
        return self.wait_match(pattern, timeout, after)[0]

    def wait_match(self, pattern: str, timeout: float, after: float = 0.0) -> tuple[float, re.Match[str]]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0  # lines only ever append: each poll searches the new ones (agents log a line per heartbeat)
        while time.monotonic() < deadline:
            done = self.p.poll() is not None and not self._t.is_alive()  # before the scan: no last line missed
            for t, line in self.lines[seen:]:
                seen += 1
                m = rx.search(line) if t >= after else None
                if m:
                    return t, m
            if done:
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no line matching {pattern!r} within {timeout:.0f} s; "
                             f"exit {self.p.poll()}; output tail:\n" + "\n".join(l for _, l in self.lines[-40:]))

    def kill(self) -> None:
        """SIGKILLs the process, its process group and every descendant (workers may have their own session)."""
        try:
            tree = psutil.Process(self.p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for c in tree:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
        self.p.wait(10)
        self._t.join(5)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def _env(marker: str, ifname: str) -> dict[str, str]:
    return dict(os.environ, TG_TEST_MARKER=marker, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR",
                GLOO_SOCKET_IFNAME=ifname, OMP_NUM_THREADS="1")


def _coordinator(procs: list[Proc], env: dict, tmp: Path, listen: str, store: str, lease: float,
                 name: str = "coordinator") -> tuple[Proc, int]:
    pf = tmp / f"{name}-{uuid.uuid4().hex[:6]}.port"
    p = Proc([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "mn", "--listen", listen, "--store",
              store, "--nnodes", "2", "--max-restarts", "3", "--heartbeat-interval", "0.2", "--lease-timeout",
              str(lease), "--backoff", "0", "--port-file", str(pf)], env, name)
    procs.append(p)
    deadline = time.monotonic() + 60
    while not pf.exists():
        assert p.p.poll() is None and time.monotonic() < deadline, p.text()
        time.sleep(0.05)
    return p, int(pf.read_text())


def _agent(procs: list[Proc], env: dict, coord: str, node: str, index: int, address: str, ckpt: Path,
           out: Path | None, extra: list[str] = (), netns: str | None = None, train: list[str] = ()) -> Proc:
    argv = [sys.executable, "-m", "trainguard.cli", "run", "--coordinator", coord, "--job", "mn", "--node-id", node,
            "--host", node, "--pod", "pod-0", "--node-index", str(index), "--address", address,
            "--nproc-per-node", "1", "--max-restarts", "3", "--checkpoint-dir", str(ckpt), *extra, str(EXAMPLE),
            *TRAIN_ARGS, *train] + (["--out", str(out)] if out else [])
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    p = Proc(argv, env, node)
    procs.append(p)
    return p


def _free_port() -> int:
    return tg_testutil.free_port()


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory) -> str:
    """Parameters of a fault-free run of the same 2-rank job, the reference every scenario must match.

    Two plain workers on loopback, started as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT), with no
    coordinator or node agents: the digest depends only on the seed, the steps and the world size (gloo's
    2-rank all-reduce is the same sum however the ranks were launched), and the agents and coordinator cost about
    as much CPU as the workers (each agent imports torch for the store), ~10 s of this fixture on a loaded
    2-core CI box. Being launched without trainguard also makes it a reference independent of the launcher."""
    tmp = tmp_path_factory.mktemp("clean")
    out = tmp / "out.json"
    env = dict(_env(uuid.uuid4().hex, "lo"), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # no --step-delay (a sleep between steps changes no parameter) and no checkpoints (nothing restores)
    argv = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--save-every", "0"]
    started = [Proc([*argv, "--out", str(out)], dict(env, RANK="0", LOCAL_RANK="0"), "clean-rank0"),
               Proc(argv, dict(env, RANK="1", LOCAL_RANK="1"), "clean-rank1")]
    try:
        for p in started:
            assert p.p.wait(150) == 0, p.text()[-3000:]
        return json.loads(out.read_text())["params_sha256"]
    finally:
        for p in started:
            p.kill()


def _no_orphans(marker: str) -> None:
    deadline = time.monotonic() + 5
    while True:
        left = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get("TG_TEST_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for proc in left:
        proc.kill()
    assert not left, f"orphans: {[p.pid for p in left]}"


def _faulty_pair(procs: list[Proc], tmp: Path, lease: float, train: list[str] = ()):
    """A coordinator (sqlite store) and two loopback nodes whose rank 1 is SIGKILLed at step 9 (``train``: more
    arguments of the training script); returns (marker, env, store, coordinator, its port, n0, n1, rank 0's result
    file)."""
    marker = uuid.uuid4().hex
    env = _env(marker, "lo")
    store = f"sqlite://{tmp}/state.db"
    coord, port = _coordinator(procs, env, tmp, "127.0.0.1:0", store, lease)
    target = f"127.0.0.1:{port}"
    out = tmp / "out.json"
    n0 = _agent(procs, env, target, "n0", 0, "127.0.0.1", tmp / "ck", out, train=train)
    n1 = _agent(procs, env, target, "n1", 1, "127.0.0.1", tmp / "ck", None, ["--fault", "1:9:KILL"], train=train)
    return marker, env, store, coord, port, n0, n1, out


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_worker_kill_then_coordinator_kill_loopback(tmp_path, procs, clean_digest) -> None:
    # 0.2 s steps (a sleep: the parameters stay the reference's): the 15 steps after the fault outlast the
    # coordinator's restart with seconds to spare on a loaded box.
    marker, env, store, coord, port, n0, n1, out = _faulty_pair(procs, tmp_path, 10.0, ["--step-delay", "0.2"])
    t_kill = n1.wait_line(r"fault injected: SIGKILL to rank 1", 150)
    # Now the coordinator itself dies mid-run and comes back on the same port with the same store. It dies as
    # generation 2's workers start: killed once rank 0 had resumed, it came back after the last step (review:
    # 16 steps of 0.05 s are done in about a second), so "the job continued" showed only the agents reporting
    # their end to the restored coordinator.
    n0.wait_line(r"generation 2: started ranks", 90, after=t_kill)
    t_ckill = time.time()
    coord.kill()
    coord2, port2 = _coordinator(procs, env, tmp_path, f"127.0.0.1:{port}", store, 10.0, "coordinator2")
    t_back = time.time()
    assert port2 == port
    t_resume = n0.wait_line(r"\[rank 0\] generation 2: starting at step", 90, after=t_kill)
    print(f"\nprocess level (worker SIGKILL): recovery {t_resume - t_kill:.2f} s (fault -> new generation resumes)")
    t_done = n0.wait_line(r"\[rank 0\] done:", 150, after=t_kill)
    assert t_done > t_back, (f"training ended {t_back - t_done:.1f} s before the restored coordinator was up: the "
                             "coordinator was not down mid-run")
    assert n0.p.wait(150) == 0, n0.text()[-3000:]
    assert n1.p.wait(30) == 0, n1.text()[-3000:]
    result = json.loads(out.read_text())
    print(f"coordinator SIGKILL: job continued, down {t_back - t_ckill:.1f} s, back {t_done - t_back:.1f} s before "
          "the last step; "
          f"restart_count {result['restart_count']}")
    assert result["restart_count"] == 1
    assert result["params_sha256"] == clean_digest
    assert "restored from store" in coord2.text()
    coord2.kill()
    _no_orphans(marker)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_worker_lost_while_the_coordinator_is_down_is_recovered_once_it_is_back(tmp_path, procs,
                                                                              clean_digest) -> None:
    """The failure report goes out while the coordinator is down: it is sent again once the coordinator is back,
    so the job moves to generation 2 with a fresh port and a counted restart (found by a user's review: the node,
    its workers stopped, asked for work, and the restored coordinator started generation 1 again on its old
    port with restart count 0, uncounted)."""
    marker, env, store, coord, port, n0, n1, out = _faulty_pair(procs, tmp_path, 30.0)
    for node in (n0, n1):  # both run generation 1 (their workers still start up: the fault is at step 9)
        node.wait_line(r"generation 1: started ranks", 150)
    coord.kill()
    t_kill = n1.wait_line(r"fault injected: SIGKILL to rank 1", 60)
    t_unsent = n1.wait_line(r"could not report the failure to the coordinator", 30, after=t_kill)
    # Its heartbeats meanwhile find no coordinator either (the report waits to be sent again).
    n1.wait_line(r"coordinator still unreachable: \d+ failure report", 30, after=t_unsent)
    coord2, _ = _coordinator(procs, env, tmp_path, f"127.0.0.1:{port}", store, 30.0, "coordinator2")
    assert n0.p.wait(150) == 0, n0.text()[-3000:]
    assert n1.p.wait(30) == 0, n1.text()[-3000:]
    result = json.loads(out.read_text())
    assert result["restart_count"] == 1 and result["params_sha256"] == clean_digest, result
    for node in (n0, n1):  # generation 1 ran once; the recovery is generation 2
        text = node.text()
        assert len(re.findall(r"generation 1: started ranks", text)) == 1, text[-3000:]
        assert re.search(r"generation 2: started ranks", text), text[-3000:]
    ports = re.findall(r"generation (\d+): started ranks \d+\.\.\d+ \(master [^:]+:(\d+)\)", n0.text())
    assert len({p for _, p in ports}) == len(ports) == 2, ports  # generation 2 got a port of its own
    assert "failure report sent again" in n1.text()
    coord2.kill()
    _no_orphans(marker)


class Bridge:
    """A bridge in the root namespace and one namespace per node with a veth pair and its own IP."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.br = f"tgb{self.tag}"
        self.subnet = f"10.{77 + int(self.tag[:2], 16) % 100}.{int(self.tag[2:4], 16)}"
        self.gw = f"{self.subnet}.1"
        self.ns: dict[str, tuple[str, str, str]] = {}  # node -> (netns, host-side veth, ip)
        self._sh(f"ip link add {self.br} type bridge")
        self._sh(f"ip addr add {self.gw}/24 dev {self.br}")
        self._sh(f"ip link set {self.br} up")

    @staticmethod
    def _sh(cmd: str) -> None:
        r = subprocess.run(cmd.split(), capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cmd}: {r.stderr.strip()}")

    def add(self, node: str) -> tuple[str, str]:
        k = len(self.ns)
        ns, host, peer, ip = f"tg{self.tag}{k}", f"tgh{self.tag}{k}", f"tgp{self.tag}{k}", f"{self.subnet}.{10 + k}"
        self._sh(f"ip netns add {ns}")
        self._sh(f"ip link add {host} type veth peer name {peer}")
        self._sh(f"ip link set {peer} netns {ns}")
        self._sh(f"ip link set {host} master {self.br}")
        self._sh(f"ip link set {host} up")
        self._sh(f"ip netns exec {ns} ip link set lo up")
        self._sh(f"ip netns exec {ns} ip link set {peer} name eth0")
        self._sh(f"ip netns exec {ns} ip addr add {ip}/24 dev eth0")
        self._sh(f"ip netns exec {ns} ip link set eth0 up")
        self.ns[node] = (ns, host, ip)
        return ns, ip

    def link_down(self, node: str) -> None:
        self._sh(f"ip link set {self.ns[node][1]} down")

    def close(self) -> None:
        for ns, host, _ in self.ns.values():
            subprocess.run(["ip", "link", "del", host], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.br], capture_output=True)


def _netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"tgprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        return f"network namespaces not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", ["netns-link-down", "loopback-agent-kill"])
def test_lost_node_replaced_by_spare(tmp_path, procs, clean_digest, mode) -> None:
    marker = uuid.uuid4().hex
    bridge = None
    if mode.startswith("netns"):
        reason = _netns_reason()
        if reason:
            pytest.skip(reason)
        bridge = Bridge()
    try:
        env = _env(marker, "eth0" if bridge else "lo")
        listen_host = bridge.gw if bridge else "127.0.0.1"
        coord, port = _coordinator(procs, _env(marker, "lo"), tmp_path, f"{listen_host}:0",
                                   f"sqlite://{tmp_path}/state.db", 3.0)
        target = f"{listen_host}:{port}"
        out = tmp_path / "out.json"
        agents = {}
        # n1 is lost and never restarts: no warm standby for it. n0 restarts (warm) and the spare takes over
        # (warm, as it waits), as in service.
        for node, index, extra in (("n0", 0, []), ("n1", 1, ["--no-standby"]), ("spare", 9, ["--spare"])):
            ns, ip = bridge.add(node) if bridge else (None, "127.0.0.1")
            agents[node] = _agent(procs, env, target, node, index, ip, tmp_path / "ck",
                                  out if node == "n0" else None, extra, netns=ns)
        t_start = agents["n0"].wait_line(r"\[rank 0\] generation 1: starting at step", 150)
        # Some progress: rank 0's first save (every 4 steps), replicated to its buddy, well before the 24 steps end.
        agents["n0"].wait_line(r"replicated rank 0 step \d+ to n1", 60, after=t_start)
        t_fault = time.time()
        if bridge:
            bridge.link_down("n1")
        else:
            agents["n1"].kill()
        # The spare's generation is not always 2: when n1 dies, rank 0's gloo read fails at once and its agent
        # may restart it in place (generation 2) before the coordinator's lease on n1 runs out; the node-level
        # replacement is then generation 3. What matters is the generation the spare takes rank 1 in.
        _, started = agents["spare"].wait_match(r"generation (\d+): started ranks 1\.\.1", 90, after=t_fault)
        t_resume = agents["n0"].wait_line(rf"\[rank 0\] generation {started.group(1)}: starting at step", 60,
                                          after=t_fault)
        print(f"\nnode level ({mode}): recovery {t_resume - t_fault:.2f} s (fault -> spare's generation resumes; "
              f"lease timeout 3 s); generation 1 started {t_fault - t_start:.1f} s before the fault")
        assert agents["n0"].p.wait(150) == 0, agents["n0"].text()[-3000:]
        assert agents["spare"].p.wait(30) == 0, agents["spare"].text()[-3000:]
        result = json.loads(out.read_text())
        assert result["params_sha256"] == clean_digest
        assert "replacing n1->spare" in coord.text(), coord.text()[-3000:]
    finally:
        for p in procs:
            p.kill()
        if bridge:
            bridge.close()
    _no_orphans(marker)
