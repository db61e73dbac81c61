"""The daemon is the node's health for every job: started by the shipped systemd unit with a coordinator
configured (job token included), it reports its node continuously; when its detectors see a fatal fault the
coordinator cordons the node (through its cordon hook, with the daemon's reason), and real `trainguard run`
launchers form the job without it: the sick node never gets a rank.

Real processes throughout: `trainguard coordinator`, the daemon (ExecStart of deploy/trainguard-agent.service),
three `trainguard run` launchers whose gloo workers form a real process group; the daemon's PCIe detector reads
a fake sysfs tree in the real formats (:class:`trainguard.testing.sysfs.FakeNodeHardware`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentd_unit import UnitDaemon, clean_env, pcie_daemon_config, wait_until
from tg_testutil import REPO
from trainguard.testing.sysfs import GPU, FakeNodeHardware

SCRIPTS = Path(__file__).resolve().parent / "scripts"
JOB = f"nh-{os.getpid()}"

pytestmark = pytest.mark.timeout(150)


def start_coordinator(tmp: Path, env: dict, *flags: str) -> tuple[subprocess.Popen, str]:
    """`trainguard coordinator` for JOB on a free port; returns the process and its address."""
    port_file = tmp / "coordinator.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "coordinator", "--job", JOB, "--listen", "127.0.0.1:0",
         "--store", f"sqlite://{tmp}/coordinator.db", "--port-file", str(port_file), "--nnodes", "2",
         "--heartbeat-interval", "0.2", "--backoff", "0", *flags],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "coordinator.log", "wb"))
    wait_until(lambda: port_file.exists() or proc.poll() is not None, 30, "the coordinator's port")
    assert proc.poll() is None, (tmp / "coordinator.log").read_text()
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def launcher(tmp: Path, env: dict, coordinator: str, node: str) -> subprocess.Popen:
    """`trainguard run` joining ``coordinator`` as ``node``; its worker writes its environment under out/<node>."""
    out = tmp / "out" / node
    out.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "run", "--rdzv-backend", "c10d", "--rdzv-endpoint", coordinator,
         "--rdzv-id", JOB, "--rdzv-conf", "is_host=false", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-id", node, "--no-standby", "--detectors", "process", str(SCRIPTS / "dump_env.py"), str(out)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_daemon_with_a_fatal_fault_keeps_its_node_out_of_the_jobs_generations(tmp_path: Path, tg_env: dict):
    env = clean_env(tg_env)
    token = tmp_path / "job.token"
    token.write_text("t" * 32 + "\n")
    env["TRAINGUARD_JOB_TOKEN_FILE"] = str(token)
    hook_out = tmp_path / "cordoned.txt"
    hook = (f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))\" "
            f"{hook_out} {{host}} {{reason}}")
    coord, address = start_coordinator(tmp_path, env, "--cordon-command", hook)
    hw = FakeNodeHardware(tmp_path / "sysfs")
    daemon = UnitDaemon(tmp_path / "daemon", pcie_daemon_config("sick", tmp_path / "sysfs", f"""[coordinator]
address = "{address}"
heartbeat_interval_s = 0.2
token_file = "{token}"
"""), {k: v for k, v in env.items() if k != "TRAINGUARD_JOB_TOKEN_FILE"})
    procs: list[subprocess.Popen] = []
    try:
        status = daemon.wait_ready()
        assert "node healthy" in status, status
        daemon.wait_log(f"reporting node sick health to coordinator {address} (config)")
        daemon.wait_sampled("pcie")  # the healthy tree is the baseline: the next increase is an event
        hw.aer_fatal()
        daemon.wait_log("node verdict FATAL: pcie.aer_fatal")
        # The hook gets the host the daemon runs on (the scheduler's node name) and the daemon's own reason.
        wait_until(lambda: hook_out.exists() and "pcie.aer_fatal" in hook_out.read_text(), 30, "the cordon hook")
        assert hook_out.read_text().startswith(socket.gethostname() + " ")
        assert f"PCIe device {GPU}: 1 new uncorrectable fatal error(s)" in hook_out.read_text()
        daemon.wait_log(f"coordinator {address} (config) cordoned node sick")
        # The sick node's launcher comes first; the two healthy ones form the job.
        procs.append(launcher(tmp_path, env, address, "sick"))
        time.sleep(1.0)
        procs += [launcher(tmp_path, env, address, n) for n in ("a", "b")]
        outs = {}
        for node, p in zip(("sick", "a", "b"), procs):
            out, err = p.communicate(timeout=90)
            outs[node] = err
            assert p.returncode == 0, f"{node}: {err[-3000:]}"
        ranks = {}
        for node in ("a", "b"):
            (env_file,) = (tmp_path / "out" / node).iterdir()
            doc = json.loads(env_file.read_text())
            assert doc["dist_world"] == 2 and doc["WORLD_SIZE"] == "2"
            ranks[node] = doc["dist_rank"]
        assert sorted(ranks.values()) == [0, 1]
        assert list((tmp_path / "out" / "sick").iterdir()) == []  # never got a rank
        assert "generation 1: started" not in outs["sick"]
        assert "cordoned" in (tmp_path / "coordinator.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.communicate()
        daemon.close()
        coord.terminate()
        coord.wait(15)
    # The daemon stopped cleanly on SIGTERM (its reporter thread with it).
    assert daemon.proc.returncode == 0, daemon.log()[-3000:]
