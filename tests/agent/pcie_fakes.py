"""A fake PCIe GPU in a sysfs tree, in the real file formats (drivers/pci/pcie/aer.c, the sysfs ABI), for the
agent tests whose PCIe detector reads a fake root."""

from __future__ import annotations

from pathlib import Path

GPU = "0000:3b:00.0"
UNCOR = ["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
         "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
         "PoisonTLPBlocked"]
COR = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]


def _aer_table(names: list[str], total_key: str, values: dict[str, int]) -> str:
    lines = [f"{n} {values.get(n, 0)}" for n in names]
    return "\n".join(lines + [f"{total_key} {sum(values.values())}"]) + "\n"


def make_gpu(root: Path, fatal: dict[str, int] | None = None, nonfatal: dict[str, int] | None = None,
             width: int = 16) -> Path:
    """(Re)writes a GPU as sysfs shows it under ``root``: its directory /sys/devices/pci0000:00/<bdf>, the
    /sys/bus/pci/devices/<bdf> symlink, and AER counters (``fatal``/``nonfatal``: error name -> count) and link
    width in the kernel's formats."""
    d = root / "sys/devices/pci0000:00" / GPU
    d.mkdir(parents=True, exist_ok=True)
    link = root / "sys/bus/pci/devices" / GPU
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(d)
    (d / "class").write_text("0x030200\n")
    (d / "aer_dev_correctable").write_text(_aer_table(COR, "TOTAL_ERR_COR", {}))
    (d / "aer_dev_nonfatal").write_text(_aer_table(UNCOR, "TOTAL_ERR_NONFATAL", nonfatal or {}))
    (d / "aer_dev_fatal").write_text(_aer_table(UNCOR, "TOTAL_ERR_FATAL", fatal or {}))
    for name, value in (("current_link_width", str(width)), ("max_link_width", "16"),
                        ("current_link_speed", "32.0 GT/s PCIe"), ("max_link_speed", "32.0 GT/s PCIe")):
        (d / name).write_text(value + "\n")
    return d
