"""Wall-clock steps while the coordinator runs (NTP stepping the clock): the policy's persisted times follow the
monotonic clock, so a step moves neither a backoff deadline nor a membership wait."""

from __future__ import annotations

from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.domain import Beat, Command, FaultReport, NodeRecord
from trainguard.recovery.policy import Cause, Level, Phase
from trainguard.recovery.spec import JobSpec
from trainguard.recovery.store import MemoryStore


class _Clocks:
    def __init__(self) -> None:
        self.mono, self.wall = 100.0, 1_700_000_000.0

    def tick(self, s: float) -> None:
        self.mono += s
        self.wall += s


def _job(clocks: _Clocks, **spec):
    core = JobCoordinator(JobSpec(job="cs", nnodes=1, heartbeat_interval_s=0.5, lease_timeout_s=5.0, **spec),
                          store=MemoryStore(), clock=lambda: clocks.mono, wall=lambda: clocks.wall)
    lease = core.register("cs", NodeRecord("n0", "p", 0, "h0", 1), 20000)[0]
    gen = [-1]

    def beat():
        ins = core.heartbeat(Beat("cs", "n0", lease, gen[0], 1 if gen[0] > 0 else 0,
                                  free_port=30000 + int(clocks.mono))).response
        if ins.command in (Command.START, Command.RESTART):
            gen[0] = ins.table.generation
        return ins

    def fail():
        core.report(FaultReport("cs", "n0", lease, gen[0], Cause.WORKER_EXIT, Level.PROCESS, rank=0, exit_code=1,
                                detail="rank 0 exited 1"))
    return core, beat, fail, gen


def test_a_clock_stepped_back_does_not_hold_a_restart_for_the_size_of_the_step() -> None:
    clocks = _Clocks()
    core, beat, fail, gen = _job(clocks, backoff_initial_s=2.0, backoff_max_s=10.0, max_restarts=5)
    beat()
    assert gen[0] == 1
    fail()  # first restart: no backoff
    beat()
    assert gen[0] == 2
    fail()  # second in a row, no progress: 2 s backoff
    clocks.wall -= 3600.0  # NTP steps the clock back an hour
    for _ in range(10):
        clocks.tick(0.5)
        core.reap()
        beat()
    assert gen[0] == 3, (gen, core.state)  # started after its 2 s, not an hour later
    core.close()


def test_a_clock_stepped_forward_does_not_fail_a_job_waiting_for_a_spare() -> None:
    clocks = _Clocks()
    core, beat, fail, gen = _job(clocks, membership_timeout_s=600.0)
    beat()
    # n0 alone: a node-level fault cordons it and waits for a spare (none) up to --membership-timeout
    core.report(FaultReport("cs", "n0", core.members()["n0"].lease_id, gen[0], Cause.NODE_CRITICAL, Level.NODE,
                            detail="gpu lost"))
    clocks.tick(1.0)
    core.reap()
    assert core.state.plan is not None and core.state.plan.waiting_since_s > 0, core.state  # waits for a spare
    clocks.wall += 3600.0  # NTP steps the clock forward an hour
    clocks.tick(1.0)
    core.reap()
    assert core.state.phase is not Phase.FAILED, core.state.message
    core.close()
