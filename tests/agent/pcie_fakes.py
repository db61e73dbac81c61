"""A fake PCIe GPU in a sysfs tree for the agent tests whose PCIe detector reads a fake root (the real file
formats are written by :func:`trainguard.drill.fakehw.write_pci_device`)."""

from __future__ import annotations

from pathlib import Path

from trainguard.drill.fakehw import GPU, write_pci_device

__all__ = ["GPU", "make_gpu"]


def make_gpu(root: Path, fatal: dict[str, int] | None = None, nonfatal: dict[str, int] | None = None,
             width: int = 16) -> Path:
    """(Re)writes the GPU ``GPU`` directly below the root complex under ``root``."""
    return write_pci_device(root, GPU, fatal=fatal, nonfatal=nonfatal, width=width)
