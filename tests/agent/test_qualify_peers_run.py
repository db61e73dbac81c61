"""The peer check end to end: a node whose data link is slow is refused against the nodes that qualified first.

Real coordinator, real ``trainguard run`` launchers, each node in its own network namespace with a real veth on
the data bridge (:class:`trainguard.drill.netns.Fabric`). Three healthy nodes qualify (the first has no peer
yet; the next two, started together once it registered, time a 512 KiB exchange with the ones registered before
and leave their times as the reference) and run the job; then a fourth node whose data link is capped by
``tc tbf`` at 1 Mbit/s (the switch side of its NIC, as a link trained at a fraction of its speed) qualifies: its
exchanges take ~5 s against the healthy nodes' milliseconds, so it is refused with the measured ratio and never
gets a rank.

The healthy nodes' times are not milliseconds on a loaded CI box: g2 and g3 time themselves while g1's launcher
imports torch, and took up to ~0.4 s each (seen once). At 4 Mbit/s for 1 MiB the slow node's ~2.4 s was then
under 3x that reference and it qualified; the cap leaves it ~12x even so.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric_coordinator import start_fabric_coordinator
from trainguard.drill.netns import Fabric, netns_unavailable_reason

REPO = Path(__file__).resolve().parents[2]
NETNS_SKIP = netns_unavailable_reason()

WAIT_FOR_RELEASE = """import os, sys, time
out = sys.argv[1]
open(os.path.join(out, "rank" + os.environ["RANK"]), "w").close()
deadline = time.monotonic() + 150
while not os.path.exists(os.path.join(out, "..", "release")) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


@pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
@pytest.mark.timeout(480)
def test_a_node_with_a_slow_data_link_fails_the_peer_check(tmp_path: Path, tg_env: dict) -> None:
    script = tmp_path / "wait_for_release.py"
    script.write_text(WAIT_FOR_RELEASE)
    config = tmp_path / "agent.toml"
    config.write_text('[qualify]\nchecks = ["peers"]\npeer_count = 3\npeer_kib = 512\npeer_slow_ratio = 3.0\n'
                      'peer_min_history = 2\nbudget_s = 60.0\ncheck_timeout_s = 30.0\n')
    with Fabric() as fabric:
        nets = {name: fabric.add(name) for name in ("g1", "g2", "g3", "slow")}
        coord, coord_log, target = start_fabric_coordinator(fabric, tmp_path, tg_env, "pjob", 3)
        launchers: dict[str, subprocess.Popen] = {}
        try:
            def launch(name: str) -> None:
                out = tmp_path / f"{name}-out"
                out.mkdir()
                with open(tmp_path / f"{name}.log", "w") as err:
                    launchers[name] = subprocess.Popen(
                        ["ip", "netns", "exec", nets[name].netns, sys.executable, "-m", "trainguard.cli", "run",
                         "--coordinator", target, "--job", "pjob", "--node-id", name, "--address", nets[name].data_ip,
                         "--nproc-per-node", "1", "--no-standby", "--rdzv-conf", "join_timeout=60",
                         "--qualify-config", str(config), str(script), str(out)],
                        env=tg_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)

            def log_of(name: str) -> str:
                return (tmp_path / f"{name}.log").read_text()

            for batch in (("g1",), ("g2", "g3")):  # g2 and g3 time themselves against g1 (and each other)
                for name in batch:
                    launch(name)
                deadline = time.monotonic() + 150
                for name in batch:
                    while f"registered node {name}" not in log_of(name):
                        assert launchers[name].poll() is None and time.monotonic() < deadline, log_of(name)[-3000:]
                        time.sleep(0.1)
            subprocess.run(["tc", "qdisc", "add", "dev", nets["slow"].data_host_veth, "root", "tbf", "rate",
                            "1mbit", "burst", "32kbit", "latency", "400ms"], check=True, capture_output=True)
            launch("slow")
            assert launchers["slow"].wait(timeout=200) == 2, log_of("slow")[-3000:]
            (tmp_path / "release").touch()
            for name in ("g1", "g2", "g3"):
                assert launchers[name].wait(timeout=150) == 0, log_of(name)[-3000:]
            assert coord.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        finally:
            (tmp_path / "release").touch()
            for p in [*launchers.values(), coord]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            coord_log.close()

    g1, g2, g3, slow = (log_of(n) for n in ("g1", "g2", "g3", "slow"))
    assert "node g1 qualified" in g1 and "node g2 qualified" in g2 and "node g3 qualified" in g3
    error = [ln for ln in slow.splitlines() if ln.startswith("trainguard: error:")]
    assert len(error) == 1 and "FAILED_PRECONDITION" in error[0], slow
    assert "failed qualification: peers: 3 peer(s), median" in error[0] and "for 512 KiB each way" in error[0]
    assert "qualified node(s) (limit 3x)" in error[0]
    assert list((tmp_path / "slow-out").iterdir()) == []  # never got a rank
    print("\n" + error[0])
