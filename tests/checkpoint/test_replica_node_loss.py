"""The cross-node memory tier as a user meets it: a node of a 2-rank job is killed with kill -9 after a few saves,
and the node replacing it restores the newest step from the replica its buddy holds, not from disk, bit for bit.

Nodes are emulated as the agent tests do: each node is its own shared-memory root; the buddy serves its replicas
over real gRPC on loopback (agent/replica_transport.py); the workers are real processes with their own persist
processes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
import uuid

import psutil
import pytest
import torch

from trainguard.agent.memory_tier import MemoryTier
from trainguard.agent.replica_agent import ReplicaAgent, ReplicaConfig
from trainguard.agent.replica_transport import ReplicaServer, ReplicaServicer, Throttle, copy_stream, push
from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.config import RESTORE_PLAN_ENV
from trainguard.checkpoint.replica_store import ReplicaStore
from trainguard.proto import coordinator_pb2 as pb

# Rank 1 of 2 on node b: "save N" saves the state of step N, waits, and prints a digest of every byte saved.
WORKER = textwrap.dedent("""
    import hashlib, json, sys, torch
    from trainguard.checkpoint import Checkpointer, CheckpointConfig

    def state(step):
        g = torch.Generator().manual_seed(1000 + step)
        return {"w": torch.randn(64, 1024, generator=g), "b": torch.randint(0, 2**31, (4096,), generator=g)}

    def digest(s):
        return hashlib.sha256(b"".join(s[k].numpy().tobytes() for k in sorted(s))).hexdigest()

    cfg = CheckpointConfig(directory=sys.argv[1], memory={"directory": sys.argv[2]})
    ck = Checkpointer(cfg, rank=1, world_size=2, job="job")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "save":
            s = state(int(cmd[1]))
            ok = ck.save(s, int(cmd[1])).wait(60)
            print(json.dumps({"ok": ok, "digest": digest(s)}), flush=True)
""")


@pytest.fixture
def node_roots():
    made = {n: f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}-{n}" for n in "abc"}
    yield made
    for d in made.values():
        shutil.rmtree(d, ignore_errors=True)


def _ask(p: subprocess.Popen[str], line: str) -> dict:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    out = p.stdout.readline()
    assert out, f"worker died answering {line!r}"
    return json.loads(out)


def test_a_replacement_node_restores_the_killed_nodes_newest_step_from_its_buddys_replica(tmp_path, node_roots,
                                                                                          tg_env, monkeypatch):
    ckdir = str(tmp_path / "ckpt")  # shared by both nodes: every step is on disk too
    location = CheckpointConfig(directory=ckdir).location
    a_root, b_root, c_root = node_roots["a"], node_roots["b"], node_roots["c"]
    cmd = [sys.executable, "-c", WORKER, ckdir]
    store_a = ReplicaStore(a_root, "job", 1 << 30, location=location)
    server_a = ReplicaServer(ReplicaServicer("job", store_a, MemoryTier(a_root, "job", location).own_copy),
                             "127.0.0.1")
    # Rank 0 lives on node a (inline persist: no process of its own to start); its copies complete every step on
    # the shared disk, so a restore that missed the replica would load step 12 from disk and say so.
    rank0 = Checkpointer(CheckpointConfig(directory=ckdir, memory={"directory": a_root}, persist={"service": "inline"}),
                         rank=0, world_size=2, job="job")
    b = subprocess.Popen(cmd + [b_root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=tg_env)
    try:
        digests = {}
        tier_b = MemoryTier(b_root, "job", location)
        for step in (4, 8, 12):
            assert rank0.save({"w": torch.full((64, 1024), float(step)), "b": torch.zeros(4096, dtype=torch.int64)},
                              step).wait(60)
            out = _ask(b, f"save {step}")
            assert out["ok"]
            digests[step] = out["digest"]
            tier_b.scan()
            path, man = tier_b.own_copy(1)  # node b's agent pushes each new snapshot to its buddy a
            assert man.step == step
            assert push(server_a.address, copy_stream("job", man, path, "b", Throttle(0)), 30).ok
        assert [(r.rank, r.step) for r in store_a.replicas()] == [(1, 12)]

        # Node b is lost: kill -9 of its worker and persist process, and its memory with it.
        victims = [psutil.Process(b.pid)] + psutil.Process(b.pid).children(recursive=True)
        for v in victims:
            v.kill()
        b.wait()
        shutil.rmtree(b_root)

        # Its replacement fetches rank 1's copy from the buddy as the coordinator's plan says, then starts rank 1.
        fetcher = ReplicaAgent(ReplicaConfig(timeout_s=10), MemoryTier(c_root, "job", location), "c", "127.0.0.1")
        plan = pb.MemoryRestorePlan(step=12, memory_steps=[12], ranks=[
            pb.RankRestore(rank=1, source=pb.RESTORE_SOURCE_PEER_MEMORY, peer_node="a",
                           peer_address=server_a.address)])
        assert fetcher.fetch_planned(plan, [1]) == [1]
        # The agent hands its workers the plan's job-wide memory steps (rank 0's copy is in a's memory). Rank 1
        # starts on c (in this process: a fresh Checkpointer on c's memory, inline persist).
        monkeypatch.setenv(RESTORE_PLAN_ENV, json.dumps({"step": 12, "memory_steps": [12]}))
        c = Checkpointer(CheckpointConfig(directory=ckdir, memory={"directory": c_root},
                                          persist={"service": "inline"}), rank=1, world_size=2, job="job")
        state = {"w": torch.zeros(64, 1024), "b": torch.zeros(4096, dtype=torch.int64)}
        assert c.restore(state) == 12
        assert c.last_restore_tier == "memory"  # the buddy's replica, not the disk's copy
        assert hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest() == digests[12]
        c.close()
    finally:
        rank0.close()
        server_a.stop()
        if b.poll() is None:
            b.kill()
            b.wait()
