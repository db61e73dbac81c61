"""The daemon adopts the memory-tier arenas left under `memory_tier.root` while no daemon ran, and removes them
`ttl_s` later; it must adopt arenas only. With the root set to a shared tmpfs folder (`/dev/shm` itself, to match
jobs run with `TRAINGUARD_CHECKPOINT_SHM_DIR=/dev/shm`), every other program's folder there was adopted as well
and deleted, as root, an hour later.

A real daemon started as the shipped unit starts it, `ttl_s = 0` so the sweep comes at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd_unit import UnitDaemon, clean_env, pcie_daemon_config

pytestmark = pytest.mark.timeout(90)


def test_only_arenas_left_under_the_root_are_adopted_and_aged_out(tmp_path: Path, tg_env: dict):
    shm = tmp_path / "shm"
    foreign = shm / "pgsql-sockets"  # another program's folder, next to the arenas
    foreign.mkdir(parents=True)
    (foreign / "data").write_bytes(b"not ours")
    (shm / "empty-dir").mkdir()  # nothing says it is an arena
    for job, layout in (("old-job", "rank_00000"), ("buddy-job", "replicas")):
        (shm / job / layout).mkdir(parents=True)
        (shm / job / layout / "slot_0").write_bytes(b"\0" * 64)
    (tmp_path / "sysfs").mkdir()
    daemon = UnitDaemon(tmp_path / "daemon", pcie_daemon_config("arena-n1", tmp_path / "sysfs", f"""[memory_tier]
root = "{shm}"
ttl_s = 0
"""), clean_env(tg_env))
    try:
        daemon.wait_ready()
        daemon.wait_log("removed the arena of job old-job")
        daemon.wait_log("removed the arena of job buddy-job")
    finally:
        daemon.close()
    assert (foreign / "data").read_bytes() == b"not ours", daemon.log()[-3000:]
    assert (shm / "empty-dir").is_dir()
    assert not (shm / "old-job").exists() and not (shm / "buddy-job").exists()
