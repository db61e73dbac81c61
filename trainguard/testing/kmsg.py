"""A kernel log (``/dev/kmsg``) in a folder, in the kernel's record format, for the kmsg detector.

Each record is one line ``<level>,<sequence>,<timestamp_us>,<flags>;<message>``, continuation lines start with a
space (``Documentation/ABI/testing/dev-kmsg``). The kmsg detector reads ``<root>/dev/kmsg``; these functions
write it.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_kmsg(root: str | os.PathLike, *records: str) -> str:
    """Replaces ``<root>/dev/kmsg`` with ``records`` (one per line); returns ``root`` as a string (the value of a
    detector's ``root``)."""
    dev = Path(root) / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "kmsg").write_text("".join(r + "\n" for r in records))
    return str(root)


def append_kmsg(root: str | os.PathLike, *records: str) -> None:
    """Appends ``records`` to ``<root>/dev/kmsg`` (created when missing), as the kernel logs new lines."""
    dev = Path(root) / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    with open(dev / "kmsg", "a") as f:
        f.write("".join(r + "\n" for r in records))


__all__ = ["append_kmsg", "write_kmsg"]
