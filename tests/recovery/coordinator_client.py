"""A minimal real node agent speaking the coordinator protocol over gRPC, and a real `trainguard coordinator`
process to talk to (shared by the liveness and bad-bytes tests; imported by name like recovery_fixtures)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc

_ports = iter(range(41000, 60000))


def node_info(nid: str, pod: str = "p0", idx: int = 0, spare: bool = False, dev: int = 2,
              replaces: str = "") -> common_pb2.NodeInfo:
    """NodeInfo of a node on loopback."""
    return common_pb2.NodeInfo(node_id=nid, address="127.0.0.1", spare=spare, replaces=replaces,
                               topology=common_pb2.Topology(pod_id=pod, node_index=idx, host=nid, device_count=dev))


class Agent:
    """Registers, heartbeats (following START/RESTART/STOP) and reports faults, like a node agent."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub, job: str, info: common_pb2.NodeInfo) -> None:
        self.stub, self.job, self.info = stub, job, info
        self.gen, self.table, self.last = -1, None, None
        self.lease = stub.RegisterNode(pb.RegisterNodeRequest(job=job, node=info, free_port=next(_ports)),
                                       timeout=10).lease_id

    @property
    def node_id(self) -> str:
        """The node id."""
        return self.info.node_id

    def beat(self) -> pb.NodeHeartbeatResponse:
        """One heartbeat; applies the command."""
        resp = self.stub.Heartbeat(pb.NodeHeartbeatRequest(
            job=self.job, node_id=self.info.node_id, lease_id=self.lease, generation=self.gen,
            free_port=next(_ports), workers_running=2 if self.gen > 0 else 0), timeout=10)
        if resp.command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_RESTART):
            self.gen, self.table = resp.rank_table.generation, resp.rank_table
        elif resp.command == pb.NODE_COMMAND_STOP:
            self.gen = -1
        self.last = resp
        return resp

    def fail(self, level: int = pb.RECOVERY_LEVEL_PROCESS, kind: str = "process.exit", code: int = -9,
             rank: int = 0) -> pb.ReportEventResponse:
        """Reports a fault of this node's current generation."""
        sev = common_pb2.SEVERITY_CRITICAL
        ev = common_pb2.HealthEvent(node_id=self.node_id, source="test", kind=kind, message="boom", severity=sev)
        return self.stub.ReportEvent(pb.ReportEventRequest(
            job=self.job, node_id=self.node_id, lease_id=self.lease, generation=self.gen, event=ev,
            proposed_level=level, failed_rank=rank, exit_code=code), timeout=10)


class CoordinatorProcess:
    """``trainguard coordinator`` as a child process on a free port; its stderr is kept line by line."""

    def __init__(self, tmp: Path, env: dict[str, str], job: str, *flags: str, db: Path | None = None) -> None:
        """Starts the coordinator on a fresh SQLite store in ``tmp``, or on ``db`` (a restart on the same store)."""
        pf = tmp / f"port-{time.monotonic_ns()}"
        self.job = job
        self.db = db or tmp / f"{job}-{time.monotonic_ns()}.db"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "coordinator", "--job", job, "--listen", "127.0.0.1:0",
             "--store", f"sqlite://{self.db}", "--port-file", str(pf), *flags],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 30
        while not pf.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("coordinator did not start:\n" + "\n".join(self.lines[-20:]))
            time.sleep(0.05)
        self.target = f"127.0.0.1:{int(pf.read_text())}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append(line.rstrip())

    def log(self) -> str:
        """Everything the coordinator logged so far."""
        return "\n".join(self.lines)

    def agent(self, info: common_pb2.NodeInfo) -> Agent:
        """A registered agent."""
        return Agent(self.stub, self.job, info)

    def stop(self) -> None:
        """Terminates the process and closes the channel."""
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def beat_until(agents: list[Agent], done, timeout: float = 20.0, period: float = 0.1) -> None:
    """Heartbeats every agent each ``period`` until ``done()`` holds; fails with each agent's state on timeout."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("timed out: " + "; ".join(
                f"{a.node_id} gen {a.gen} ({a.last.message if a.last else ''})" for a in agents))
        for a in agents:
            a.beat()
        time.sleep(period)
