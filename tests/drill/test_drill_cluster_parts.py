"""Parts of the cluster soak drill: the fake PCIe tree read by the real detector and predictor rules, the
two-network fabric seen by the real RoCE detector, log parsing, and the cluster schedule."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trainguard.detectors.events import Action
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.drill.errors import SoakError
from trainguard.testing.sysfs import GPU, FakeNodeHardware
from trainguard.drill.netns import Fabric, netns_unavailable_reason
from trainguard.drill.soak import CLUSTER_INJECTED, NO_NETNS_REASON, SoakConfig, plan_schedule
from trainguard.drill.soak_cluster import first_log_match, log_time
from trainguard.drill.soak_report import at_scale
from trainguard.drill.trace import load_stepfun, trace_dir

NETNS_WHY = netns_unavailable_reason()


def test_fake_tree_feeds_the_real_pcie_detector(tmp_path) -> None:
    hw = FakeNodeHardware(tmp_path)
    det = PcieDetector(PcieConfig(root=str(tmp_path)))
    s = det.sample()
    assert s.metrics[f"link_width[{GPU}]"] == 16.0 and s.metrics["aer_fatal_total"] == 0.0 and not s.events
    hw.narrow_link(4)
    s = det.sample()
    assert [e.kind for e in s.events] == ["pcie.link_narrow"] and s.metrics["links_degraded"] == 1.0
    hw.aer_fatal()
    s = det.sample()
    fatal = [e for e in s.events if e.kind == "pcie.aer_fatal"]
    assert fatal and fatal[0].action == Action.DRAIN_NODE and "DLP+1" in fatal[0].evidence["errors"]


def test_narrowed_link_trips_the_predictor_rules(tmp_path) -> None:
    """The precursor the drill writes is one the shipped rules tier acts on (through the agent's real feed)."""
    from trainguard.agent.node import NodeAgent, NodeConfig
    from trainguard.detectors.runner import DetectorRunner

    hw = FakeNodeHardware(tmp_path)
    agent = NodeAgent(NodeConfig(job="j", coordinator="", argv=[], node_id="n1"))
    agent.start_predictor(model_path=None, history_path=None, interval_s=0.0, drain_grace_s=60.0)
    sub = agent.bus.subscribe()
    runner = DetectorRunner([PcieDetector(PcieConfig(root=str(tmp_path)))], on_event=agent.predictor_event)
    runner.run_once()
    agent.predictor_tick(runner.latest_metrics())
    assert agent.predictor_score < 1.0
    hw.narrow_link(4)
    runner.run_once()
    agent.predictor_tick(runner.latest_metrics())
    ev = sub.get(timeout=1.0)
    while ev is not None and ev.kind != "predictor.alarm":
        ev = sub.get(timeout=1.0)
    assert ev is not None and ev.action == Action.DRAIN_NODE
    assert "rule.pcie-link-width-degraded" in ev.evidence


_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=2).close()
except ConnectionRefusedError:
    pass  # a RST came back: the path works
except OSError:
    sys.exit(1)
"""


def _reachable(netns: str, ip: str) -> bool:
    """A TCP connect from ``netns`` to a closed port of ``ip``: refused means the path works."""
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", _PROBE, ip],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(NETNS_WHY is not None, reason=str(NETNS_WHY))
def test_fabric_data_link_down_is_seen_inside_the_namespace() -> None:
    with Fabric() as fab:
        a, b = fab.add("a"), fab.add("b")
        assert _reachable(a.netns, b.data_ip) and _reachable(a.netns, b.mgmt_ip)
        assert _reachable(b.netns, fab.coordinator_host)
        fab.link_down("b")
        deadline = time.monotonic() + 5
        state = ""
        while time.monotonic() < deadline:
            state = subprocess.run(["ip", "netns", "exec", b.netns, "cat", "/sys/class/net/data0/operstate"],
                                   capture_output=True, text=True).stdout.strip()
            if state != "up":
                break
            time.sleep(0.05)
        assert state in ("down", "lowerlayerdown")
        # the management network still works: the agent can still tell the coordinator
        assert _reachable(b.netns, fab.coordinator_host) and _reachable(a.netns, b.mgmt_ip)
        assert not _reachable(a.netns, b.data_ip)
        ns = b.netns
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_log_parsing(tmp_path) -> None:
    p = tmp_path / "n1.log"
    p.write_text("2026-11-29 15:22:44,972 WARNING x: generation 1: rank 1 ended with signal SIGKILL (9); stopping "
                 "local workers\nnoise\n2026-11-29 15:22:46,001 ERROR x: node-level fault: pcie ...\n")
    t = log_time(p.read_text().splitlines()[0])
    assert t == pytest.approx(time.mktime(time.strptime("2026-11-29 15:22:44", "%Y-%m-%d %H:%M:%S")) + 0.972)
    assert first_log_match(p, r"node-level fault", t) == pytest.approx(t + 1.029)
    assert first_log_match(p, r"node-level fault", t + 5) is None


def test_at_scale_adds_communicator_start_and_production_lease() -> None:
    m = {"detect_crash_s": 0.1, "detect_node_down_s": 3.4, "recovery_process_s": 1.0, "recovery_node_s": 4.0,
         "checkpoint_stall_s": 0.001, "detect_hang_s": 15.2, "predicted_share": 1.0}
    out = at_scale(m, lease_s=3.0, communicator_init_s=30.0)
    assert out == {"detect_crash_s": 0.1, "detect_node_down_s": pytest.approx(10.4), "recovery_process_s": 31.0,
                   "recovery_node_s": 34.0}


def test_cluster_config_checks() -> None:
    for bad in (dict(nodes=1), dict(nodes=2, spares=0), dict(nodes=2, netns=False, extra=("linkdown",)),
                dict(extra=("agentkill",))):
        with pytest.raises(SoakError):
            SoakConfig(**bad).validate()
    with pytest.raises(SoakError, match=r"--spares 0: .*; --lease-timeout 0.3: must exceed"):
        SoakConfig(nodes=2, spares=0, lease_timeout_s=0.3).validate()  # every wrong flag named at once
    SoakConfig(nodes=2, extra=("agentkill", "coordinator", "precursor")).validate()


@pytest.mark.skipif(not (trace_dir() / "fault_trace.json").is_file(), reason="StepFun fault trace not found")
def test_cluster_schedule_injects_every_class() -> None:
    trace = load_stepfun()
    cfg = SoakConfig(wall_s=3600.0, trace_faults=300.0, extra=(), nodes=2, seed=1)
    schedule, _, _ = plan_schedule(trace, cfg)
    assert {p.kind for p in schedule} == set(CLUSTER_INJECTED.values())
    no_ns = plan_schedule(trace, SoakConfig(wall_s=3600.0, trace_faults=300.0, extra=(), nodes=2, seed=1,
                                            netns=False))[0]
    assert all(p.reason == NO_NETNS_REASON for p in no_ns if p.fault_class == "link")


def test_a_node_agent_that_failed_at_the_end_fails_the_drill(tmp_path) -> None:
    # The cluster drill left its loop once every agent had exited and reported exit code 0 whatever their codes
    # were: a job the coordinator declared failed after rank 0 wrote its digest read "exit 0" (and was verified).
    from trainguard.drill.soak_cluster import _Node, check_exits

    nodes = []
    for name, code in (("n0", 0), ("n1", 3)):
        log = tmp_path / f"{name}.log"
        log.write_text(f"trainguard: job failed in generation 2 ({name})\n")
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        proc.wait()
        nodes.append(_Node(name, len(nodes), "active", proc, log, hw=None))
    check_exits(nodes[:1])  # every agent exited 0: nothing to say
    with pytest.raises(SoakError, match=r"node agent n1 exited with code 3: trainguard: job failed in generation 2"):
        check_exits(nodes)


def test_a_standby_counts_as_waiting_once_it_blocks_on_its_orders(tmp_path) -> None:
    # A new spare is ready once its standby has done its imports and reads its orders from stdin (was: a fixed 8 s
    # after it registered, waited out by every node fault of the cluster drill).
    from trainguard.drill.soak_cluster import standbys_waiting

    gate = tmp_path / "imported"
    standby = subprocess.Popen([sys.executable, "-u", "-c", "import os, sys, time\n"
                                "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
                                "sys.stdin.readline()\n", str(gate)], stdin=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        pids = {standby.pid, other.pid}
        deadline = time.monotonic() + 60
        assert standbys_waiting(pids) in ((0, 1), None)  # still "importing"; the other is no standby
        if standbys_waiting(pids) is None:
            pytest.skip("/proc/<pid>/syscall is not readable here")
        gate.touch()
        while standbys_waiting(pids) != (1, 1):
            assert time.monotonic() < deadline, standbys_waiting(pids)
            time.sleep(0.01)
    finally:
        for p in (standby, other):
            p.stdin.close()
            p.wait()


@pytest.mark.skipif(NETNS_WHY is not None, reason=str(NETNS_WHY))
def test_a_second_fabric_never_takes_a_subnet_in_use(monkeypatch) -> None:
    """Fabrics draw their subnets at random; a second one (another drill, a test beside this one) drawing a /24
    the first one's bridge holds would misroute both. The draw is made again."""
    import types
    import uuid

    import trainguard.drill.netns as netns

    with Fabric() as first:
        draws = iter([uuid.UUID(first.tag + "0" * 27), uuid.uuid4()])
        monkeypatch.setattr(netns, "uuid", types.SimpleNamespace(uuid4=lambda: next(draws)))
        second = Fabric()
        assert second.tag != first.tag
        assert not set(second._subnets.values()) & set(first._subnets.values())
