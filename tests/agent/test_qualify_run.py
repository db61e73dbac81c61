"""Done-when: "qualification refuses a node with a narrowed link", end to end.

A real coordinator process and two real ``trainguard run`` launchers, each node in its own network namespace
on real veth links (:class:`trainguard.drill.netns.Fabric`), each with a fake PCIe sysfs tree in the kernel's
formats. Each qualifies before registering (detectors once, PCIe links, the real ``data0`` veth at 10000 Mb/s, a
real fsync'd disk write). The node whose GPU link trained at x4 is refused with the reason, its scheduler cordon
hook fires with that reason, and it never gets a rank; the healthy node passes and runs the job alone. A spare
that passed at registration re-checks while it waits; when its link narrows it is cordoned (hook fired again),
so it can never be promoted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric_coordinator import start_fabric_coordinator
from trainguard.testing.sysfs import GPU, FakeNodeHardware
from trainguard.drill.netns import Fabric, netns_unavailable_reason

REPO = Path(__file__).resolve().parents[2]
NETNS_SKIP = netns_unavailable_reason()

WAIT_FOR_RELEASE = """import json, os, sys, time
out = sys.argv[1]
with open(os.path.join(out, "env" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"env": dict(os.environ)}, f)
deadline = time.monotonic() + 150
while not os.path.exists(os.path.join(out, "..", "release")) and time.monotonic() < deadline:
    time.sleep(0.1)
"""

RECORD = """import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
"""


def _node_files(tmp: Path, name: str, narrow: bool) -> tuple[FakeNodeHardware, Path, Path]:
    """The node's fake hardware, its [qualify] config and its detector config."""
    tree = tmp / f"{name}-root"
    hw = FakeNodeHardware(tree)
    if narrow:
        hw.narrow_link(4)
    qualify = tmp / f"{name}-agent.toml"
    # Bounds generous for two loaded CI cores; the measured time is printed by the launcher and checked below.
    qualify.write_text(f'[qualify]\nchecks = ["detectors", "pcie", "nic", "disk"]\nroot = "{tree}"\n'
                       f'nics = ["data0"]\nnic_speed_mbps = 10000\ndisk_dir = "{tmp}"\ndisk_mib = 4\n'
                       'disk_min_mib_s = 1.0\nbudget_s = 30.0\ncheck_timeout_s = 20.0\nrecheck_s = 1.0\n')
    detectors = tmp / f"{name}-detectors.toml"
    detectors.write_text(f'root = "{tree}"\n')
    return hw, qualify, detectors


@pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
@pytest.mark.timeout(480)
def test_a_node_with_a_narrowed_link_is_refused_and_never_ranked(tmp_path: Path, tg_env: dict) -> None:
    hook = tmp_path / "record.py"
    hook.write_text(RECORD)
    cordoned = tmp_path / "cordoned.jsonl"
    script = tmp_path / "wait_for_release.py"
    script.write_text(WAIT_FOR_RELEASE)
    hardware: dict[str, FakeNodeHardware] = {}
    with Fabric() as fabric:
        nets = {name: fabric.add(name) for name in ("narrow", "good", "spare")}
        coord, coord_log, target = start_fabric_coordinator(
            fabric, tmp_path, tg_env, "qjob", 1,
            "--cordon-command", f"{sys.executable} {hook} {cordoned} {{node}} {{reason}}")
        launchers: list[subprocess.Popen] = []
        try:
            def launch(name: str, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
                hardware[name], qualify, detectors = _node_files(tmp_path, name, narrow=name == "narrow")
                out = tmp_path / f"{name}-out"
                out.mkdir()
                log = tmp_path / f"{name}.log"
                with open(log, "w") as err:
                    p = subprocess.Popen(
                        ["ip", "netns", "exec", nets[name].netns, sys.executable, "-m", "trainguard.cli", "run",
                         "--coordinator", target, "--job", "qjob", "--node-id", name, "--address",
                         nets[name].data_ip, "--nproc-per-node", "1", "--no-standby", "--rdzv-conf",
                         "join_timeout=60", "--qualify-config", str(qualify), "--detectors", "pcie",
                         "--detector-config", str(detectors), *extra, str(script), str(out)],
                        env=tg_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
                launchers.append(p)
                return p, out, log

            narrow, narrow_out, narrow_log = launch("narrow")
            assert narrow.wait(timeout=150) == 2, narrow_log.read_text()[-3000:]
            good, good_out, good_log = launch("good")
            spare, spare_out, spare_log = launch("spare", "--spare")
            deadline = time.monotonic() + 150
            while not (good_out / "env0.json").exists() or "registered node spare" not in spare_log.read_text():
                assert good.poll() is None and spare.poll() is None and time.monotonic() < deadline, \
                    good_log.read_text()[-2000:] + spare_log.read_text()[-2000:]
                time.sleep(0.1)
            hardware["spare"].narrow_link(2)  # while it waits as a spare: its next re-check (1 s) fails
            deadline = time.monotonic() + 60
            while "node spare cordoned" not in (tmp_path / "coordinator.log").read_text():
                assert spare.poll() is None and time.monotonic() < deadline, spare_log.read_text()[-3000:]
                time.sleep(0.1)
            (tmp_path / "release").touch()
            assert good.wait(timeout=150) == 0, good_log.read_text()[-3000:]
            assert spare.wait(timeout=90) == 0, spare_log.read_text()[-3000:]
            assert coord.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        finally:
            (tmp_path / "release").touch()
            for p in [*launchers, coord]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            coord_log.close()

    reason = f"pcie: {GPU} link trained at x4, below its x16"
    text = narrow_log.read_text()
    error = [ln for ln in text.splitlines() if ln.startswith("trainguard: error:")]
    assert len(error) == 1 and "FAILED_PRECONDITION" in error[0] and f"failed qualification: {reason}" in error[0], text
    assert list(narrow_out.iterdir()) == []  # no worker ever started there
    env = json.loads((good_out / "env0.json").read_text())["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("0", "1", "1")
    assert [p.name for p in good_out.iterdir()] == ["env0.json"]
    # The scheduler hook was told, with the qualification's reason (not the job's latest message).
    deadline = time.monotonic() + 5
    while (not cordoned.exists() or len(cordoned.read_text().splitlines()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    hooks = dict(json.loads(line) for line in cordoned.read_text().splitlines())
    assert hooks == {"narrow": f"failed qualification: {reason}",
                     "spare": f"failed qualification: pcie: {GPU} link trained at x2, below its x16"}
    assert list(spare_out.iterdir()) == []  # the spare was never promoted
    # The healthy node's qualification: every check ran, real veth at 10000 Mb/s, and how long it took.
    m = re.search(r"node good qualified in (\d+\.\d+) s", good_log.read_text())
    assert m is not None, good_log.read_text()[-3000:]
    print(f"\nqualification of the healthy node took {float(m.group(1)):.2f} s")
    assert "narrow" in (tmp_path / "coordinator.log").read_text()
