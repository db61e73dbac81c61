"""Peer replication as users run it: a real ``trainguard coordinator`` and ``trainguard run`` node agents on
loopback, each node with its own shared-memory arena, checked through what the agents log."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tg_testutil import REPO

SCRIPTS = Path(__file__).resolve().parent / "scripts"
_TARGETS = re.compile(r"replicating in-memory checkpoints to (.+)$")


def _coordinator(tmp: Path, env: dict[str, str], job: str, nnodes: int) -> tuple[subprocess.Popen, str]:
    port_file = tmp / "port"
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", job, "--listen",
                             "127.0.0.1:0", "--store", "memory://", "--nnodes", str(nnodes), "--heartbeat-interval",
                             "0.2", "--port-file", str(port_file)],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp / "coordinator.log", "w"))
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / "coordinator.log").read_text()
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def _node(tmp: Path, env: dict[str, str], coordinator: str, job: str, node: str, *flags: str) -> subprocess.Popen:
    """One node's ``trainguard run`` (one sleeping worker), its arena under ``tmp/shm-NODE``, its log in
    ``tmp/NODE.log``."""
    env = dict(env, TRAINGUARD_CHECKPOINT_SHM_DIR=str(tmp / f"shm-{node}"), TRAINGUARD_RUN_REGISTRY=str(tmp / node))
    return subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--coordinator", coordinator, "--job", job,
                             "--node-id", node, "--address", "127.0.0.1", "--nproc-per-node", "1",
                             "--checkpoint-dir", str(tmp / "ckpt"), *flags, str(SCRIPTS / "sleeper.py")],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{node}.log", "w"))


def _targets(tmp: Path, node: str) -> list[str]:
    """The buddies ``node`` was last told to replicate to (None before it was told any)."""
    found = [m.group(1) for ln in (tmp / f"{node}.log").read_text().splitlines() if (m := _TARGETS.search(ln))]
    return found[-1].split(", ") if found else None


def test_a_node_given_no_replica_memory_is_never_a_buddy_but_still_replicates_its_own(tmp_path, tg_env) -> None:
    """Found by a review: `trainguard run --replica-memory-mib 0` (hold no other node's replicas) still made the
    node a buddy, so a peer pushed its copies there, each refused, and that peer's ranks had no copy in any
    other node's memory. The node now tells the coordinator it holds none: the others replicate among
    themselves, and the node still replicates its own ranks to one of them."""
    coord, address = _coordinator(tmp_path, tg_env, "rjob", 3)
    nodes = {}
    try:
        # c serves (and reports its replica address) before the others join, so no table is ever made without it.
        nodes["c"] = _node(tmp_path, tg_env, address, "rjob", "c", "--replica-memory-mib", "0")
        deadline = time.monotonic() + 90
        while "serving in-memory" not in (tmp_path / "c.log").read_text():
            assert nodes["c"].poll() is None and time.monotonic() < deadline, (tmp_path / "c.log").read_text()
            time.sleep(0.05)
        for name in "ab":
            nodes[name] = _node(tmp_path, tg_env, address, "rjob", name)
        while any(_targets(tmp_path, n) in (None, ["nobody"]) for n in "abc"):
            for n, p in nodes.items():
                assert p.poll() is None, (tmp_path / f"{n}.log").read_text()
            assert time.monotonic() < deadline, {n: (tmp_path / f"{n}.log").read_text()[-1500:] for n in "abc"}
            time.sleep(0.1)
        told = {n: _targets(tmp_path, n) for n in "abc"}
        assert all("c" not in buddies for buddies in told.values()), told
        assert told["a"] == ["b"] and told["b"] == ["a"] and told["c"] in (["a"], ["b"]), told
        serving = [ln for ln in (tmp_path / "c.log").read_text().splitlines() if "serving in-memory" in ln]
        assert serving and "only serving this node's own" in serving[0], serving  # own copies for replacements
    finally:
        for p in nodes.values():
            p.send_signal(signal.SIGTERM)
        for p in nodes.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        coord.kill()
        coord.wait()
