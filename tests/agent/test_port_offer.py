"""The MASTER_PORT a node offers stays held until the generation's store has it: nothing else on the host gets
it in between (the store bound it ~2 s after the coordinator named it, and a port found free then closed could
be taken meanwhile: the job failed with EADDRINUSE)."""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tg_testutil import EXAMPLE, REPO, ipv6_loopback

from trainguard.agent.errors import AgentError
from trainguard.agent.port_offer import KEPT_OFFERS, MasterPortOffer


def _plain_bind(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a bind without SO_REUSEADDR (what a process given that port by chance would hold) succeeds."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return True
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
            return False


def test_offered_ports_are_held_on_every_address_and_stores_still_bind_them() -> None:
    import torch.distributed as dist

    offer = MasterPortOffer("127.0.0.1")
    try:
        first = offer.port()
        second = offer.port()
        assert first != second  # every heartbeat offers a new one (see the stall test below)
        # Held on every address: the store binds them all, so a port held on the node's address alone could
        # be taken on another.
        hosts = ["127.0.0.1", "0.0.0.0"] + (["::1"] if ipv6_loopback() else [])
        assert not any(_plain_bind(first, h) for h in hosts)
        for _ in range(300):  # the kernel gives a held port to no bind(0)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] not in (first, second)
        # The generation's store (torch's TCPStore, either backend) binds a held port as if it were free.
        for libuv in (True, False):
            store = dist.TCPStore("0.0.0.0", first, world_size=None, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=10), use_libuv=libuv)
            client = dist.TCPStore("127.0.0.1", first, is_master=False, timeout=timedelta(seconds=10),
                                   use_libuv=libuv)
            client.set("k", "v")
            assert store.get("k") == b"v"
            del client, store
        offer.seen(3, second)  # generation 3's table names the second offer: held through that generation
        later = [offer.port() for _ in range(KEPT_OFFERS)]
        assert _plain_bind(first) and not _plain_bind(second)  # the first offer aged out; the named one stays
        assert not any(_plain_bind(p) for p in later)
        offer.seen(3, 0)  # the same generation again (a repeated START): nothing changes
        assert not _plain_bind(second)
        offer.seen(4, 1)  # a later generation on another node's port: generation 3's port goes
        assert _plain_bind(second) and sorted(offer.held()) == sorted(later)
    finally:
        offer.close()
    assert all(_plain_bind(p) for p in later) and offer.held() == []


def test_an_address_not_of_this_host_is_a_configuration_error() -> None:
    with pytest.raises(AgentError, match="--local-addr"):
        MasterPortOffer("192.0.2.1").port()


def test_a_generation_rank_0_never_heard_of_does_not_stall_the_next(tmp_path: Path) -> None:
    """Generation 1 formed on node a's offered port; node b got its START and failed before a's next heartbeat,
    so a never saw that table. Offering the same port until a table named it left every later generation
    without a fresh port: the coordinator planned generation 2 and never formed it (a review's repro)."""
    import grpc

    from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc
    from trainguard.recovery.service import CoordinatorServer, JobSpec

    spec = JobSpec(job="stall", nnodes=2, max_restarts=5, heartbeat_interval_s=0.1, lease_timeout_s=30,
                   backoff_initial_s=0.0, store=f"sqlite://{tmp_path}/c.db")
    server = CoordinatorServer(spec).start()
    channel = grpc.insecure_channel(server.target)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    offers: list[MasterPortOffer] = []

    class Node:
        def __init__(self, node_id: str, index: int) -> None:
            self.offer = MasterPortOffer("127.0.0.1")
            offers.append(self.offer)
            self.info = common_pb2.NodeInfo(node_id=node_id, address="127.0.0.1", topology=common_pb2.Topology(
                pod_id="p0", node_index=index, host=node_id, device_count=1))
            self.generation = -1
            self.lease = stub.RegisterNode(pb.RegisterNodeRequest(job="stall", node=self.info,
                                                                  free_port=self.offer.port())).lease_id

        def beat(self) -> pb.NodeHeartbeatResponse:
            r = stub.Heartbeat(pb.NodeHeartbeatRequest(job="stall", node_id=self.info.node_id, lease_id=self.lease,
                                                       generation=self.generation, free_port=self.offer.port()))
            if r.HasField("rank_table"):  # as the coordinator link does
                self.offer.seen(r.rank_table.generation, r.rank_table.master_port)
            if r.command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_RESTART):
                self.generation = r.rank_table.generation
            return r

    try:
        a, b = Node("a", 0), Node("b", 1)
        first = b.beat()
        assert first.command == pb.NODE_COMMAND_START and first.rank_table.generation == 1
        event = common_pb2.HealthEvent(node_id="b", source="process", kind="process.exit", message="boom",
                                       severity=common_pb2.SEVERITY_CRITICAL)
        stub.ReportEvent(pb.ReportEventRequest(job="stall", node_id="b", lease_id=b.lease, generation=1, event=event,
                                               proposed_level=pb.RECOVERY_LEVEL_PROCESS, failed_rank=1, exit_code=1))
        newest = 1
        for _ in range(50):
            newest = max(newest, a.beat().rank_table.generation, b.beat().rank_table.generation)
            if newest > 1:
                break
        assert newest == 2, "generation 2 never formed"
    finally:
        channel.close()
        server.stop()
        for offer in offers:
            offer.close()


def test_a_process_binding_the_master_port_after_the_generation_formed_does_not_fail_the_job(
        tmp_path: Path, tg_env: dict) -> None:
    """Plays the rest of the host: the moment the coordinator names the generation's MASTER_PORT, something
    binds it. Before, the bind got the port (free until the store's bind, after torch's import; a process that
    kept it failed the job: "restart budget exhausted after 0 restarts"); now the bind is refused and the job
    succeeds."""
    env = dict(tg_env, TRAINGUARD_CHECKPOINT_SHM_DIR=str(tmp_path / "shm"))
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--no-standby", "--job", f"port-offer-{tmp_path.name}", str(EXAMPLE), "--steps", "3",
           "--save-every", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    grabbed: list[bool] = []
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"generation 1 formed: .* master [\d.]+:(\d+)", line)
            if m and not grabbed:
                grabbed.append(_plain_bind(int(m.group(1))))
        assert proc.wait(timeout=120) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert grabbed == [False], "".join(lines)[-3000:]
