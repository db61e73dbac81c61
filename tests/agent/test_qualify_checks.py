"""Pre-flight checks on fake sysfs trees in the kernel's formats, real veths, real files and a full tmpfs."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from trainguard.agent.config import AgentConfig, AgentConfigError
from trainguard.agent.qualify import CheckStatus, QualifyConfigError, QualifySection, Verdict
from trainguard.agent.qualify.base import QualifyContext, passed, register_check
from trainguard.agent.qualify.runner import qualify_node
from trainguard.testing.sysfs import GPU, FakeNodeHardware, write_pci_device

NIC = "0000:5e:00.0"


def ctx_for(root: Path, checks: list[str], **fields) -> QualifyContext:
    section = QualifySection(checks=checks, root=str(root), **fields)
    section.validate()
    return QualifyContext(node_id="n1", config=section)


def one(ctx: QualifyContext):
    verdict = qualify_node(ctx)
    assert len(verdict.results) == 1
    return verdict, verdict.results[0]


# -- pcie ----------------------------------------------------------------------------------------------------
def test_pcie_full_width_passes_and_narrowed_link_fails_with_the_device(tmp_path) -> None:
    hw = FakeNodeHardware(tmp_path)
    verdict, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.PASS and verdict.passed, r
    hw.narrow_link(4)
    verdict, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and not verdict.passed
    assert f"{GPU} link trained at x4, below its x16" in r.detail
    assert verdict.reason.startswith("pcie: ")


def test_pcie_down_link_and_slow_nic_fail_idle_gpu_speed_does_not(tmp_path) -> None:
    write_pci_device(tmp_path, GPU, speed="2.5 GT/s PCIe")  # a GPU lowers its speed when idle: fine
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.PASS, r
    write_pci_device(tmp_path, NIC, cls="0x020000", speed="16.0 GT/s PCIe")  # a NIC never does
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and f"{NIC} link at 16.0 GT/s, below its 32 GT/s" in r.detail
    write_pci_device(tmp_path, GPU, width=0)
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert f"{GPU} link is down (width 0)" in r.detail


def test_pcie_device_globs_and_no_links_skip(tmp_path) -> None:
    write_pci_device(tmp_path, GPU, width=8)
    _, r = one(ctx_for(tmp_path, ["pcie"], pcie_devices=["0000:5e:*"]))
    assert r.status is CheckStatus.SKIP and "no watched PCIe links" in r.detail
    _, r = one(ctx_for(tmp_path, ["pcie"], pcie_devices=["0000:3b:*"]))
    assert r.status is CheckStatus.FAIL


def test_pcie_malformed_file_fails_naming_it(tmp_path) -> None:
    d = write_pci_device(tmp_path, GPU)
    (d / "current_link_width").write_text("x16\n")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and "current_link_width" in r.detail and "expected one integer" in r.detail


# -- nic -----------------------------------------------------------------------------------------------------
def fake_nic(root: Path, name: str, speed: str, operstate: str = "up", carrier: str = "1") -> None:
    d = root / "sys/class/net" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "speed").write_text(speed + "\n")
    (d / "operstate").write_text(operstate + "\n")
    (d / "carrier").write_text(carrier + "\n")


def test_nic_speed_against_the_expected_one(tmp_path) -> None:
    fake_nic(tmp_path, "ens1f0", "200000")
    fake_nic(tmp_path, "ens1f1", "100000")
    _, r = one(ctx_for(tmp_path, ["nic"], net_root=str(tmp_path), nics=["ens1f0"], nic_speed_mbps=200000))
    assert r.status is CheckStatus.PASS and "ens1f0 200000 Mb/s" in r.detail
    _, r = one(ctx_for(tmp_path, ["nic"], net_root=str(tmp_path), nics=["ens1f*"], nic_speed_mbps=200000))
    assert r.status is CheckStatus.FAIL and r.detail == "ens1f1 at 100000 Mb/s, expected 200000 Mb/s"
    fake_nic(tmp_path, "ens1f1", "-1")  # virtio: no speed; fine unless a speed is expected
    _, r = one(ctx_for(tmp_path, ["nic"], net_root=str(tmp_path), nics=["ens1f1"]))
    assert r.status is CheckStatus.PASS and r.detail == "ens1f1 unknown Mb/s"
    _, r = one(ctx_for(tmp_path, ["nic"], net_root=str(tmp_path), nics=["ens1f1"], nic_speed_mbps=1000))
    assert r.status is CheckStatus.FAIL and "speed unknown" in r.detail
    _, r = one(ctx_for(tmp_path, ["nic"], net_root=str(tmp_path), nics=["ib*"]))
    assert r.status is CheckStatus.FAIL and "no interface matches ['ib*']" in r.detail
    _, r = one(ctx_for(tmp_path, ["nic"], net_root=str(tmp_path)))
    assert r.status is CheckStatus.SKIP


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_nic_on_a_real_veth_in_a_netns_passes_then_fails_when_its_peer_goes_down(tmp_path) -> None:
    """The veth driver reports 10000 Mb/s; with the peer down it still reports it, but carrier drops."""
    tag = uuid.uuid4().hex[:6]
    ns, host, peer = f"tgq{tag}", f"tgqh{tag}", f"tgqp{tag}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("netns", "exec", ns, "ip", "link", "set", peer, "up")
        _ip("link", "set", host, "up")
        script = ("import sys; from trainguard.agent.qualify import QualifySection; "
                  "from trainguard.agent.qualify.base import QualifyContext; "
                  "from trainguard.agent.qualify.runner import qualify_node; "
                  f"s = QualifySection(checks=['nic'], nics=['{peer}'], nic_speed_mbps=10000); "
                  "print(qualify_node(QualifyContext('n1', s)).to_json())")

        def check() -> dict:
            out = subprocess.run(["ip", "netns", "exec", ns, os.sys.executable, "-c", script], check=True,
                                 capture_output=True, text=True).stdout
            return json.loads(out)["checks"][0]

        deadline = time.monotonic() + 5
        got = check()
        while got["status"] != "pass" and time.monotonic() < deadline:  # carrier comes up a moment after
            time.sleep(0.1)
            got = check()
        assert got["status"] == "pass" and got["detail"] == f"{peer} 10000 Mb/s", got
        _ip("link", "set", host, "down")
        got = check()
        # operstate reads "down" or "lowerlayerdown" depending on the kernel; carrier 0 either way
        assert got["status"] == "fail" and f"{peer} is not up (operstate " in got["detail"], got
        assert got["detail"].endswith("down, carrier 0)"), got
    finally:
        subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- rdma ----------------------------------------------------------------------------------------------------
def fake_port(root: Path, dev: str, port: int, state: str = "4: ACTIVE", rate: str = "200 Gb/sec (4X HDR)") -> None:
    d = root / "sys/class/infiniband" / dev / "ports" / str(port)
    d.mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text("5: LinkUp\n")
    (d / "rate").write_text(rate + "\n")


def test_rdma_ports_active_at_rate(tmp_path) -> None:
    _, r = one(ctx_for(tmp_path, ["rdma"]))
    assert r.status is CheckStatus.SKIP
    fake_port(tmp_path, "mlx5_0", 1)
    fake_port(tmp_path, "mlx5_1", 1)
    _, r = one(ctx_for(tmp_path, ["rdma"], rdma_rate_gbps=200))
    assert r.status is CheckStatus.PASS and r.detail == "2 port(s) active"
    fake_port(tmp_path, "mlx5_1", 1, rate="100 Gb/sec (2X HDR)")
    _, r = one(ctx_for(tmp_path, ["rdma"], rdma_rate_gbps=200))
    assert r.status is CheckStatus.FAIL and "mlx5_1/1 at 100 Gb/sec (2X HDR), expected 200 Gb/sec" in r.detail
    fake_port(tmp_path, "mlx5_0", 1, state="1: DOWN")
    _, r = one(ctx_for(tmp_path, ["rdma"]))
    assert r.status is CheckStatus.FAIL and "mlx5_0/1 is DOWN" in r.detail


def test_rdma_state_and_rate_take_only_ascii_digits(tmp_path) -> None:
    """Found by review: the state and rate patterns used ``\\d`` (any script's digits, as the detectors' did before
    they were made ASCII): a state of Arabic-Indic '٤: ACTIVE' passed as active, a fullwidth '２００ Gb/sec' rate
    as 200 Gb/sec. sysfs writes ASCII: anything else is not what the check can vouch for."""
    fake_port(tmp_path, "mlx5_0", 1, state="\u0664: ACTIVE")
    _, r = one(ctx_for(tmp_path, ["rdma"]))
    assert r.status is CheckStatus.FAIL and "mlx5_0/1 is" in r.detail
    fake_port(tmp_path, "mlx5_0", 1, rate="\uff12\uff10\uff10 Gb/sec (4X HDR)")
    _, r = one(ctx_for(tmp_path, ["rdma"], rdma_rate_gbps=200))
    assert r.status is CheckStatus.FAIL and "is not '<n> Gb/sec'" in r.detail
    fake_port(tmp_path, "mlx5_0", 1)
    _, r = one(ctx_for(tmp_path, ["rdma"], rdma_rate_gbps=200))
    assert r.status is CheckStatus.PASS


# -- detectors -----------------------------------------------------------------------------------------------
def test_detectors_clean_then_a_down_link_is_critical(tmp_path) -> None:
    hw = FakeNodeHardware(tmp_path)
    section = QualifySection(checks=["detectors"])
    ctx = QualifyContext("n1", section, detector_names=("pcie", "process"), detector_root=str(tmp_path))
    _, r = one(ctx)
    assert r.status is CheckStatus.PASS, r
    # process watches workers (none before a slot): left out; a narrowed link alone is only a detector warning
    hw.narrow_link(8)
    _, r = one(ctx)
    assert r.status is CheckStatus.PASS and r.detail == "1 detector(s) clean: pcie", r
    write_pci_device(tmp_path, GPU, above="0000:00:03.0", width=0)
    _, r = one(ctx)
    assert r.status is CheckStatus.FAIL and "pcie.link_down" in r.detail


# -- disk ----------------------------------------------------------------------------------------------------
def test_disk_writes_and_removes_its_file_and_refuses_a_slow_rate(tmp_path) -> None:
    ckpt = tmp_path / "ckpt" / "job1"  # not created yet: the nearest existing folder is measured
    ctx = QualifyContext("n1", QualifySection(checks=["disk"], disk_mib=2, disk_min_mib_s=0.001),
                         checkpoint_dir=str(ckpt))
    _, r = one(ctx)
    assert r.status is CheckStatus.PASS and r.detail.startswith(f"{tmp_path}: ") and "MiB/s" in r.detail
    assert not ckpt.exists() and os.listdir(tmp_path) == []
    _, r = one(replace(ctx, config=QualifySection(checks=["disk"], disk_mib=2, disk_min_mib_s=1e9)))
    assert r.status is CheckStatus.FAIL and "below the 1e+09 MiB/s minimum" in r.detail
    assert os.listdir(tmp_path) == []


def test_a_configured_disk_dir_that_does_not_exist_fails_instead_of_testing_another_disk(tmp_path) -> None:
    """qualify.disk_dir names the disk to test; when it was missing (a volume that failed to mount) the check
    wrote to its nearest existing ancestor, the root filesystem, and the node qualified on the wrong disk."""
    missing = tmp_path / "data" / "ckpt"
    ctx = QualifyContext("n1", QualifySection(checks=["disk"], disk_mib=1, disk_min_mib_s=0.001,
                                              disk_dir=str(missing)))
    _, r = one(ctx)
    assert r.status is CheckStatus.FAIL and r.detail.startswith(f"qualify.disk_dir {missing}: no such directory")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_fails_with_the_os_error(tmp_path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        ctx = QualifyContext("n1", QualifySection(checks=["disk"], disk_mib=4, disk_dir=str(small)))
        _, r = one(ctx)
        assert r.status is CheckStatus.FAIL and r.detail == f"{small}: cannot write (No space left on device)"
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


# -- runner: bounds ------------------------------------------------------------------------------------------
@register_check("test-sleeper")
class _Sleeper:
    """A check that takes 2 s (a sysfs read stuck in a driver): only the runner's bound is tested here."""

    name = "test-sleeper"

    def run(self, ctx, deadline):
        time.sleep(2.0)
        return passed("woke up")


def test_a_hung_check_fails_at_its_timeout_and_the_budget_bounds_the_rest(tmp_path) -> None:
    section = QualifySection(checks=["test-sleeper", "pcie"], check_timeout_s=0.3, budget_s=0.2)
    t0 = time.monotonic()
    verdict = qualify_node(QualifyContext("n1", section))
    took = time.monotonic() - t0
    first, second = verdict.results
    assert first.status is CheckStatus.FAIL and first.detail == "timed out after 0.2 s"
    assert second.status is CheckStatus.FAIL and "budget was spent" in second.detail
    assert took < 1.5 and verdict.duration_s < 1.5  # well before the 2 s the check would take


# -- config and verdict --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, needle", [
    ("[qualify]\nchecks = [\"pcie\", \"gpu-burn\"]\n", "qualify.checks: unknown check 'gpu-burn'"),
    ("[qualify]\nbudget_s = 0\n", "qualify.budget_s=0.0: use 0 < seconds <= 600"),
    ("[qualify]\nnic_speed_mbps = \"fast\"\n", "qualify.nic_speed_mbps: expected an integer"),
    ("[qualify]\ndisk_mb = 8\n", "unknown key 'disk_mb' in [qualify]"),
    # TOML's nan and inf: an infinite disk rate failed every node, a NaN one passed every node
    ("[qualify]\ndisk_min_mib_s = inf\n", "qualify.disk_min_mib_s: expected a finite number (inf is not"),
    ("[qualify]\nrecheck_s = nan\n", "qualify.recheck_s: expected a finite number (nan is not"),
    # were read as given: a relative root skipped the pcie and rdma checks (the node qualified on nothing), a
    # URL or relative disk_dir failed the node FATAL at run time
    ("[qualify]\nroot = \"relative\"\n", "qualify.root 'relative' is a relative path; give an absolute one"),
    ("[qualify]\nnet_root = \"net\"\n", "qualify.net_root 'net' is a relative path"),
    ("[qualify]\ndisk_dir = \"file:///tmp\"\n", "qualify.disk_dir 'file:///tmp' is a URL; give a local absolute"),
])
def test_qualify_table_errors_name_the_key(tmp_path, text, needle) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(AgentConfigError) as exc:
        AgentConfig.load(path, env={})
    assert needle in str(exc.value) and str(path) in str(exc.value)


def test_qualify_table_loads_through_the_agent_config(tmp_path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('[qualify]\nchecks = ["pcie"]\nnics = ["ens*"]\nnic_speed_mbps = 200000\n')
    q = AgentConfig.load(path, env={}).qualify
    assert q.checks == ["pcie"] and q.nics == ["ens*"] and q.nic_speed_mbps == 200000 and q.budget_s == 5.0
    with pytest.raises(QualifyConfigError):
        QualifySection(checks=["pcie", "pcie"]).validate()


def test_verdict_survives_the_wire(tmp_path) -> None:
    FakeNodeHardware(tmp_path).narrow_link(2)
    verdict = qualify_node(ctx_for(tmp_path, ["pcie", "rdma"]))
    back = Verdict.from_pb("n1", verdict.to_pb())
    assert back == verdict and not back.passed and back.reason == verdict.reason
    doc = json.loads(verdict.to_json())
    assert doc["passed"] is False and [c["status"] for c in doc["checks"]] == ["fail", "skip"]


def test_pcie_slot_limited_links_and_sriov_vfs_pass_a_real_narrow_link_fails(tmp_path) -> None:
    """The detector's two false alarms had twins here: a Gen5 x16 NIC in a Gen4 x8 slot (trained at the most that
    link can do) and every SR-IOV VF (width 0 always) refused the node before it took a slot."""
    port = "0000:5d:02.0"
    write_pci_device(tmp_path, port, cls="0x060400", width=8, max_width=8, speed="16.0 GT/s PCIe",
                     max_speed="16.0 GT/s PCIe")
    write_pci_device(tmp_path, NIC, cls="0x020000", above=port, width=8, speed="16.0 GT/s PCIe")
    vf = write_pci_device(tmp_path, "0000:5e:00.2", cls="0x020000", above=port, width=0, speed="Unknown",
                          max_speed="16.0 GT/s PCIe")
    (vf / "physfn").symlink_to(f"../{NIC}")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.PASS, r
    write_pci_device(tmp_path, NIC, cls="0x020000", above=port, width=4, speed="16.0 GT/s PCIe")  # below the slot
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and f"{NIC} link trained at x4, below its x8" in r.detail, r


def test_pcie_integrated_endpoint_without_a_link_passes_a_down_gpu_still_fails(tmp_path) -> None:
    """A root complex integrated endpoint (an integrated GPU at 0000:00:02.0, class 0x0300, a watched class) has
    the link files in sysfs, but its link registers are not implemented and read zero: width 0 of a maximum 0,
    speeds Unknown. It read as a link down and refused the node; the pcie detector already let it be. A discrete
    GPU whose link is down keeps its maximum width and still fails the check."""
    write_pci_device(tmp_path, "0000:00:02.0", cls="0x030000", width=0, max_width=0, speed="Unknown",
                     max_speed="Unknown")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.SKIP and "no watched PCIe links" in r.detail, r  # it has no link to judge
    write_pci_device(tmp_path, GPU)
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.PASS and r.detail == "1 link(s) at full width", r
    write_pci_device(tmp_path, GPU, width=0, speed="Unknown")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and r.detail == f"{GPU} link is down (width 0)", r


def test_pcie_a_device_fallen_off_the_bus_fails_and_a_corrupt_width_is_named(tmp_path) -> None:
    """A GPU that fell off the bus stays listed, its config space reading all ones: width x63, speed Unknown. The
    check read x63 as at or above its x16 maximum and passed the node, which the pcie detector flags at once. A
    device in D3cold on purpose reads the same and is left alone, and a corrupt width (1e19) is a read error
    naming the file, as the detector reads it, not a maximum that made a healthy link "narrow"."""
    write_pci_device(tmp_path, GPU, width=63, speed="Unknown")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and f"{GPU} does not answer config reads" in r.detail, r
    (tmp_path / "sys/bus/pci/devices" / GPU / "power_state").write_text("D3cold\n")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.SKIP, r
    write_pci_device(tmp_path, GPU, max_width=16)
    (tmp_path / "sys/bus/pci/devices" / GPU / "max_link_width").write_text(f"{10**19}\n")
    _, r = one(ctx_for(tmp_path, ["pcie"]))
    assert r.status is CheckStatus.FAIL and "max_link_width" in r.detail and "outside the 6-bit field" in r.detail, r
