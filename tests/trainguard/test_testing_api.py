"""``trainguard.testing`` is a public API: every exported name exists and is documented, and the README example
works as written against the real detectors."""

from __future__ import annotations

import inspect

import trainguard.testing as testing
from trainguard.detectors.kmsg import KmsgConfig, KmsgDetector
from trainguard.detectors.pcie import PcieConfig, PcieDetector
from trainguard.detectors.thermal import ThermalConfig, ThermalDetector

XID79 = "4,1,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python3, GPU has fallen off the bus."


def test_every_public_name_is_documented() -> None:
    for name in testing.__all__:
        obj = getattr(testing, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"trainguard.testing.{name} has no docstring"


def test_readme_example_is_read_by_the_real_detectors(tmp_path) -> None:
    hw = testing.FakeNodeHardware(tmp_path)
    testing.write_kmsg(tmp_path)
    pcie = PcieDetector(PcieConfig(root=str(tmp_path)))
    kmsg = KmsgDetector(KmsgConfig(root=str(tmp_path)))
    thermal = ThermalDetector(ThermalConfig(root=str(tmp_path)))
    try:
        assert not pcie.sample().events and not kmsg.sample().events  # healthy until a fault is written
        hw.narrow_link(4)
        hw.aer_fatal()
        testing.write_thermal_zone(tmp_path, 0, 101000, {"critical": 100000})
        testing.append_kmsg(tmp_path, XID79)
        kinds = {e.kind for d in (pcie, kmsg, thermal) for e in d.sample().events}
    finally:
        for d in (pcie, kmsg, thermal):
            d.close()
    assert {"pcie.link_narrow", "pcie.aer_fatal", "hw.temp_critical", "gpu.xid"} <= kinds, kinds


def test_a_tree_made_under_a_relative_root_or_moved_is_still_read(tmp_path, monkeypatch) -> None:
    """The /sys/bus/pci/devices links were written with their target as given: under a relative root
    (FakeNodeHardware("hw"), as a user's test would write it) every link was broken and the PCIe detector
    saw no device at all ("no watched PCIe device ... reports AER counters or link status")."""
    import shutil

    monkeypatch.chdir(tmp_path)
    testing.FakeNodeHardware("hw").narrow_link(4)
    shutil.copytree(tmp_path / "hw", tmp_path / "moved", symlinks=True)  # links as links, as `cp -a` copies
    for root in (tmp_path / "hw", tmp_path / "moved"):
        pcie = PcieDetector(PcieConfig(root=str(root)))
        try:
            sample = pcie.sample()
        finally:
            pcie.close()
        assert sample.metrics.get("links_watched") == 1.0, (root, sample)
        assert {e.kind for e in sample.events} == {"pcie.link_narrow"}
