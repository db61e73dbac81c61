"""A node's PCIe hardware as sysfs shows it, in a folder, for drills on machines without GPUs.

The PCIe detector reads ``/sys/bus/pci/devices/<bdf>`` (a symlink into ``/sys/devices/pci<dom>:<bus>/...``) for
AER counter tables (``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal``: one ``<name> <count>``
line per error bit, then a ``TOTAL_ERR_*`` line, as ``drivers/pci/pcie/aer.c`` prints them since Linux 5.x) and
link files (``current_link_width`` / ``max_link_width``, ``current_link_speed`` / ``max_link_speed``). This
module lays out one root port with one GPU below it in exactly those formats under a drill-owned root, so the
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


class FakeNodeHardware:
    """One root port and one GPU (x16, 32 GT/s) under ``root``, healthy until a fault is written."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._fatal: dict[str, dict[str, int]] = {ROOT_PORT: {}, GPU: {}}
        self._dev = {
            ROOT_PORT: self._device(ROOT_PORT, "0x060400", ""),
            GPU: self._device(GPU, "0x030200", ROOT_PORT),
        }

    def _device(self, bdf: str, cls: str, above: str) -> Path:
        d = self.root / "sys/devices/pci0000:00" / above / bdf
        d.mkdir(parents=True, exist_ok=True)
        link = self.root / "sys/bus/pci/devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(d)
        _write(d / "class", cls + "\n")
        _write(d / "aer_dev_correctable", _table(_COR, "TOTAL_ERR_COR", {}))
        _write(d / "aer_dev_nonfatal", _table(_UNCOR, "TOTAL_ERR_NONFATAL", {}))
        _write(d / "aer_dev_fatal", _table(_UNCOR, "TOTAL_ERR_FATAL", {}))
        for name, value in (("current_link_width", "16"), ("max_link_width", "16"),
                            ("current_link_speed", "32.0 GT/s PCIe"), ("max_link_speed", "32.0 GT/s PCIe")):
            _write(d / name, value + "\n")
        return d

    def narrow_link(self, width: int = 4) -> None:
        """The GPU's link retrains at ``width`` lanes (of 16): a precursor of the device's loss."""
        _write(self._dev[GPU] / "current_link_width", f"{width}\n")

    def aer_fatal(self, bit: str = "DLP") -> None:
        """The GPU reports one more uncorrectable fatal AER error (``bit``: a name of the kernel's table)."""
        counts = self._fatal[GPU]
        counts[bit] = counts.get(bit, 0) + 1
        _write(self._dev[GPU] / "aer_dev_fatal", _table(_UNCOR, "TOTAL_ERR_FATAL", counts))
