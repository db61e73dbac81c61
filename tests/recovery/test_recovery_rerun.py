"""A ``trainguard coordinator`` started again on the store of a job that had ended (the same command rerun after
a fix, or a restart after the end): the outcome stands, and everyone is told where it came from."""

from __future__ import annotations

from coordinator_client import CoordinatorProcess, beat_until, node_info

from trainguard.proto import coordinator_pb2 as pb


def test_a_coordinator_restarted_on_an_ended_job_says_so_and_how_to_run_it_again(tmp_path, tg_env) -> None:
    """The rerun coordinator answered every node with STOP and the old "job failed: rank 0 ... budget exhausted",
    with nothing saying the failure came from an earlier run kept in its store, nor how to start afresh."""
    flags = ("--nnodes", "2", "--max-restarts", "0", "--heartbeat-interval", "0.1",
             "--store", f"sqlite://{tmp_path}/ended.db")
    first = CoordinatorProcess(tmp_path, tg_env, "ended", *flags)
    try:
        nodes = [first.agent(node_info(f"n{i}", "p1", i)) for i in range(2)]
        beat_until(nodes, lambda: all(n.gen == 1 for n in nodes))
        nodes[0].fail()
        assert nodes[0].beat().job_state == pb.JOB_STATE_FAILED
    finally:
        first.stop()
    again = CoordinatorProcess(tmp_path, tg_env, "ended", *flags)
    try:
        nodes = [again.agent(node_info(f"n{i}", "p1", i)) for i in range(2)]
        reply = nodes[1].beat()
    finally:
        again.stop()
    assert reply.command == pb.NODE_COMMAND_STOP and reply.job_state == pb.JOB_STATE_FAILED  # the outcome stands
    assert "job ended had already failed before this coordinator started" in reply.message, reply.message
    assert "rank 0 on node n0" in reply.message and "another --job or --store" in reply.message, reply.message
    warned = [ln for ln in again.lines if "WARNING" in ln and "had already failed" in ln]
    assert warned and "another --job or --store" in warned[0], again.log()[-3000:]
