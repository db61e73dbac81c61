"""A throwaway network namespace holding an up veth pair, for link-state tests on real netlink.

Real veths in a namespace stand in for a NIC: setting one end down drops the other's carrier exactly as a cable
or switch-port failure does, and the RoCE detector sees it over netlink. Names carry a random tag so concurrent
tests never collide; the namespace is removed on exit, even after a failure. Needs root and iproute2.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


class NetnsUnavailable(RuntimeError):
    """Network namespaces or veths cannot be made here (not root, no ``ip``, refused); the message says why."""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    except FileNotFoundError as exc:
        raise NetnsUnavailable("iproute2's `ip` is not installed") from exc


@contextmanager
def veth_pair(prefix: str = "tgtest", a: str = "tgva", b: str = "tgvb") -> Iterator[tuple[str, str, str]]:
    """A fresh namespace ``<prefix>-<tag>`` holding the up veth pair ``a``/``b``; yields ``(netns, a, b)``.

    Raises:
        NetnsUnavailable: not root, or the namespace or the pair cannot be made (tests skip on it).
    """
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        raise NetnsUnavailable(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        for cmd in (("link", "add", a, "type", "veth", "peer", "name", b), ("link", "set", a, "up"),
                    ("link", "set", b, "up")):
            done = _ip("-n", ns, *cmd)
            if done.returncode != 0:
                raise NetnsUnavailable(f"cannot set up a veth pair in a namespace: {done.stderr.strip()}")
        yield ns, a, b
    finally:
        _ip("netns", "del", ns)


__all__ = ["NetnsUnavailable", "veth_pair"]
