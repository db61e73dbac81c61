"""``trainguard uncordon`` against a real ``trainguard coordinator`` process: a node cordoned after it was lost (no
node daemon to vouch for it) is returned to service by the operator and fills the next vacancy; a node that is
not cordoned, or another job, is refused in one line."""

from __future__ import annotations

import pytest

from coordinator_client import CoordinatorProcess, beat_until, node_info
from tg_testutil import run_cli

pytestmark = pytest.mark.timeout(90)


def test_an_operator_returns_a_lost_and_replaced_node_to_service(tmp_path, tg_env) -> None:
    c = CoordinatorProcess(tmp_path, tg_env, "unc-job", "--nnodes", "2", "--heartbeat-interval", "0.1",
                           "--lease-timeout", "1", "--backoff", "0")
    try:
        a = c.agent(node_info("a", idx=0))
        b = c.agent(node_info("b", idx=1))
        s = c.agent(node_info("s", idx=2, spare=True))
        beat_until([a, b, s], lambda: a.gen == 1 and b.gen == 1)
        beat_until([a, s], lambda: a.gen == 2 and s.gen == 2)  # b silent: lost, cordoned, s took its slot
        b.beat()  # its machine is back (rebooted), with no daemon to report it healthy: still cordoned
        assert b.gen < 0 and "cordoned" in b.last.message
        uncordon = ["uncordon", "b", "--coordinator", c.target, "--job", "unc-job", "--reason", "PSU swapped"]
        r = run_cli(uncordon, env=tg_env, timeout=60)
        assert r.returncode == 0 and "back in service" in r.stdout and "PSU swapped" in r.stdout, r.stderr
        # s is lost in turn: b fills the vacancy.
        beat_until([a, b], lambda: a.gen == 3 and b.gen == 3)
        assert sorted(n.node_id for n in a.table.nodes) == ["a", "b"]
        r = run_cli(uncordon, env=tg_env, timeout=60)  # b holds a slot: not cordoned
        assert r.returncode == 1 and "not cordoned" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = run_cli(["uncordon", "b", "--coordinator", c.target, "--job", "other"], env=tg_env, timeout=60)
        assert r.returncode == 2 and "unknown job" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        c.stop()
