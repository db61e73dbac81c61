"""Link checks: accelerator and NIC PCIe links at full width and speed, NICs at their speed, RDMA ports active.

Files read (under the configured root, in the kernel's formats, as :mod:`trainguard.detectors.pcie` and
:mod:`trainguard.detectors.roce` read them):

- ``/sys/bus/pci/devices/<bdf>/{class,current_link_width,max_link_width,current_link_speed,max_link_speed}``:
  a link trained below its maximum width (a failing riser or connector: the node runs, at a fraction of its
  bandwidth) fails; so does a speed below the maximum for the classes that never lower it to save power. The
  maximum is what both ends support (the port above caps it: a Gen5 x16 NIC in a Gen4 x8 slot is healthy at
  16 GT/s x8); SR-IOV virtual functions (``physfn``) have no link of their own and are not judged;
- ``/sys/class/net/<if>/speed`` (Mb/s; reading it fails with EINVAL while the link is down, ``-1`` is unknown),
  ``operstate`` and ``carrier`` (a veth whose peer is down keeps reporting its speed: the state decides);
- ``/sys/class/infiniband/<dev>/ports/<n>/state`` (``4: ACTIVE``) and ``rate`` (``200 Gb/sec (4X HDR)``).

The detector watches the same links over time and warns; here the same fact refuses the node before it takes a
slot, because one slow link slows every collective of the job (Guard's node sweep, MLSys 2026).
"""

from __future__ import annotations

import fnmatch
import os
import re

from trainguard.agent.qualify.base import Outcome, QualifyContext, failed, passed, register_check, skipped
from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.pcie import (NLW_ALL_ONES, in_d3cold, is_virtual_function, parse_link_speed, port_above,
                                      port_limits, read_link_width)
from trainguard.detectors.sysfs import list_dir, read_int, read_text

# ASCII only, as the detectors' patterns: ``\d`` took other scripts' digits ('٤: ACTIVE' read as an active port,
# '٢٠٠ Gb/sec' as 200 Gb/sec through float()), and ``\w`` other scripts' letters as the state.
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?) Gb/sec", re.ASCII)
_PORT_STATE = re.compile(r"^[0-9]+:\s*(\w+)", re.ASCII)


@register_check("pcie")
class PcieLinkCheck:
    """Every watched PCIe link at its maximum width (and speed, for the speed classes)."""

    name = "pcie"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Reads each watched device's link files once."""
        cfg = ctx.config
        base = ctx.under(ctx.sys_root, "/sys/bus/pci/devices")
        bad: list[str] = []
        watched = 0
        for bdf in list_dir(base):
            dev = os.path.join(base, bdf)
            if not os.path.exists(os.path.join(dev, "max_link_width")) or is_virtual_function(dev):
                continue  # no link, or an SR-IOV VF's (width 0 always: its PF's link is the one judged)
            try:
                cls = read_text(os.path.join(dev, "class"))
            except DetectorReadError:
                cls = ""
            if cfg.pcie_devices:
                if not any(fnmatch.fnmatchcase(bdf, p) for p in cfg.pcie_devices):
                    continue
            elif not cls.startswith(tuple(cfg.pcie_classes)):
                continue
            try:
                # The pcie detector's reading: a corrupt width (1e19, -5) is a read error, not a maximum that made
                # every healthy link "narrow"
                max_width = read_link_width(os.path.join(dev, "max_link_width"))
            except DetectorReadError as exc:
                watched += 1
                bad.append(f"{bdf}: {exc}")
                continue
            if max_width == 0:
                # No link of its own, as the pcie detector judges it: a root complex integrated endpoint (an
                # integrated GPU at 00:02.0, class 0x0300) has the link files, but its link registers are not
                # implemented and read zero (width 0 of 0, speed Unknown). It read as a link down and refused the
                # node. A discrete link that is down keeps its maximum (the capability register).
                continue
            watched += 1
            try:
                width = read_link_width(os.path.join(dev, "current_link_width"))
                sp, msp = os.path.join(dev, "current_link_speed"), os.path.join(dev, "max_link_speed")
                speed, max_speed = parse_link_speed(read_text(sp), sp), parse_link_speed(read_text(msp), msp)
            except DetectorReadError as exc:
                bad.append(f"{bdf}: {exc}")
                continue
            # as the detector judges it: a link trains at most to what its slot supports
            port_width, port_speed = port_limits(port_above(dev))
            if port_width > 0:
                max_width = min(max_width, port_width)
            if port_speed is not None and max_speed is not None:
                max_speed = min(max_speed, port_speed)
            if width == NLW_ALL_ONES and in_d3cold(dev):
                watched -= 1  # powered off on purpose (runtime PM): no link to judge until it is used
                continue
            if width == NLW_ALL_ONES:
                # All ones: a GPU or NIC that fell off the bus read x63, at or above any maximum, and passed.
                bad.append(f"{bdf} does not answer config reads (its link width reads x{width}, all ones): it fell "
                           "off the bus")
            elif width == 0:
                bad.append(f"{bdf} link is down (width 0)")
            elif width < max_width:
                bad.append(f"{bdf} link trained at x{width}, below its x{max_width}")
            elif cls.startswith(tuple(cfg.pcie_speed_classes)) and max_speed is not None \
                    and (speed is None or speed < max_speed):
                bad.append(f"{bdf} link at {speed if speed is not None else 'unknown'} GT/s, below its "
                           f"{max_speed:g} GT/s")
        if bad:
            return failed("; ".join(bad))
        if not watched:
            return skipped(f"no watched PCIe links under {base}")
        return passed(f"{watched} link(s) at full width")


@register_check("nic")
class NicSpeedCheck:
    """Each configured interface up, at the expected speed."""

    name = "nic"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Reads ``speed`` and ``operstate`` of the interfaces matching ``qualify.nics``."""
        cfg = ctx.config
        if not cfg.nics:
            return skipped("no interfaces configured (qualify.nics)")
        base = ctx.under(cfg.net_root, "/sys/class/net")
        present = list_dir(base)
        names = [n for n in present if any(fnmatch.fnmatchcase(n, p) for p in cfg.nics)]
        if not names:
            return failed(f"no interface matches {cfg.nics} under {base} (found: {', '.join(present) or 'none'})")
        bad: list[str] = []
        speeds: list[str] = []
        for name in names:
            dev = os.path.join(base, name)
            try:
                state = read_text(os.path.join(dev, "operstate"))
            except DetectorReadError:
                state = "unknown"
            try:
                carrier = read_int(os.path.join(dev, "carrier"))
            except DetectorReadError:
                carrier = 0  # unreadable (EINVAL) while the interface is administratively down
            if state != "up" and carrier != 1:
                bad.append(f"{name} is not up (operstate {state}, carrier {carrier})")
                continue
            try:
                speed = read_int(os.path.join(dev, "speed"))
            except DetectorReadError:
                bad.append(f"{name} has no speed (link down? operstate {state})")
                continue
            if cfg.nic_speed_mbps and speed <= 0:
                bad.append(f"{name} speed unknown ({speed}; operstate {state}), expected {cfg.nic_speed_mbps} Mb/s")
            elif cfg.nic_speed_mbps and speed < cfg.nic_speed_mbps:
                bad.append(f"{name} at {speed} Mb/s, expected {cfg.nic_speed_mbps} Mb/s")
            else:  # virtual NICs (virtio) report -1: with no expected speed, a link that is up is enough
                speeds.append(f"{name} {speed if speed > 0 else 'unknown'} Mb/s")
        if bad:
            return failed("; ".join(bad))
        return passed(", ".join(speeds))


@register_check("rdma")
class RdmaPortCheck:
    """Every RDMA port ACTIVE, at the expected rate."""

    name = "rdma"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Reads ``state`` and ``rate`` of each port under ``/sys/class/infiniband``."""
        base = ctx.under(ctx.sys_root, "/sys/class/infiniband")
        devices = list_dir(base)
        if not devices:
            return skipped(f"no RDMA devices under {base}")
        want = ctx.config.rdma_rate_gbps
        bad: list[str] = []
        ports = 0
        for dev in devices:
            for port in list_dir(os.path.join(base, dev, "ports")):
                pdir = os.path.join(base, dev, "ports", port)
                ports += 1
                try:
                    state_text = read_text(os.path.join(pdir, "state"))
                    rate_path = os.path.join(pdir, "rate")
                    rate_text = read_text(rate_path)
                except DetectorReadError as exc:
                    bad.append(f"{dev}/{port}: {exc}")
                    continue
                m = _PORT_STATE.match(state_text)
                state = m.group(1) if m else state_text[:20]
                if state != "ACTIVE":
                    bad.append(f"{dev}/{port} is {state}")
                    continue
                r = _RATE.match(rate_text)
                if r is None:
                    bad.append(f"{dev}/{port}: rate {rate_text[:40]!r} is not '<n> Gb/sec'")
                elif want and float(r.group(1)) < want:
                    bad.append(f"{dev}/{port} at {rate_text}, expected {want:g} Gb/sec")
        if bad:
            return failed("; ".join(bad))
        if not ports:
            return skipped(f"no RDMA ports under {base}")
        return passed(f"{ports} port(s) active")


__all__ = ["NicSpeedCheck", "PcieLinkCheck", "RdmaPortCheck"]
