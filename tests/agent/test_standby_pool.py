"""Warm standbys are armed for plain scripts too: after ``standby_after_s`` without a step report, unless the
job's workers use the hook (then their first step arms them); an armed standby runs a plain script."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tg_testutil import until

from trainguard.agent.node import NodeConfig
from trainguard.agent.standby import StandbyPool, activate
from trainguard.agent.workers import WorkerGroup, WorkerSpec
from trainguard.worker_env import WorkerEnv

SLEEP = "import time; time.sleep(60)"


def _group(tmp_path: Path, tg_env: dict) -> tuple[NodeConfig, WorkerGroup]:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    argv = [sys.executable, "-u", str(script)]
    config = NodeConfig(job="j", coordinator="127.0.0.1:1", argv=argv, preload=("json",), standby_after_s=0.5)
    env = WorkerEnv(master_addr="127.0.0.1", master_port=1, run_id="j", job="j").to_env(tg_env)
    group = WorkerGroup([WorkerSpec(rank=0, local_rank=0, argv=argv, env=env)])
    group.start()
    return config, group


def test_plain_script_arms_after_the_delay_and_a_standby_runs_it(tmp_path: Path, tg_env: dict) -> None:
    config, group = _group(tmp_path, tg_env)
    pool = StandbyPool()
    try:
        started = time.monotonic()
        pool.ensure(config, group, started, spare_waiting=False)
        assert pool.take() == {}  # still starting: no standby competes with it
        assert until(lambda: time.monotonic() - started > config.standby_after_s, 5)
        pool.ensure(config, group, started, spare_waiting=False)
        standbys = pool.take()
        assert list(standbys) == [0]
        out = tmp_path / "ran.txt"
        plain = tmp_path / "plain.py"
        plain.write_text("import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
        assert activate(standbys[0], [str(plain), "a", "b"], {**tg_env, "RANK": "7"}, str(out), str(out))
        assert standbys[0].wait(30) == 0
        assert out.read_text() == "rank 7 ['a', 'b']\n"
    finally:
        group.stop(0.5)
        pool.drop()


def test_hook_workers_arm_on_their_first_step_only(tmp_path: Path, tg_env: dict) -> None:
    config, group = _group(tmp_path, tg_env)
    pool = StandbyPool()
    try:
        group.workers[0].last_step = 0  # the hook reported a first step
        pool.ensure(config, group, time.monotonic(), spare_waiting=False)
        armed = pool.take()
        assert list(armed) == [0]
        StandbyPool.drop_all(armed)
        group.workers[0].last_step = -1  # a new generation of the same job, restoring: no step yet
        pool.ensure(config, group, time.monotonic() - 10 * config.standby_after_s, spare_waiting=False)
        assert pool.take() == {}  # the delay is for scripts that never report
    finally:
        group.stop(0.5)
        pool.drop()
