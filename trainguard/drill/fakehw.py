"""A node's PCIe hardware as sysfs shows it, in a folder, for drills on machines without GPUs.

The PCIe detector reads ``/sys/bus/pci/devices/<bdf>`` (a symlink into ``/sys/devices/pci<dom>:<bus>/...``) for
AER counter tables (``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal``: one ``<name> <count>``
line per error bit, then a ``TOTAL_ERR_*`` line, as ``drivers/pci/pcie/aer.c`` prints them since Linux 5.x) and
link files (``current_link_width`` / ``max_link_width``, ``current_link_speed`` / ``max_link_speed``). This
module writes PCI functions in exactly those formats (:func:`write_pci_device`, also used by tests) and lays out
one root port with one GPU below it under a drill-owned root, so the
real detector and the real predictor run unchanged on it (``trainguard run --detector-config`` with
``root = <that folder>``), and the drill writes the faults a real node would show:

- :meth:`FakeNodeHardware.narrow_link`: the GPU's link retrains at a lower width, a classic precursor (a failing
  riser or connector) the predictor's rules tier turns into a drain before the device is lost;
- :meth:`FakeNodeHardware.aer_fatal`: an uncorrectable fatal AER error (the device or its link failed).

Every write goes to a temporary file renamed over the old one, so a detector never reads half a table.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Correctable and uncorrectable AER bit names as Linux >= 5.x prints them.
_COR = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
_UNCOR = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP", "ECRC",
          "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
          "PoisonTLPBlocked")

ROOT_PORT = "0000:00:03.0"
GPU = "0000:3b:00.0"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _table(names: tuple[str, ...], total_key: str, counts: dict[str, int]) -> str:
    lines = [f"{n} {counts.get(n, 0)}" for n in names]
    return "\n".join(lines + [f"{total_key} {sum(counts.values())}"]) + "\n"


def write_pci_device(root: str | os.PathLike, bdf: str, cls: str = "0x030200", above: str = "",
                     cor: dict[str, int] | None = None, nonfatal: dict[str, int] | None = None,
                     fatal: dict[str, int] | None = None, width: int = 16, max_width: int = 16,
                     speed: str = "32.0 GT/s PCIe", max_speed: str = "32.0 GT/s PCIe") -> Path:
    """(Re)writes one PCI function as sysfs shows it under ``root``.

    Args:
        root: the folder standing for ``/``.
        bdf: PCI address (``0000:3b:00.0``).
        cls: PCI class (``0x030200`` 3D controller, ``0x060400`` PCI bridge / root port).
        above: the chain of ports above it (``"0000:00:03.0"``), as directories under ``pci0000:00``.
        cor, nonfatal, fatal: AER error name -> count (kernel names, e.g. ``"DLP"``).
        width, max_width: current and maximum link width (lanes).
        speed, max_speed: current and maximum link speed, as sysfs prints them.

    Returns:
        The device's directory (``/sys/devices/pci0000:00/<above>/<bdf>`` under ``root``).
    """
    d = Path(root) / "sys/devices/pci0000:00" / above / bdf
    d.mkdir(parents=True, exist_ok=True)
    link = Path(root) / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(d)
    _write(d / "class", cls + "\n")
    _write(d / "aer_dev_correctable", _table(_COR, "TOTAL_ERR_COR", cor or {}))
    _write(d / "aer_dev_nonfatal", _table(_UNCOR, "TOTAL_ERR_NONFATAL", nonfatal or {}))
    _write(d / "aer_dev_fatal", _table(_UNCOR, "TOTAL_ERR_FATAL", fatal or {}))
    for name, value in (("current_link_width", str(width)), ("max_link_width", str(max_width)),
                        ("current_link_speed", speed), ("max_link_speed", max_speed)):
        _write(d / name, value + "\n")
    return d


class FakeNodeHardware:
    """One root port and one GPU (x16, 32 GT/s) under ``root``, healthy until a fault is written."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._fatal: dict[str, int] = {}
        write_pci_device(self.root, ROOT_PORT, cls="0x060400")
        self._gpu = write_pci_device(self.root, GPU, above=ROOT_PORT)

    def narrow_link(self, width: int = 4) -> None:
        """The GPU's link retrains at ``width`` lanes (of 16): a precursor of the device's loss."""
        _write(self._gpu / "current_link_width", f"{width}\n")

    def aer_fatal(self, bit: str = "DLP") -> None:
        """The GPU reports one more uncorrectable fatal AER error (``bit``: a name of the kernel's table)."""
        self._fatal[bit] = self._fatal.get(bit, 0) + 1
        _write(self._gpu / "aer_dev_fatal", _table(_UNCOR, "TOTAL_ERR_FATAL", self._fatal))
