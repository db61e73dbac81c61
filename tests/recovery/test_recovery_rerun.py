"""What the coordinator tells nodes it keeps idle, with real processes: a coordinator started again on the store
of a job that had ended (the outcome stands, and everyone is told where it came from), and a node waiting for
the others of ``--nnodes`` to register (told how many are there)."""

from __future__ import annotations

import os
import signal

from coordinator_client import CoordinatorProcess, beat_until, node_info

import tg_testutil
from trainguard.proto import coordinator_pb2 as pb


def _failed_job(tmp_path, tg_env, leave: bool = False) -> tuple[str, ...]:
    """Runs job "ended" until it fails (its budget 0, a worker killed) on a store in ``tmp_path``; with ``leave``
    the nodes then leave it, as launchers do. Returns the coordinator flags that reopen that store."""
    flags = ("--nnodes", "2", "--max-restarts", "0", "--heartbeat-interval", "0.1",
             "--store", f"sqlite://{tmp_path}/ended.db")
    first = CoordinatorProcess(tmp_path, tg_env, "ended", *flags)
    try:
        nodes = [first.agent(node_info(f"n{i}", "p1", i)) for i in range(2)]
        beat_until(nodes, lambda: all(n.gen == 1 for n in nodes))
        nodes[0].fail()
        assert nodes[0].beat().job_state == pb.JOB_STATE_FAILED
        for n in nodes if leave else ():
            first.stub.LeaveNode(pb.LeaveNodeRequest(job="ended", node_id=n.node_id, lease_id=n.lease,
                                                     reason="the job failed"), timeout=10)
    finally:
        first.stop()
    return flags


def test_a_coordinator_restarted_on_an_ended_job_says_so_and_how_to_run_it_again(tmp_path, tg_env) -> None:
    """The rerun coordinator answered every node with STOP and the old "job failed: rank 0 ... budget exhausted",
    with nothing saying the failure came from an earlier run kept in its store, nor how to start afresh."""
    flags = _failed_job(tmp_path, tg_env)
    again = CoordinatorProcess(tmp_path, tg_env, "ended", *flags)
    try:
        nodes = [again.agent(node_info(f"n{i}", "p1", i)) for i in range(2)]
        reply = nodes[1].beat()
    finally:
        again.stop()
    assert reply.command == pb.NODE_COMMAND_STOP and reply.job_state == pb.JOB_STATE_FAILED  # the outcome stands
    assert "job ended had already failed before this coordinator started" in reply.message, reply.message
    assert "rank 0 on node n0" in reply.message and "the same --job and another --store" in reply.message, reply.message
    warned = [ln for ln in again.lines if "WARNING" in ln and "had already failed" in ln]
    assert warned and "the same --job and another --store" in warned[0], again.log()[-3000:]


def test_a_node_waiting_for_the_others_to_register_is_told_how_many_are_there_and_gives_up_at_join_timeout(
        tmp_path, tg_env) -> None:
    """``trainguard run --nnodes 2`` whose second node never comes: until as many nodes as ``--nnodes`` had
    registered, the coordinator answered WAIT with an empty message, so the waiting node's log said nothing at
    all for as long as it waited (torchrun logs its rendezvous wait). And it waited forever: torchrun fails the
    rendezvous after ``join_timeout``; now the node does too, with one line naming who joined and the flags, and
    a non-zero exit (tg_env fails the test if any process of it is left)."""
    import subprocess
    import sys

    port = tg_testutil.free_port()
    script = tmp_path / "noop.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "alone", "--node-id", "lone-node",
                             "--rdzv-conf", "join_timeout=1", str(script)],
                            env=tg_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "coordinator: waiting for nodes: 1 of 2 registered (lone-node)" in err, err
    assert proc.returncode not in (0, None) and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert "the first generation did not form within 1 s" in last and "1 of 2 registered (lone-node)" in last, last
    assert "--nnodes" in last and "join_timeout" in last, last
    assert not (tmp_path / "started").exists()


def test_a_node_that_left_is_not_counted_as_registered_and_nobody_waits_to_tell_a_forming_job_its_end() -> None:
    """Two real nodes of --nnodes 3 gave up on their join timeout (measured: both exited at 13.2 s for a 3 s
    timeout): the second was told "2 of 3 registered (b and 1 more)" though the first had left, and the first,
    which embedded the coordinator, waited up to 10 s more for the second to "hear" an end that never came."""
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, NodeRecord
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import MemoryStore

    core = JobCoordinator(JobSpec(job="left", nnodes=3), store=MemoryStore())
    leases = {n: core.register("left", NodeRecord(n, "p", i, n, 1), 20000 + i)[0] for i, n in enumerate("ab")}
    assert core.not_told_of_end() == []  # forming: no outcome to hear
    core.leave("left", "a", leases["a"], "join timeout")
    ins = core.heartbeat(Beat("left", "b", leases["b"], -1, 0, free_port=30000)).response
    assert ins.missing == 2 and "waiting for nodes: 1 of 3 registered (b);" in ins.message, ins
    leases["a"] = core.register("left", NodeRecord("a", "p", 0, "a", 1), 20000)[0]  # back again
    ins = core.heartbeat(Beat("left", "b", leases["b"], -1, 0, free_port=30000)).response
    assert ins.missing == 1 and "2 of 3 registered (a, b)" in ins.message, ins
    core.close()


def test_an_ended_jobs_coordinator_with_exit_when_done_stays_to_tell_the_nodes_started_with_it(tmp_path,
                                                                                               tg_env) -> None:
    """It exited about a second after starting, saying "every node is told it is over" though none was: the nodes
    started with it met a closed port and waited out their join timeout ("unreachable")."""
    flags = _failed_job(tmp_path, tg_env, leave=True)
    again = CoordinatorProcess(tmp_path, tg_env, "ended", *flags, "--exit-when-done")
    try:
        try:
            again.proc.wait(3)
        except Exception:  # noqa: BLE001 - still serving, as it must
            pass
        assert again.proc.poll() is None, again.log()[-3000:]
        reply = again.agent(node_info("n1", "p1", 1)).beat()
        assert reply.command == pb.NODE_COMMAND_STOP and "the same --job and another --store" in reply.message
        try:
            again.proc.wait(2)
        except Exception:  # noqa: BLE001 - still serving: the job's second node has not heard it yet
            pass
        assert again.proc.poll() is None, again.log()[-3000:]
        assert again.agent(node_info("n0", "p1", 0)).beat().command == pb.NODE_COMMAND_STOP
        assert again.proc.wait(30) == 1  # the job's outcome, once its --nnodes 2 nodes heard it
    finally:
        again.stop()
