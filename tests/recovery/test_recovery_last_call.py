"""``trainguard coordinator --nnodes MIN:MAX`` at a real coordinator process over gRPC: once MIN nodes registered,
the first generation waits up to ``--last-call-timeout`` for more (torchrun's last call), starts with the nodes
there when it runs out, and nodes arriving after it are standbys."""

from __future__ import annotations

import pytest

from coordinator_client import CoordinatorProcess, beat_until, node_info

pytestmark = pytest.mark.timeout(60)


def test_the_last_call_runs_out_and_the_job_starts_with_the_nodes_there(tmp_path, tg_env) -> None:
    c = CoordinatorProcess(tmp_path, tg_env, "lc-job", "--nnodes", "1:3", "--last-call-timeout", "1",
                           "--heartbeat-interval", "0.1", "--lease-timeout", "30")
    try:
        a = c.agent(node_info("a", idx=0))
        b = c.agent(node_info("b", idx=1))
        a.beat()
        assert a.gen < 0 and "last call" in a.last.message, a.last.message  # MIN is there: waiting for more
        beat_until([a, b], lambda: a.gen == 1 and b.gen == 1)
        assert [n.node_id for n in a.table.nodes] == ["a", "b"] and a.table.world_size == 4
        late = c.agent(node_info("late", idx=2))
        late.beat()
        assert late.gen < 0 and "spare" in late.last.message, late.last.message
    finally:
        c.stop()


def test_bad_nnodes_range_is_a_one_line_error(tmp_path, tg_env) -> None:
    with pytest.raises(RuntimeError) as err:
        CoordinatorProcess(tmp_path, tg_env, "lc-bad", "--nnodes", "3:1")
    assert "--nnodes" in str(err.value) and "Traceback" not in str(err.value)
