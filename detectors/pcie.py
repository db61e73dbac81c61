"""PCIe bus detector: AER error counters and degraded links, from sysfs.

Per device under ``/sys/bus/pci/devices/<domain:bus:dev.fn>/`` (Documentation/ABI/testing/
sysfs-bus-pci-devices-aer_stats):

- ``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal``: one ``<name> <count>`` per line, ending with
  ``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` / ``TOTAL_ERR_FATAL``. Correctable errors are reported when their
  rate exceeds ``correctable_per_s``; any increase of non-fatal or fatal errors is reported at once, naming the
  error bits that rose. Errors may show at the link partner (root port, switch port), so by default the AER
  counters of the watched devices *and of every port above them* (read from the sysfs device path
  ``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/...``) are read; ``aer_scope = "all"`` reads every device.
- ``current_link_width`` vs ``max_link_width`` and ``current_link_speed`` vs ``max_link_speed``
  (``"16.0 GT/s PCIe"``): a link trained below its maximum width is reported for the watched classes; speed is
  compared only for classes that do not lower their speed to save power when idle (GPUs do). A link's maximum is
  what both of its ends support: a device's own maximum above that of the port it is plugged into (a Gen5 NIC in
  a Gen4 slot, an x16 card in an x8 slot) is the slot's limit, as the kernel's own bandwidth report says
  ("limited by ... at <port>"), not a degraded link.
- a device's ``class`` (``0x%06x``) decides whether its link is watched; one that is garbled or unreadable is a
  read error naming the file, and the class is taken from ``modalias`` (``...bcXXscXXiXX``) instead.
- a watched device that disappears from the bus is reported as lost; one still listed whose link status reads
  all ones (width x63, speed ``Unknown``: config reads of a device that fell off the bus return 0xffff, as
  ``lspci`` shows "Width x63") does not answer and is reported as its link down.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from trainguard.detectors.base import Detector, DetectorConfig, DetectorState, Sample, register_detector
from trainguard.detectors.counters import CounterTracker
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.sysfs import list_dir, read_counter_table, read_int, read_text, removed_while_read

#: The Negotiated Link Width field of a link status register read as all ones (0xffff >> 4 & 0x3f): PCIe links
#: are at most x32, so this is a device that no longer answers config reads, not a width.
NLW_ALL_ONES = 0x3F
# ASCII digits of a plausible length (2.5 ... 64.0 GT/s): '\d+' took 400 nines, read as an infinite maximum speed
_SPEED = re.compile(r"^([0-9]{1,4}(?:\.[0-9]{1,4})?) GT/s")
_AER_FILES = (("aer_dev_correctable", "TOTAL_ERR_COR"), ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
              ("aer_dev_fatal", "TOTAL_ERR_FATAL"))


def is_virtual_function(dev_dir: str) -> bool:
    """Whether a PCI function is an SR-IOV virtual function (a ``physfn`` link to its PF): it has no link of its
    own (its link status reads width 0), its PF's is the one to judge."""
    return os.path.islink(os.path.join(dev_dir, "physfn"))


def port_above(dev_dir: str) -> str:
    """The sysfs folder of the port a device is plugged into ("" when its parent is no PCI port with a link)."""
    parent = os.path.dirname(os.path.realpath(dev_dir))
    if _BDF.match(os.path.basename(parent)) and os.path.exists(os.path.join(parent, "max_link_width")):
        return parent
    return ""


def read_link_width(path: str) -> int:
    """Reads ``current_link_width`` or ``max_link_width``: the 6-bit width field of the link registers.

    The kernel prints the field (``%u``), 0 to 63; a negative or larger value is a corrupt file. Read as a width,
    -5 and 1e19 were published as the link's width, and a maximum of 1e19 made a healthy x16 link "narrow".

    Raises:
        DetectorReadError: unreadable, not an integer, or outside 0-63.
    """
    value = read_int(path)
    if not 0 <= value <= NLW_ALL_ONES:
        raise DetectorReadError(path, f"width {value} is outside the 6-bit field the kernel prints (0-63)")
    return value


def in_d3cold(dev: str) -> bool:
    """Whether the device's ``power_state`` (Linux 5.13+) reads ``D3cold`` (False when it cannot be read)."""
    try:
        return read_text(os.path.join(dev, "power_state")) == "D3cold"
    except DetectorReadError:
        return False


def port_limits(port_dir: str) -> tuple[int, float | None]:
    """The maximum width and speed of the port a device is plugged into (0 and None: not known): a link trains
    at most to what both ends support (a Gen5 x16 NIC in a Gen4 x8 slot runs at 16 GT/s x8, healthy).

    Only the limit of the link is wanted; a port whose files cannot be read leaves the device's own maximum.
    """
    if not port_dir:
        return 0, None
    try:
        path = os.path.join(port_dir, "max_link_speed")
        return read_link_width(os.path.join(port_dir, "max_link_width")), parse_link_speed(read_text(path), path)
    except DetectorReadError:
        return 0, None


#: ``class`` as the kernel prints it (``0x%06x``): base class, subclass, programming interface.
_CLASS = re.compile(r"^0x[0-9a-f]{6}$")
#: ``modalias`` (``pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X``): the same class code, built from the same field.
_MODALIAS_CLASS = re.compile(r"^pci:v[0-9A-F]{8}d[0-9A-F]{8}sv[0-9A-F]{8}sd[0-9A-F]{8}"
                             r"bc([0-9A-F]{2})sc([0-9A-F]{2})i([0-9A-F]{2})$")


def read_class(dev_dir: str) -> tuple[str, DetectorReadError | None]:
    """A PCI function's class code (``"0x020000"``), ``""`` when it has no ``class`` file.

    A ``class`` that is not what the kernel prints (cut, garbled) or cannot be read is a read error naming the
    file; the class is then taken from ``modalias`` (``...bc02sc00i00``, printed from the same ``pdev->class``)
    so the device is still judged, ``""`` when that cannot tell either. Taken as it was, a garbled class matched
    no watched class: the device silently dropped out of the link checks.

    Returns:
        ``(class, error)``: the error is None when ``class`` was read as it should be.

    Raises:
        DetectorReadError: the device was removed while read (see :func:`removed_while_read`).
    """
    path = os.path.join(dev_dir, "class")
    if not os.path.exists(path):
        return "", None
    try:
        text = read_text(path)
        if _CLASS.match(text):
            return text, None
        error = DetectorReadError(path, f"expected the class code as the kernel prints it (0x and 6 hex digits), "
                                        f"found {text[:40]!r}")
    except DetectorReadError as exc:
        if removed_while_read(exc, dev_dir):
            raise
        error = exc
    try:
        m = _MODALIAS_CLASS.match(read_text(os.path.join(dev_dir, "modalias")))
    except DetectorReadError:
        m = None  # evidence for the class only: the class file's own error is the one reported
    return ("0x" + "".join(m.groups()).lower() if m else ""), error


def parse_link_speed(text: str, path: str) -> float | None:
    """Parses ``current_link_speed`` / ``max_link_speed``.

    Args:
        text: e.g. ``"16.0 GT/s PCIe"``, ``"8 GT/s"`` or ``"Unknown"`` (link down).
        path: the file, for errors.

    Returns:
        GT/s, or None when the kernel reports the speed as unknown.

    Raises:
        DetectorReadError: neither a speed nor ``Unknown``.
    """
    m = _SPEED.match(text)
    if m:
        return float(m.group(1))
    if text.lower().startswith("unknown"):
        return None
    raise DetectorReadError(path, f"expected '<n> GT/s', found {text[:40]!r}")


# The domain has 4 hex digits or more: Intel VMD puts the NVMe drives behind it in domains from 10000 up
# ("10000:e0:1d.0"), and with exactly 4 the ports above them were no ancestors: their AER errors went unread.
_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


@dataclass(frozen=True)
class _DeviceInfo:
    """What does not change while a device stays on the bus: read once."""

    cls: str
    has_aer: bool
    has_link: bool
    ancestors: tuple[str, ...]


@dataclass
class PcieConfig(DetectorConfig):
    """Settings of the PCIe detector.

    Attributes:
        interval_s: seconds between samples. Default 10.0.
        devices: glob patterns of PCI addresses whose link is checked; empty means every device of
            ``link_classes``.
        link_classes: PCI class prefixes whose links are checked (``0x0302`` 3D controller, ``0x0300`` VGA,
            ``0x0200`` Ethernet, ``0x0207`` InfiniBand, ``0x1200`` processing accelerator, ``0x0108`` NVMe).
        speed_classes: class prefixes whose link speed (not only width) must stay at its maximum; GPUs lower
            their speed when idle, so they are not listed by default.
        correctable_per_s: correctable error rate above which a device is reported. Default 1.0 per second.
        aer_scope: ``"paths"``: AER counters of the watched devices and the ports above them; ``"all"``: of every
            AER-capable device (a node has ~200 PCI functions; reading all costs ~10x more). Default ``"paths"``.
    """

    interval_s: float = 10.0
    devices: tuple[str, ...] = ()
    link_classes: tuple[str, ...] = ("0x0302", "0x0300", "0x0200", "0x0207", "0x1200", "0x0108")
    speed_classes: tuple[str, ...] = ("0x0200", "0x0207", "0x1200")
    correctable_per_s: float = 1.0
    aer_scope: str = "paths"

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range.
        """
        super().validate()
        if self.correctable_per_s < 0:
            raise DetectorConfigError(f"pcie.correctable_per_s={self.correctable_per_s} must be >= 0")
        if self.aer_scope not in ("paths", "all"):
            raise DetectorConfigError(f"pcie.aer_scope={self.aer_scope!r} must be 'paths' or 'all'")


@register_detector
class PcieDetector(Detector):
    """Reads AER counters and link status of PCI devices."""

    name: ClassVar[str] = "pcie"
    config_class: ClassVar[type[DetectorConfig]] = PcieConfig
    default_interval_s: ClassVar[float] = 10.0

    def __init__(self, config: PcieConfig | None = None) -> None:
        """Creates the detector.

        Args:
            config: settings.
        """
        super().__init__(config)
        self.config: PcieConfig
        self._counters = CounterTracker()
        self._last: dict[str, dict[str, int]] = {}
        self._seen_links: set[str] = set()
        self._devices: dict[str, _DeviceInfo] = {}
        # Devices listed by this sample but removed before their files were read (hot-unplug): lost now.
        self._removed: set[str] = set()
        # Device -> the inode of its folder when its AER counters were last read (kernfs numbers a new one anew).
        self._inodes: dict[str, int] = {}

    def _renewed(self, base: str, present: list[str]) -> set[str]:
        """Devices whose AER counters were read before and whose folder was made anew since: removed and found
        again (a remove and rescan, a hot-plug) within one interval, so no sample saw them gone. A new pci_dev
        counts its AER errors from zero (pci_aer_init); compared with the old totals, as many new fatal errors as
        the device had before went unreported."""
        renewed = set()
        listed = set(present)
        for bdf in list(self._inodes):
            if bdf not in listed:
                del self._inodes[bdf]
                continue
            try:
                inode = os.stat(os.path.join(base, bdf)).st_ino
            except OSError:
                continue  # gone meanwhile: judged as such below
            if inode != self._inodes[bdf]:
                del self._inodes[bdf]
                renewed.add(bdf)
        return renewed

    def _link_watched(self, bdf: str, cls: str) -> bool:
        if self.config.devices:
            return any(fnmatch.fnmatchcase(bdf, p) for p in self.config.devices)
        return cls.startswith(self.config.link_classes)

    def _info(self, base: str, bdf: str, record: Callable[[DetectorReadError], None]) -> _DeviceInfo:
        """What does not change while ``bdf`` stays on the bus, read once; an unreadable or garbled ``class`` goes
        to ``record`` (and is read again next time).

        Raises:
            DetectorReadError: the device was removed while read.
        """
        info = self._devices.get(bdf)
        if info is None:
            dev = os.path.join(base, bdf)
            cls, cls_error = read_class(dev)
            ancestors = tuple(p for p in os.path.realpath(dev).split(os.sep)[:-1] if _BDF.match(p))
            # An SR-IOV virtual function (it has a physfn link to its PF) has no link of its own: its link status
            # register is reserved and reads zero (lspci: "Width x0 (downgraded)"), which read as a link down
            # (critical, drain-node) for every VF of an RDMA NIC. Its PF's link is the one to watch.
            vf = is_virtual_function(dev)
            info = _DeviceInfo(cls, os.path.exists(os.path.join(dev, "aer_dev_correctable")),
                               os.path.exists(os.path.join(dev, "max_link_width")) and not vf, ancestors)
            if cls_error is not None:
                # Not kept: the class file is read again (and its error reported again) at every sample.
                record(cls_error)
            else:
                self._devices[bdf] = info
        return info

    def sample(self) -> Sample:
        """Reads the watched devices once.

        Returns:
            AER totals and rates, link metrics, and events.
        """
        base = self.config.path("/sys/bus/pci/devices")
        s = Sample()
        totals = {"aer_correctable": 0, "aer_nonfatal": 0, "aer_fatal": 0}
        cor_rate = 0.0
        degraded = 0
        present = list_dir(base)
        for gone in (set(self._devices) - set(present)) | self._renewed(base, present):
            self._devices.pop(gone, None)
            # One that comes back (rescan after a removal, hot-plug) is a new pci_dev whose AER counters start at
            # zero (pci_aer_init): its counts at the first reading after are new errors. Compared with the old
            # totals instead, a fatal error on a device that had as many before it left went unreported.
            for fname, _ in _AER_FILES:
                if f"{gone}/{fname}" in self._last:
                    self._counters.update(f"{gone}/{fname}", 0)
                    self._last[f"{gone}/{fname}"] = {}
        infos: dict[str, _DeviceInfo] = {}
        self._removed = set()
        for bdf in present:
            try:
                infos[bdf] = self._info(base, bdf, s.error)
            except DetectorReadError as exc:
                if not removed_while_read(exc, os.path.join(base, bdf)):
                    s.error(exc)
        links = [b for b, i in infos.items() if i.has_link and self._link_watched(b, i.cls)]
        if self.config.aer_scope == "all":
            aer = [b for b, i in infos.items() if i.has_aer]
        else:
            wanted = {a for b in links for a in (b, *infos[b].ancestors)}
            aer = [b for b in sorted(wanted) if b in infos and infos[b].has_aer]
        for bdf in aer:
            cor_rate += self._sample_aer(s, os.path.join(base, bdf), bdf, totals)
        for bdf in links:
            self._seen_links.add(bdf)
            port = infos[bdf].ancestors[-1] if infos[bdf].ancestors else ""
            port_dir = os.path.join(base, port) if port in infos and infos[port].has_link else ""
            degraded += self._sample_link(s, os.path.join(base, bdf), bdf, infos[bdf].cls, port_dir)
        for bdf in sorted(self._seen_links):
            self.condition(s, f"lost/{bdf}", bdf not in infos or bdf in self._removed, "pcie.device_lost",
                           Severity.CRITICAL, Action.DRAIN_NODE, f"PCI device {bdf} disappeared from the bus", bdf)
        if not aer and not self._seen_links and not s.errors:
            # With read errors it is not "no hardware": a GPU whose class file is garbled (or unreadable) is not
            # known to be a GPU, and reading as none hid its narrowed link and fatal AER behind exit code 0.
            return self.no_hardware(f"no watched PCIe device under {base} reports AER counters or link status")
        s.metrics.update({k + "_total": float(v) for k, v in totals.items()})
        s.metrics.update({"aer_correctable_per_s": cor_rate, "aer_devices": float(len(aer)),
                          "links_watched": float(len(links)), "links_degraded": float(degraded)})
        return s

    def _sample_aer(self, s: Sample, dev: str, bdf: str, totals: dict[str, int]) -> float:
        rate = 0.0
        if bdf not in self._inodes:
            try:
                self._inodes[bdf] = os.stat(dev).st_ino
            except OSError:
                pass  # gone meanwhile: its reads below say so
        for (fname, total_key), metric in zip(_AER_FILES, ("aer_correctable", "aer_nonfatal", "aer_fatal")):
            path = os.path.join(dev, fname)
            try:
                table = read_counter_table(path)
                if total_key not in table:
                    raise DetectorReadError(path, f"no {total_key} line (truncated?)")
            except DetectorReadError as exc:
                if removed_while_read(exc, dev):
                    # Hot-unplugged while read (a GPU or NIC that fell off and was removed): a device lost, not
                    # an unreadable file (a detector.error for each of its files, and the loss one sample later).
                    self._removed.add(bdf)
                    return rate
                s.error(exc)
                continue
            total = table[total_key]
            totals[metric] += total
            s.metrics[f"{metric}[{bdf}]"] = float(total)
            d = self._counters.update(f"{bdf}/{fname}", total)
            prev = self._last.get(f"{bdf}/{fname}", {})
            self._last[f"{bdf}/{fname}"] = table
            rose = {k: v - prev.get(k, 0) for k, v in table.items() if k != total_key and v > prev.get(k, 0)}
            evidence = {"file": fname, total_key: total, "delta": d.delta,
                        "errors": ", ".join(f"{k}+{v}" for k, v in sorted(rose.items()))}
            if metric == "aer_correctable":
                rate += d.rate
                self.condition(s, f"cor/{bdf}", not d.first and d.rate > self.config.correctable_per_s,
                               "pcie.aer_correctable", Severity.WARNING, Action.WATCH,
                               f"PCIe device {bdf}: {d.rate:.2f} correctable errors/s ({evidence['errors']})",
                               bdf, evidence)
            elif not d.first and d.delta > 0:
                fatal = metric == "aer_fatal"
                # one_off: the counter moved past these errors already (see Detector.one_off)
                self.one_off(s, self.event(
                    "pcie.aer_fatal" if fatal else "pcie.aer_nonfatal",
                    Severity.CRITICAL if fatal else Severity.ERROR,
                    Action.DRAIN_NODE if fatal else Action.CHECKPOINT_NOW,
                    f"PCIe device {bdf}: {d.delta} new uncorrectable {'fatal' if fatal else 'non-fatal'} "
                    f"error(s) ({evidence['errors']})", bdf, evidence))
                s.worsen(DetectorState.FAILED if fatal else DetectorState.DEGRADED, f"PCIe errors on {bdf}")
        return rate

    def _sample_link(self, s: Sample, dev: str, bdf: str, cls: str, port_dir: str = "") -> int:
        try:
            width = read_link_width(os.path.join(dev, "current_link_width"))
            max_width = read_link_width(os.path.join(dev, "max_link_width"))
            speed_path = os.path.join(dev, "current_link_speed")
            max_speed_path = os.path.join(dev, "max_link_speed")
            speed = parse_link_speed(read_text(speed_path), speed_path)
            max_speed = parse_link_speed(read_text(max_speed_path), max_speed_path)
        except DetectorReadError as exc:
            if removed_while_read(exc, dev):
                self._removed.add(bdf)  # gone, not unreadable: see _sample_aer
            else:
                s.error(exc)
            return 0
        if max_width == 0:
            # No link of its own: a root complex integrated endpoint (an integrated GPU at 00:02.0, class 0x0300)
            # has the PCIe link attributes in sysfs, but its link registers are not implemented and read zero
            # (width 0 of 0, speed Unknown). It read as a link down, critical with drain-node, on every such node.
            # A link that is down keeps its maximum (the capability); one that fell off the bus reads x63.
            return 0
        port_width, port_speed = port_limits(port_dir)
        if port_width > 0:
            max_width = min(max_width, port_width)
        if port_speed is not None and max_speed is not None:
            max_speed = min(max_speed, port_speed)
        s.metrics[f"link_speed_gts[{bdf}]"] = float(speed or 0.0)
        # A GPU or NIC that fell off the bus stays listed, but its config space reads all ones: width x63 (above
        # its own maximum, so never "narrow") and speed Unknown. It read as a healthy link, no event at all.
        all_ones = width == NLW_ALL_ONES
        # Unless it is powered off on purpose: runtime power management put it in D3cold (then its config space
        # reads all ones too, and its link is off).
        unresponsive = all_ones and not in_d3cold(dev)
        s.metrics[f"link_width[{bdf}]"] = 0.0 if all_ones else float(width)
        narrow = 0 < width < max_width and not all_ones
        slow = (cls.startswith(self.config.speed_classes) and speed is not None and max_speed is not None
                and speed < max_speed and not all_ones)
        evidence = {"class": cls, "width": width, "max_width": max_width, "speed_gts": speed or "unknown",
                    "max_speed_gts": max_speed or "unknown", "unresponsive": int(unresponsive)}
        self.condition(s, f"width/{bdf}", narrow, "pcie.link_narrow", Severity.WARNING, Action.WATCH,
                       f"PCIe link of {bdf} trained at x{width}, below its x{max_width}", bdf, evidence)
        self.condition(s, f"speed/{bdf}", slow, "pcie.link_slow", Severity.WARNING, Action.WATCH,
                       f"PCIe link of {bdf} runs at {speed} GT/s, below its {max_speed} GT/s", bdf, evidence)
        down = width == 0 or unresponsive
        why = ("the device does not answer: its link status reads all ones (x63), as after falling off the bus"
               if unresponsive else "width 0")
        self.condition(s, f"down/{bdf}", down, "pcie.link_down", Severity.CRITICAL, Action.DRAIN_NODE,
                       f"PCIe link of {bdf} is down ({why})", bdf, evidence)
        return int(narrow or slow or down)
