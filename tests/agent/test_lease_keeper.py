"""agent/lease_keeper.py: the lease is renewed while the agent's loop is stuck in a slow, GIL-holding step."""

from __future__ import annotations

import threading
import time

from trainguard.agent.lease_keeper import keep_lease


def _busy(seconds: float) -> None:
    """Pure-Python work holding the GIL between switches (what imports do to the agent's loop)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(2000))


def test_ticks_keep_coming_while_the_caller_is_busy_and_stop_after():
    ticks: list[float] = []
    t0 = time.monotonic()
    with keep_lease(lambda: ticks.append(time.monotonic()), 0.1, "test"):
        _busy(2.0)
    n = len(ticks)
    assert n >= 5, f"only {n} keep-alives in 2 s at 0.1 s"
    gaps = [b - a for a, b in zip([t0, *ticks], ticks)]
    assert max(gaps) < 1.5, gaps  # never a gap anywhere near a lease (3 s by default); slack for a loaded box
    time.sleep(0.4)
    assert len(ticks) == n, "the keeper went on after the block"
    assert not any(t.name.startswith("lease-keeper") for t in threading.enumerate())


def test_a_failing_tick_never_breaks_the_step_it_guards():
    calls = []

    def tick() -> None:
        calls.append(1)
        raise RuntimeError("coordinator unreachable")

    with keep_lease(tick, 0.05, "test"):
        time.sleep(0.4)
    assert len(calls) >= 3


def test_an_exception_in_the_block_still_stops_the_keeper():
    ticks = []
    try:
        with keep_lease(lambda: ticks.append(1), 0.05, "test"):
            raise ValueError("boom")
    except ValueError:
        pass
    n = len(ticks)
    time.sleep(0.3)
    assert len(ticks) == n


def test_an_agent_whose_detectors_start_slowly_keeps_its_lease_and_its_slot(tmp_path):
    """The replace-drill flake: on a loaded host the agent spent > the 3 s lease starting its detectors (imports)
    right after registering; the coordinator declared the node lost and gave its slot to the spare. Here a detector
    takes 6 s to build against a 3 s lease (real coordinator over gRPC, real agent, real worker; a shorter lease
    than the default 3 s lost the node to scheduling delays of a loaded CI box, not to the bug)."""
    import sys

    from trainguard.agent.node import NodeAgent, NodeConfig
    from trainguard.detectors.base import Detector, Sample, register_detector
    from trainguard.recovery.service import CoordinatorServer, JobSpec

    @register_detector
    class SlowStart(Detector):  # a detector whose import/setup takes seconds
        name = "test-slow-start"

        def __init__(self, *a, **kw) -> None:
            time.sleep(6.0)
            super().__init__(*a, **kw)

        def sample(self) -> Sample:
            return Sample()

    srv = CoordinatorServer(JobSpec(job="lk", nnodes=1, heartbeat_interval_s=0.1, lease_timeout_s=3.0,
                                    backoff_initial_s=0.0, max_restarts=3)).start()
    try:
        agent = NodeAgent(NodeConfig(job="lk", coordinator=srv.target, argv=[sys.executable, "-c", "pass"],
                                     node_id="n0", detectors=("test-slow-start",), host_store=False,
                                     socket_path=str(tmp_path / "a.sock")))
        assert agent.run() == 0, agent.final_message
        st = srv.core.state
        assert st.restart_count == 0 and st.generation == 1, f"the node lost its lease: {st.message}"
    finally:
        srv.stop()
