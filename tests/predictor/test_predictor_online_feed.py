"""Detectors -> predictor glue: real detectors on fake sysfs/kmsg trees (real file formats) feed a PredictorMonitor."""

from __future__ import annotations

import logging
import math
import subprocess
import time

import numpy as np
import pytest

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainguard.agent.metrics import AgentMetrics
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.kmsg import KmsgConfig, KmsgDetector
from trainguard.detectors.nvidia import GpuReading, NvidiaConfig, NvidiaDetector
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.detectors.roce import RoceConfig, RoceDetector
from trainguard.detectors.runner import DetectorRunner
from trainguard.predictor.catalog import BY_NAME
from trainguard.predictor.history import MetricHistory
from trainguard.predictor.online_feed import (
    CATALOG_MAPPINGS,
    RATE_INTEGRALS,
    PredictorMonitor,
    RateIntegrator,
    detector_metrics_to_catalog,
)
from trainguard.predictor.runtime import PredictorRuntime
from trainguard.testing.kmsg import append_kmsg
from trainguard.testing.netns import NetnsUnavailable, veth_pair
from trainguard.testing.nvml import GpuBackendDouble
from trainguard.testing.sysfs import write_pci_device, write_rdma_port

# --- fake trees in the kernel's formats ----------------------------------------------------------------------

ROOT_PORT, GPU0, GPU1 = "0000:00:03.0", "0000:3b:00.0", "0000:3c:00.0"
pci_device = write_pci_device  # one PCI function in the kernel's sysfs formats (trainguard.testing)


def pci_tree(root, gpu0_cor=0, gpu1_cor=0, gpu0_fatal=0, gpu0_width=16):
    pci_device(root, ROOT_PORT, cls="0x060400")
    pci_device(root, GPU0, cor={"RxErr": gpu0_cor}, fatal={"DLP": gpu0_fatal}, width=gpu0_width, above=ROOT_PORT)
    pci_device(root, GPU1, cor={"BadTLP": gpu1_cor}, above=ROOT_PORT)


def rdma_tree(root, dev="mlx5_0", **counters):
    """An RDMA port without a backing netdev: with one, the detector (no listener runs here) would dump the link
    table over netlink at each sample, slow on a loaded machine; link state from netlink is covered by the veth
    test."""
    write_rdma_port(root, device=dev, netdev=None, **counters)


XID13 = "4,1202,5123456790,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception"
XID79 = "6,1203,5123456791,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."


def gpu(index, pci, temp=50, sbe=0, dbe=0, throttle=0x1) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{index}", pci_bus_id=pci, name="H100", temperature_c=temp,
                      slowdown_temp_c=90, ecc_volatile_corrected=sbe, ecc_volatile_uncorrected=dbe,
                      ecc_aggregate_corrected=0, ecc_aggregate_uncorrected=0, remapped_correctable=0,
                      remapped_uncorrectable=0, throttle_reasons=throttle)


class Node:
    """A runner over real detectors plus a monitor fed by its events and metrics."""

    def __init__(self, detectors, runtime=None, history=None, realarm_s=300.0, settle_s=60.0):
        self.alarms, self.scores = [], []
        self.monitor = PredictorMonitor(runtime or PredictorRuntime.load(None), "node-a", history=history,
                                        on_alarm=self.alarms.append, on_score=self.scores.append, realarm_s=realarm_s,
                                        settle_s=settle_s)
        self.runner = DetectorRunner(detectors, on_event=self.monitor.observe_event)

    def tick(self, ts, step_time_s=None, without=()):
        """One interval; ``without``: prefixes of detector metrics this tick lacks (a detector not sampled yet)."""
        self.runner.run_once()
        metrics = {k: v for k, v in self.runner.latest_metrics().items() if not k.startswith(tuple(without))}
        return self.monitor.tick(ts, metrics, step_time_s)

    def close(self):
        self.runner.stop()


# --- rules tier end to end -----------------------------------------------------------------------------------

def test_aer_fatal_increase_alarms_once_and_is_stored(tmp_path):
    root = tmp_path / "root"
    pci_tree(root)
    hist = MetricHistory(tmp_path / "h.sqlite")
    node = Node([PcieDetector(PcieConfig(root=str(root)))], history=hist)
    try:
        t0 = 1_700_000_000.0
        for k in range(3):
            s = node.tick(t0 + 5 * k, step_time_s=0.8)
            assert s is not None and not s.alarm
        pci_tree(root, gpu0_fatal=1)
        s = node.tick(t0 + 15)
        assert s.alarm and s.source == "rules" and [h.rule for h in s.rule_hits] == ["aer-fatal"]
        assert s.rule_hits[0].evidence == {"pcie_aer_fatal_total": 1.0}
        for k in range(4, 8):  # the counter stays at 1: no new increase, no new alarm
            assert not node.tick(t0 + 5 * k).alarm
        assert len(node.alarms) == 1 and node.alarms[0].rule_hits[0].rule == "aer-fatal"
        assert len(node.scores) == 8
        node.monitor.record_failure(t0 + 60, "PCIe fatal")
        metrics, events = hist.to_tables()
        assert len(metrics.ts) == 8 and list(events.kind) == ["PCIe fatal"]
        col = metrics.values[:, metrics.columns.index("pcie_aer_fatal_total")]
        assert col.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        assert metrics.values[0, metrics.columns.index("step_time_s")] == 0.8
    finally:
        node.close()
        hist.close()


def test_restarted_agent_reads_an_old_aer_fatal_count_as_its_baseline(tmp_path):
    """The sysfs AER counters count since boot: an agent restarted on a node that had a fatal error days ago
    (handled then) read the standing count as an increase from 0 and drained the node again at once."""
    pci_tree(tmp_path, gpu0_fatal=2)
    node = Node([PcieDetector(PcieConfig(root=str(tmp_path)))])
    try:
        t0 = 1_700_000_000.0
        assert not node.tick(t0).alarm and node.monitor.last_sample["pcie_aer_fatal_total"] == 2.0
        assert not node.tick(t0 + 5).alarm
        pci_tree(tmp_path, gpu0_fatal=3)  # a new one: that is an alarm
        assert [h.rule for h in node.tick(t0 + 10).rule_hits] == ["aer-fatal"]
    finally:
        node.close()


def test_xid_counted_before_the_first_tick_alarms(tmp_path):
    """The agent's Xid counters start at 0 with it: a Xid that reached the monitor before its first tick is new
    and must alarm, though a counter's first reading is otherwise a baseline."""
    append_kmsg(tmp_path)
    node = Node([KmsgDetector(KmsgConfig(root=str(tmp_path)))])
    try:
        node.runner.run_once()  # the detector opened the log (at its end) and sampled before any tick
        append_kmsg(tmp_path, XID79)
        s = node.tick(1.0)
        assert node.monitor.last_sample["gpu_xid_79_total"] == 1.0
        assert s.alarm and [h.rule for h in s.rule_hits] == ["xid79-fell-off-bus"]
    finally:
        node.close()


def test_narrow_link_alarms_on_edge_and_again_every_realarm_s(tmp_path):
    pci_tree(tmp_path)
    node = Node([PcieDetector(PcieConfig(root=str(tmp_path)))], realarm_s=20.0)
    try:
        assert not node.tick(100.0).alarm
        assert node.monitor.last_sample["pcie_link_width"] == node.monitor.last_sample["pcie_link_width_max"] == 1.0
        pci_tree(tmp_path, gpu0_width=8)  # trained at x8 of x16
        fired_at = []
        for k in range(1, 10):  # 45 s of a lasting fault
            s = node.tick(100.0 + 5 * k)
            assert s.alarm and [h.rule for h in s.rule_hits] == ["pcie-link-width-degraded"]
            if node.alarms and node.alarms[-1] is s:
                fired_at.append(s.ts)
        assert fired_at == [105.0, 125.0, 145.0]
        assert node.monitor.last_sample["pcie_link_width"] == 0.5
        pci_tree(tmp_path)  # retrained at full width: the condition clears
        assert not node.tick(200.0).alarm
        pci_tree(tmp_path, gpu0_width=8)
        assert node.tick(205.0).alarm and len(node.alarms) == 4  # a new rising edge alarms at once
    finally:
        node.close()


def test_rdma_port_down_is_nic_down(tmp_path):
    rdma_tree(tmp_path)
    rdma_tree(tmp_path, dev="mlx5_1")
    node = Node([RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))])
    try:
        assert not node.tick(10.0).alarm and node.monitor.last_sample["nic_up"] == 1.0
        rdma_tree(tmp_path, dev="mlx5_1", state="1: DOWN")
        s = node.tick(15.0)
        assert s.alarm and [h.rule for h in s.rule_hits] == ["nic-down"]
        assert node.monitor.last_sample["nic_up"] == 0.0 and len(node.alarms) == 1
    finally:
        node.close()


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def veth_ns():
    """A fresh network namespace holding an up veth pair (tgpa, tgpb); removed even when the test fails."""
    try:
        with veth_pair("tgfeed", "tgpa", "tgpb") as (ns, _, _):
            yield ns
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.netns
def test_real_link_down_is_nic_down_and_counts_carrier_changes(veth_ns, tmp_path):
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=veth_ns, interfaces=("tgpa",), ethtool=False,
                                  interval_s=0.1, down_grace_s=3600))
    alarms = []
    mon = PredictorMonitor(PredictorRuntime.load(None), "node-a", on_alarm=alarms.append)
    runner = DetectorRunner([det], on_event=mon.observe_event)

    def tick_when(ts, pred):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = runner.latest_metrics()
            if pred(m):
                return mon.tick(ts, m)
            time.sleep(0.02)
        raise AssertionError(f"detector metrics never reached the expected state: {runner.latest_metrics()}")

    clock = iter(range(1, 10**6))

    def carrier_changes_reach(n):
        # the event (listener thread) and the polled link state (sampler thread) race: tick until both are in
        deadline = time.monotonic() + 10
        while mon.last_sample.get("nic_carrier_changes_total") != n and time.monotonic() < deadline:
            time.sleep(0.02)
            mon.tick(float(next(clock)), runner.latest_metrics())
        return mon.last_sample.get("nic_carrier_changes_total")

    try:
        runner.start()
        assert det.wait_ready(30.0), "the netlink listener did not start"
        s = tick_when(float(next(clock)), lambda m: m.get("roce.link_up[tgpa]") == 1.0)
        assert not s.alarm and mon.last_sample["nic_carrier_changes_total"] == 0.0
        assert _ip("-n", veth_ns, "link", "set", "tgpa", "down").returncode == 0
        s = tick_when(float(next(clock)), lambda m: m.get("roce.link_up[tgpa]") == 0.0)
        assert s.alarm and [h.rule for h in s.rule_hits] == ["nic-down"]
        assert carrier_changes_reach(1.0) == 1.0
        assert _ip("-n", veth_ns, "link", "set", "tgpa", "up").returncode == 0
        s = tick_when(float(next(clock)), lambda m: m.get("roce.link_up[tgpa]") == 1.0)
        assert not s.alarm and carrier_changes_reach(2.0) == 2.0
        assert len(alarms) == 1  # one lasting down, one alarm
    finally:
        runner.stop()


def test_xids_from_kernel_log_and_nvml_counted_once(tmp_path):
    append_kmsg(tmp_path)
    backend = GpuBackendDouble([gpu(0, GPU0, temp=55, sbe=3, throttle=0x1), gpu(1, GPU1, temp=71, sbe=4, dbe=1)])
    node = Node([KmsgDetector(KmsgConfig(root=str(tmp_path))), NvidiaDetector(NvidiaConfig(), backend=backend)])
    try:
        s = node.tick(1.0)
        smp = node.monitor.last_sample
        assert not s.alarm and smp["gpu_xid_79_total"] == 0.0 and smp["gpu_xid_total"] == 0.0
        assert (smp["gpu_ecc_sbe_total"], smp["gpu_ecc_dbe_total"], smp["gpu_temp_c"]) == (7.0, 1.0, 71.0)
        assert smp["gpu_throttle_frac"] == 0.0  # 0x1 is GpuIdle: policy, not trouble
        append_kmsg(tmp_path, XID13)
        backend.xids = [(0, 13)]  # NVML sees the same Xid as the kernel log: counted once
        backend.readings[1] = gpu(1, GPU1, temp=71, sbe=4, dbe=1, throttle=0x40)  # HW thermal slowdown
        assert not node.tick(2.0).alarm
        smp = node.monitor.last_sample
        assert smp["gpu_xid_13_total"] == 1.0 and smp["gpu_xid_total"] == 1.0 and smp["gpu_throttle_frac"] == 1.0
        append_kmsg(tmp_path, XID79)
        s = node.tick(3.0)
        assert s.alarm and [h.rule for h in s.rule_hits] == ["xid79-fell-off-bus"]
        smp = node.monitor.last_sample
        assert smp["gpu_xid_79_total"] == 1.0 and smp["gpu_xid_total"] == 1.0  # 79 is fatal, not in the total
    finally:
        node.close()


# --- mapping -------------------------------------------------------------------------------------------------

def test_counters_sum_over_devices_and_rates_integrate(tmp_path):
    pci_tree(tmp_path, gpu0_cor=5, gpu1_cor=7)
    rdma_tree(tmp_path)
    rdma_tree(tmp_path, dev="mlx5_1")
    node = Node([PcieDetector(PcieConfig(root=str(tmp_path))), RoceDetector(RoceConfig(root=str(tmp_path),
                                                                                        ethtool=False))])
    try:
        node.tick(100.0)
        smp = node.monitor.last_sample
        # root port + two GPUs; every AER counter under the watched paths is summed
        assert smp["pcie_aer_corrected_total"] == 12.0 and smp["pcie_aer_fatal_total"] == 0.0
        assert smp["nic_symbol_errors_total"] == smp["rdma_retrans_total"] == smp["rdma_cnp_total"] == 0.0
        expected = 0.0
        for k in range(1, 4):
            pci_tree(tmp_path, gpu0_cor=5 + 10 * k, gpu1_cor=7 + k)
            rdma_tree(tmp_path, symbol=100 * k, oos=1000 * k, ack_timeout=10 * k, cnp=50 * k)
            rdma_tree(tmp_path, dev="mlx5_1", symbol=100 * k)
            node.tick(100.0 + 5 * k)
            m = node.runner.latest_metrics()
            # the detector's rate is per second of its own (real) sampling interval; the tick holds it 5 s
            expected += (m["roce.symbol_error_per_s[mlx5_0/1]"] + m["roce.symbol_error_per_s[mlx5_1/1]"]) * 5.0
        smp = node.monitor.last_sample
        assert smp["pcie_aer_corrected_total"] == 12.0 + 33.0
        assert smp["nic_symbol_errors_total"] == pytest.approx(expected, rel=1e-9) and expected > 0
        # one sampling clock for every port of a detector sample: the integrated totals keep the counters'
        # ratios, which checks that both ports and both retransmission counters are summed
        sym = smp["nic_symbol_errors_total"]
        assert smp["rdma_retrans_total"] / sym == pytest.approx(3030 / 600, rel=1e-6)
        assert smp["rdma_cnp_total"] / sym == pytest.approx(150 / 600, rel=1e-6)
        assert set(smp) <= set(BY_NAME) | {"pcie_aer_fatal_total", "pcie_link_width", "pcie_link_width_max", "nic_up"}
    finally:
        node.close()


def test_mapping_table_is_well_formed_and_drops_unknown_names():
    targets = [m.target for m in CATALOG_MAPPINGS] + [r.target for r in RATE_INTEGRALS]
    assert len(set(targets)) == len(targets)
    rule_names = {"pcie_aer_fatal_total", "nic_up"}
    assert all(t in BY_NAME or t in rule_names for t in targets)
    out = detector_metrics_to_catalog({
        "pcie.aer_correctable[a]": 1.0, "pcie.aer_correctable[b]": "garbage", "pcie.aer_correctable_total": 99.0,
        "nvidia.temp_c[0]": float("nan"), "host.cpu_percent": 50.0, "roce.link_up[eth0]": 1.0,
        "roce.port_active[mlx5_0/1]": float("inf"),
    }, step_time_s=-1.0)
    # the node total is not added to the per-device sum; unreadable values are skipped; all-NaN -> NaN
    assert out["pcie_aer_corrected_total"] == 1.0 and out["nic_up"] == 1.0 and math.isnan(out["gpu_temp_c"])
    assert set(out) == {"pcie_aer_corrected_total", "nic_up", "gpu_temp_c"}  # step time <= 0 dropped
    integ = RateIntegrator()
    assert integ.update(0.0, {"roce.symbol_error_per_s": 2.0}) == {"nic_symbol_errors_total": 0.0}
    assert integ.update(10.0, {"roce.symbol_error_per_s": 2.0}) == {"nic_symbol_errors_total": 20.0}
    assert integ.update(20.0, {}) == {}  # detector failed: missing, and the gap is not integrated
    assert integ.update(30.0, {"roce.symbol_error_per_s": 1.0}) == {"nic_symbol_errors_total": 20.0}


def test_carrier_changes_from_link_events():
    mon = PredictorMonitor(PredictorRuntime.load(None), "n")
    for kind in ("net.link_down", "net.link_up", "net.link_down"):
        mon.observe_event(HealthEvent("roce", kind, Severity.ERROR, Action.CHECKPOINT_NOW, "x", "eth0",
                                      {"ifname": "eth0"}))
    mon.observe_event(HealthEvent("roce", "net.link_up", Severity.INFO, Action.NONE, "x", "eth0",
                                  {"ifname": "eth0"}))
    mon.tick(1.0, {"roce.links_watched": 1.0, "roce.link_up[eth0]": 1.0})
    assert mon.last_sample["nic_carrier_changes_total"] == 4.0


# --- bad input -----------------------------------------------------------------------------------------------

def test_bad_ticks_never_raise_and_are_logged_once(tmp_path, caplog):
    hist = MetricHistory(tmp_path / "h.sqlite")
    calls = []

    def broken(score):
        calls.append(score)
        raise RuntimeError("consumer bug")

    mon = PredictorMonitor(PredictorRuntime.load(None), "n", history=hist, on_score=broken)
    good = {"pcie.aer_fatal[x]": 0.0, "pcie.links_watched": 1.0}
    with caplog.at_level(logging.DEBUG, logger="trainguard.predictor.online_feed"):
        assert mon.tick(10.0, {}) is None  # runner not sampled yet
        assert mon.tick(10.0, good) is not None and mon.tick(11.0, good) is not None  # callback errors swallowed
        assert len(calls) == 2
        for bad_ts in (11.0, 5.0, float("nan"), "soon"):
            assert mon.tick(bad_ts, good) is None
        assert mon.tick(12.0, "not a mapping") is None  # type: ignore[arg-type]
        hist.close()  # the store fails from now on: scoring goes on
        s = mon.tick(13.0, {"pcie.aer_fatal[x]": 1.0, "pcie.links_watched": 1.0})
        assert s is not None and s.alarm
        mon.record_failure(14.0, "GPU Lost")
    assert mon.problems["ts-not-increasing"] == 2 and mon.problems["on_score:RuntimeError"] == 3
    assert any(k.startswith("history:") for k in mon.problems) and any(k.startswith("failure:") for k in mon.problems)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    keys = [r.getMessage() for r in loud]
    assert sum("not after the previous" in m for m in keys) == 1  # once per distinct problem
    assert sum("consumer bug" in m for m in keys) == 1


# --- learned tier --------------------------------------------------------------------------------------------

def _train(columns, seed=0):
    """A robust-z model on 3 h of one healthy node at 5 s (peer features off, as on a lone agent)."""
    from trainguard.predictor.evaluation import EvalConfig
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.table import MetricTable
    from trainguard.predictor.training import TrainConfig, train

    rng = np.random.default_rng(seed)
    n = 3 * 720
    cols = []
    for c in columns:
        if c == "step_time_s":
            cols.append(1.0 + 0.02 * rng.standard_normal(n))
        elif c == "gpu_temp_c" or c.startswith("host_"):
            cols.append(60 + rng.standard_normal(n))
        else:  # a counter with rare small increments
            cols.append(np.cumsum(rng.random(n) < 0.01).astype(float))
    table = MetricTable(list(columns), 1_600_000_000 + 5.0 * np.arange(n), np.array(["train-node"] * n, object),
                        np.column_stack(cols))
    cfg = TrainConfig(method="robust-z", features=FeatureConfig(interval_s=5.0, short_window_s=60.0,
                                                                long_window_s=300.0, peer=False),
                      evaluation=EvalConfig(), online_calibration=False)
    # the fleet threshold: these tests are about the agent's metric mapping within minutes, and a node's own
    # online threshold needs a day of history first (tests/predictor/test_predictor_calibration.py)
    return train(table, None, cfg)


LEARNED = ("pcie_aer_corrected_total", "nic_symbol_errors_total", "rdma_retrans_total", "rdma_cnp_total",
           "step_time_s")


def _pci_rdma_node(root, model) -> "Node":
    """A fake PCIe and RDMA tree under ``root`` read by the real detectors, scored by ``model``."""
    pci_tree(root)
    rdma_tree(root)
    return Node([PcieDetector(PcieConfig(root=str(root))), RoceDetector(RoceConfig(root=str(root), ethtool=False))],
                runtime=PredictorRuntime(model))


def test_learned_tier_scores_the_mapped_names(tmp_path):
    model = _train(LEARNED)
    assert list(model.spec.metrics) == list(LEARNED)
    node = _pci_rdma_node(tmp_path, model)
    try:
        t0 = 1_700_000_000.0
        for k in range(30):  # 150 s healthy
            s = node.tick(t0 + 5 * k, step_time_s=1.0)
            assert s is not None and s.source == "model" and not s.degraded
        assert not node.monitor.rules_only and not node.alarms
        assert not [k for k in node.monitor.problems if k.startswith("missing:")]
        cor = 0
        for k in range(30, 40):  # a burst of correctable AER errors: 200 per 5 s
            cor += 200
            pci_tree(tmp_path, gpu0_cor=cor)
            s = node.tick(t0 + 5 * k, step_time_s=1.0)
        assert s.alarm and s.source == "model"
        assert node.alarms and node.alarms[0].source == "model"
        assert any(f.startswith("pcie_aer_corrected_total") for f, _ in node.alarms[0].top_features)
        # the realised alarm rate the agent exports next to the threshold (trainguard_predictor_alarms_per_day)
        rate = node.monitor.runtime.realised_alarms_per_day()
        (status,) = node.monitor.runtime.status()
        assert status.alarms >= 1 and rate == pytest.approx(status.alarms_per_day) and rate > 0
        metrics = AgentMetrics("node-a")
        metrics.set_predictor(s.score, s.threshold, rate)
        exported = {x.name: x.value for f in text_string_to_metric_families(
            generate_latest(metrics.registry).decode()) for x in f.samples}
        assert exported["trainguard_predictor_alarms_per_day"] == pytest.approx(rate)
        assert exported["trainguard_predictor_threshold"] == pytest.approx(s.threshold)
    finally:
        node.close()


def test_model_metric_this_node_lacks_falls_back_to_rules(tmp_path, caplog):
    model = _train(LEARNED + ("gpu_temp_c",))
    node = _pci_rdma_node(tmp_path, model)
    try:
        with caplog.at_level(logging.INFO, logger="trainguard.predictor.online_feed"):
            s = node.tick(1000.0, step_time_s=1.0)
            assert s.source == "model" and not node.monitor.rules_only  # judged at the end of the settle window
            s = node.tick(1060.0, step_time_s=1.0)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "gpu_temp_c" in errors[0] and "rules tier only" in errors[0]
        assert s is not None and s.source == "rules" and node.monitor.rules_only
        assert node.monitor.absent_model_metrics == ["gpu_temp_c"]
        pci_tree(tmp_path, gpu0_fatal=1)
        s = node.tick(1065.0, step_time_s=1.0)
        assert s.alarm and [h.rule for h in s.rule_hits] == ["aer-fatal"]
    finally:
        node.close()


def test_a_model_of_this_nodes_history_is_kept_while_no_step_is_reported(tmp_path, caplog):
    """A model trained on this node's own exported history (step time among its metrics) used to be dropped for
    good at the first tick: the agent ticks before the workers' first step (found by using the CLI's advice
    "retrain on this node's history" on a real run)."""
    model = _train(LEARNED)
    history = MetricHistory(tmp_path / "h.sqlite")
    node = _pci_rdma_node(tmp_path, model)
    node.monitor.history = history
    try:
        with caplog.at_level(logging.INFO, logger="trainguard.predictor.online_feed"):
            for k in range(20):  # 95 s of start-up (rendezvous, data loading): no step yet
                s = node.tick(1000.0 + 5 * k)
            assert not node.monitor.rules_only and s.source == "model"
            for k in range(20, 30):
                s = node.tick(1000.0 + 5 * k, step_time_s=1.0)
        assert not node.monitor.rules_only and s.source == "model" and not s.degraded
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("step_time_s" in r.getMessage() and "no training step" in r.getMessage() for r in caplog.records)
        # the history keeps what was read: no step time before the first step, the step times after it
        table, _ = history.to_tables()
        steps = table.values[:, table.columns.index("step_time_s")]
        assert np.isnan(steps[:20]).all() and (steps[20:] == 1.0).all()
    finally:
        node.close()
        history.close()


def test_a_detector_that_samples_late_is_not_taken_for_absent(tmp_path, caplog):
    """Detectors sample at their own intervals (up to 30 s by default): the first tick holds only some of their
    metrics. A model metric of a detector that has not sampled yet must not drop the model for good."""
    node = _pci_rdma_node(tmp_path, _train(LEARNED))
    try:
        with caplog.at_level(logging.INFO, logger="trainguard.predictor.online_feed"):
            for k in range(6):  # the RoCE detector's first sample comes 30 s after the PCIe one's
                node.tick(1000.0 + 5 * k, step_time_s=1.0, without=("roce.",))
            for k in range(6, 20):
                s = node.tick(1000.0 + 5 * k, step_time_s=1.0)
        assert not node.monitor.rules_only and s.source == "model" and not s.degraded
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        node.close()


def test_host_metrics_reach_the_history_and_a_model_trained_on_them(tmp_path, caplog):
    """Any numeric metric (issue 19), end to end in the agent: the host-side detectors' node-level metrics are
    fed under their own names, so the history records them and a model trained on them scores. Before, only
    catalog metrics were fed: such a model fell back to the rules tier on every node ("this node does not
    produce host_mem_available_pct")."""
    from trainguard.detectors.host import HostConfig, HostDetector

    history = MetricHistory(tmp_path / "h.sqlite")
    node = Node([HostDetector(HostConfig())], runtime=PredictorRuntime(_train(("host_mem_available_pct",
                                                                              "host_load1_per_cpu"))),
                history=history, settle_s=0.0)  # the real /proc of this machine
    try:
        with caplog.at_level(logging.ERROR, logger="trainguard.predictor.online_feed"):
            scores = [node.tick(1000.0 + 5 * k) for k in range(3)]
        assert not caplog.records and not node.monitor.rules_only
        assert all(s is not None and s.source == "model" and not s.degraded for s in scores)
        table, _ = history.to_tables()
        assert {"host_mem_available_pct", "host_load1_per_cpu", "host_cpu_percent"} <= set(table.columns)
        assert 0 < table.values[-1, table.columns.index("host_mem_available_pct")] <= 100
        assert not [c for c in table.columns if "[" in c or c.startswith("process_")]  # per-device values stay out
    finally:
        node.close()
        history.close()


def test_a_failure_takes_the_hours_before_it_out_of_the_nodes_calibration(tmp_path):
    # the agent reports a failure of its node (NodeHealth.record_failure): the hours before it were an incident,
    # not the node's normal operation, so they leave the history its own threshold is fitted on
    from dataclasses import replace

    from trainguard.predictor.calibration import CalibrationConfig

    class Recording(PredictorRuntime):
        def __init__(self, model):
            super().__init__(model)
            self.incidents = []

        def record_incident(self, node, start, end):
            self.incidents.append((node, start, end))
            super().record_incident(node, start, end)

    fleet = _train(LEARNED)
    calibrated = replace(fleet, calibration=CalibrationConfig.for_interval(5.0, 1.0, warmup_s=0.0, window_s=3600.0))
    for model, expect in ((calibrated, True), (fleet, False)):
        rt = Recording(model)
        node = _pci_rdma_node(tmp_path / ("c" if expect else "f"), model)
        node.monitor.runtime = rt
        try:
            t0 = 1_700_000_000.0
            for k in range(40):
                assert node.tick(t0 + 5 * k, step_time_s=1.0) is not None
            node.monitor.record_failure(t0 + 200.0, "GPU Lost")
        finally:
            node.close()
        if expect:
            assert rt.incidents == [("node-a", t0 + 200.0 - model.eval_config.early_s, t0 + 200.0)]
            cal = rt._cal["node-a"]
            assert not cal._blocks  # every block of the node's short history lay in the incident's span
        else:  # the fleet's fixed threshold: nothing to take out of
            assert rt.incidents == []
