"""A store that accepts requests but does not answer them (etcd SIGSTOPped, a stuck disk): leases still expire on
time, and the stall is said at WARNING. Before, the reaper read the fence key on its own thread and waited for
the store client's timeout (~20 s), so a dead node was declared lost only once the store answered again, and
nothing was logged in between."""

from __future__ import annotations

import logging
import threading
import time

import grpc
from coordinator_client import Agent, beat_until, node_info

from trainguard.proto import coordinator_pb2_grpc
from trainguard.recovery import CoordinatorServer, JobSpec
from tg_testutil import gated_store

JOB = "stall"
LEASE_S = 1.0


def test_a_lease_expires_on_time_while_the_store_hangs(caplog) -> None:
    caplog.set_level(logging.INFO, logger="trainguard.recovery.coordinator")
    store = gated_store(reads=True)
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.1, lease_timeout_s=LEASE_S),
                            store=store).start()
    chan = grpc.insecure_channel(srv.target)
    stop = threading.Event()
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(chan)
        a, b = Agent(stub, JOB, node_info("a", idx=0)), Agent(stub, JOB, node_info("b", idx=1))
        spare = Agent(stub, JOB, node_info("s", idx=2, spare=True))
        beat_until([a, b, spare], lambda: a.gen == 1 and b.gen == 1, period=0.05)

        def keep_alive(agent: Agent) -> None:
            while not stop.is_set():
                try:
                    agent.beat()  # held by the service while the generation it is told to START is not durable
                except grpc.RpcError:
                    pass
                stop.wait(0.1)

        for agent in (a, spare):
            threading.Thread(target=keep_alive, args=(agent,), daemon=True).start()
        store.gate.clear()  # the store hangs from here; b goes silent
        hung_at = time.monotonic()
        deadline = hung_at + LEASE_S + 4.0  # the lease, the 3-interval stretch, reaper ticks and a loaded box
        while srv.core.members()["b"].alive:
            assert time.monotonic() < deadline, "b's lease did not expire while the store hung"
            time.sleep(0.05)
        assert srv.core.members()["a"].alive  # heartbeats still renew leases
        lost = [r for r in caplog.records if "node b lost" in r.getMessage()]
        assert lost and lost[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
        while not [r for r in caplog.records if "has not answered" in r.getMessage()]:
            assert time.monotonic() < deadline + 3.0, "the stalled store was not reported"
            time.sleep(0.05)
        said = next(r for r in caplog.records if "has not answered" in r.getMessage())
        assert said.levelno == logging.WARNING and srv.core.spec.store in said.getMessage()
        assert 2.0 <= float(said.getMessage().split("has not answered for ")[1].split(" s")[0]) < 10.0
        # The spare took b's slot: a and s, told to START generation 2, have their heartbeats held while the
        # store hangs (up to their 10 s deadline), which is no silence: neither is lost for it.
        assert srv.core.state.generation == 2, srv.core.state
        time.sleep(LEASE_S + 3.0)
        members = srv.core.members()
        assert members["a"].alive and members["s"].alive, [r.getMessage() for r in caplog.records]
        assert srv.core.state.generation == 2 and srv.core.state.restart_count == 1, srv.core.state
    finally:
        stop.set()
        store.gate.set()
        chan.close()
        srv.stop(0)
