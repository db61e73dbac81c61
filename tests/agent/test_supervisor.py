"""The worker supervisor's lifecycle with real worker processes: kill -9 drives RUNNING -> STOPPING -> FAILED, a
hang seen by the real process detector drives HUNG, exit 0 drives SUCCEEDED; illegal moves are refused."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from trainguard.agent.errors import IllegalTransitionError
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.node import NodeConfig
from trainguard.agent.node_health import DetectorEventSource, LocalNodeHealth
from trainguard.agent.parts import (
    SUPERVISOR_TRANSITIONS,
    SupervisorHook,
    SupervisorState,
    SupervisorTrigger,
)
from trainguard.agent.supervisor import LocalSupervisor
from trainguard.agent.workers import WorkerState
from trainguard.drill.inject import FaultPlan, StepFaultInjector
from trainguard.proto import common_pb2

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _config(tmp_path: Path, argv: list[str], nproc: int = 2) -> NodeConfig:
    return NodeConfig(job="sup", coordinator="", argv=argv, nproc_per_node=nproc, node_id="n1", standby=False,
                      host_store=False, error_dir=str(tmp_path / "errors"), stop_grace_s=2.0)


def _table(generation: int = 1, nproc: int = 2, node_id: str = "n1") -> common_pb2.RankTable:
    return common_pb2.RankTable(
        generation=generation, world_size=nproc, master_addr="127.0.0.1", master_port=29999,
        nodes=[common_pb2.NodeRanks(node_id=node_id, first_rank=0, local_world_size=nproc, group_rank=0)])


def _poll_until_failure(sup: LocalSupervisor, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        failure = sup.poll()
        if failure is not None:
            return failure
        time.sleep(0.05)
    raise AssertionError(f"no failure within {timeout_s}s; state {sup.state}")


def test_sigkilled_worker_drives_running_to_failed(tmp_path: Path) -> None:
    sup = LocalSupervisor(_config(tmp_path, SLEEPER))
    assert sup.state == SupervisorState.INIT
    try:
        assert sup.start(_table())
        assert sup.state == SupervisorState.RUNNING and sup.generation == 1
        assert {w.state for w in sup.group.workers} == {WorkerState.STARTING}
        assert sup.poll() is None
        victim = sup.group.by_rank(1)
        os.kill(victim.pid, signal.SIGKILL)
        failure = _poll_until_failure(sup)
        assert (failure.rank, failure.exit_code) == (1, -signal.SIGKILL)
        assert failure.cause == "signal SIGKILL (9)" and failure.record.injected_at is None
        assert sup.state == SupervisorState.STOPPING and victim.state == WorkerState.FAILED
        survivor = sup.group.by_rank(0)
        sup.stop()
        assert sup.state == SupervisorState.FAILED and sup.group is None
        assert survivor.proc.poll() is not None and survivor.state == WorkerState.STOPPED
        # The next generation starts from FAILED.
        assert sup.start(_table(generation=2)) and sup.state == SupervisorState.RUNNING
        sup.stop()
        assert sup.state == SupervisorState.STOPPED
    finally:
        sup.close()


def test_first_report_makes_a_worker_running_and_exit_zero_succeeds(tmp_path: Path) -> None:
    sup = LocalSupervisor(_config(tmp_path, [sys.executable, "-c", "import time; time.sleep(1.5)"]),
                          running_after_s=60.0)
    try:
        sup.start(_table())
        w0, w1 = sup.group.by_rank(0), sup.group.by_rank(1)
        sup.on_heartbeat(rank=0, pid=w0.pid, generation=1, step=0, step_time_s=0.1)
        assert w0.state == WorkerState.RUNNING and w1.state == WorkerState.STARTING
        assert sup.on_heartbeat(rank=1, pid=w1.pid, generation=0, step=3, step_time_s=0.1) == []  # old generation
        assert w1.state == WorkerState.STARTING and w1.last_step == -1
        deadline = time.monotonic() + 20
        while sup.state == SupervisorState.RUNNING and time.monotonic() < deadline:
            assert sup.poll() is None
            time.sleep(0.05)
        assert sup.state == SupervisorState.SUCCEEDED
        assert {w.state for w in sup.group.workers} == {WorkerState.SUCCEEDED}
        sup.stop()  # a STOP for a job that succeeded leaves the outcome as it is
        assert sup.state == SupervisorState.SUCCEEDED
    finally:
        sup.close()


def test_a_step_number_that_restarts_each_epoch_still_counts_as_progress(tmp_path: Path) -> None:
    """`for step, batch in enumerate(loader)` reports 0, 1, ... again every epoch: each report is a step done, so
    the silence the hang detector measures starts afresh (it used to count only a higher step, and a healthy job
    was restarted as hung in its second epoch)."""
    sup = LocalSupervisor(_config(tmp_path, SLEEPER, nproc=1))
    try:
        sup.start(_table(nproc=1))
        w = sup.group.by_rank(0)
        for step in range(3):
            sup.on_heartbeat(rank=0, pid=w.pid, generation=1, step=step, step_time_s=0.05)
        before, steps = w.last_heartbeat, len(w.step_times)
        time.sleep(0.05)
        sup.on_heartbeat(rank=0, pid=w.pid, generation=1, step=0, step_time_s=0.05)  # the next epoch's first step
        assert w.last_heartbeat > before and w.last_step == 2 and len(w.step_times) == steps
        stamp = w.last_heartbeat
        time.sleep(0.05)
        sup.on_heartbeat(rank=0, pid=w.pid, generation=1, step=-1, step_time_s=0.0, finished=True)  # a state change
        assert w.last_heartbeat == stamp  # only a step done is progress, not the hook's pause message
    finally:
        sup.close()


@pytest.mark.timeout(60)
def test_hang_seen_by_the_process_detector_drives_hung(tmp_path: Path) -> None:
    sup = LocalSupervisor(_config(tmp_path, SLEEPER, nproc=1))
    source = DetectorEventSource.create(
        ["process"], {"process": {"interval_s": 0.1, "hang_floor_s": 1.0, "stack_dump": False}}, worker_view=sup)
    health = LocalNodeHealth("n1")
    try:
        sup.start(_table(nproc=1))
        w = sup.group.by_rank(0)
        for step in range(3):  # what the hook sends through the local service: steps, then nothing (hung)
            sup.on_heartbeat(rank=0, pid=w.pid, generation=1, step=step, step_time_s=0.05)
        health.start(source)
        deadline = time.monotonic() + 30
        hung = []
        while not hung and time.monotonic() < deadline:
            hung = [e for e in health.take_actionable() if e.kind == "process.hung"]
            time.sleep(0.1)
        assert hung, "the process detector reported no hang"
        assert sup.mark_hung(hung[0]) == 0
        assert sup.state == SupervisorState.HUNG and w.state == WorkerState.HUNG
        assert sup.fault_records[-1].rank == 0
        sup.stop()
        assert sup.state == SupervisorState.FAILED
    finally:
        health.stop()
        sup.close()


def test_drill_hook_injects_the_fault_and_dates_it(tmp_path: Path) -> None:
    injector = StepFaultInjector([FaultPlan(rank=1, step=5, sig=signal.SIGKILL, generation=1)])
    assert isinstance(injector, SupervisorHook)
    sup = LocalSupervisor(_config(tmp_path, SLEEPER), hooks=[injector])
    try:
        sup.start(_table())
        w1 = sup.group.by_rank(1)
        sup.on_heartbeat(rank=1, pid=w1.pid, generation=1, step=4, step_time_s=0.1)
        assert sup.poll() is None and w1.proc.poll() is None  # not at its step yet
        sup.on_heartbeat(rank=1, pid=w1.pid, generation=1, step=5, step_time_s=0.1)
        failure = _poll_until_failure(sup)
        assert failure.rank == 1 and failure.record.injected_at == injector.plans[0].done_at is not None
        assert failure.record.detected_at >= failure.record.injected_at
    finally:
        sup.close()


def test_fault_record_gives_the_step_the_injector_struck_at_not_the_one_asked_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`trainguard demo` said "fault ... at step 275" (the step it asked for) while the injector logged that it
    struck at 281 (its first tick at or after 275), so "resumed at step 280" read as later than the fault. The
    record carries the step of the strike: not the asked-for one, nor a heartbeat still in flight after it."""
    from trainguard.agent.demo import fault_line

    injector = StepFaultInjector([FaultPlan(rank=1, step=5, sig=signal.SIGKILL, generation=1)])
    sup = LocalSupervisor(_config(tmp_path, SLEEPER), hooks=[injector])
    caplog.set_level(logging.WARNING, logger="trainguard.drill.inject")
    try:
        sup.start(_table())
        w1 = sup.group.by_rank(1)
        for step in range(1, 9):  # the agent heard of steps 1..8 before its next tick
            sup.on_heartbeat(rank=1, pid=w1.pid, generation=1, step=step, step_time_s=0.1)
        failure = sup.poll()  # the injector strikes at step 8
        sup.on_heartbeat(rank=1, pid=w1.pid, generation=1, step=9, step_time_s=0.1)  # sent before it died
        failure = failure or _poll_until_failure(sup)
        struck = [r.getMessage() for r in caplog.records if "fault injected" in r.getMessage()]
        assert struck == ["fault injected: SIGKILL to rank 1 at step 8"], struck
        assert failure.record.step == 8
        assert " at step 8;" in fault_line(failure.record), fault_line(failure.record)
    finally:
        sup.close()


def test_the_agent_as_a_library_forks_workers_with_grpc_fork_handlers_off() -> None:
    """A supervisor used in-process (run_job, these tests) forks its workers (preexec_fn) from a process running
    gRPC; with gRPC's fork support on, a worker sometimes died of SIGABRT between fork and exec ("epoll_wait error:
    Bad file descriptor"): test_supervisor failed 2 runs in 10 after in-process daemon tests. Only the CLI turned
    the support off; importing the agent now does, unless the user set it."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    code = "import os, trainguard.agent.supervisor; print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "false", out.stderr[-2000:]
    env["GRPC_ENABLE_FORK_SUPPORT"] = "true"  # the user's own choice is kept
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "true", out.stderr[-2000:]


def test_table_without_this_node_starts_nothing(tmp_path: Path) -> None:
    sup = LocalSupervisor(_config(tmp_path, SLEEPER))
    assert not sup.start(_table(node_id="other")) and sup.state == SupervisorState.INIT and sup.group is None
    sup.close()


def test_supervisor_table_refuses_illegal_moves() -> None:
    life = Lifecycle("supervisor", SUPERVISOR_TRANSITIONS, SupervisorState.INIT)
    for trigger in (SupervisorTrigger.SPAWNED, SupervisorTrigger.HANG, SupervisorTrigger.WORKER_FAILED,
                    SupervisorTrigger.STOPPED, SupervisorTrigger.ALL_SUCCEEDED):
        with pytest.raises(IllegalTransitionError, match=f"supervisor: no transition from INIT on {trigger.value}"):
            life.fire(trigger)
    assert life.state == SupervisorState.INIT  # a refused move changes nothing
    life.fire(SupervisorTrigger.START)
    life.fire(SupervisorTrigger.SPAWNED)
    life.fire(SupervisorTrigger.ALL_SUCCEEDED)
    with pytest.raises(IllegalTransitionError):
        life.fire(SupervisorTrigger.HANG)  # a finished group cannot hang
    assert not life.fire_if(SupervisorTrigger.WORKER_FAILED) and life.state == SupervisorState.SUCCEEDED
    # Every state can be left except through the table, and every outcome can start a new generation.
    for end in (SupervisorState.STOPPED, SupervisorState.SUCCEEDED, SupervisorState.FAILED):
        assert SUPERVISOR_TRANSITIONS[(end, SupervisorTrigger.START)] == SupervisorState.STARTING
