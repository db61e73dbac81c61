"""Fixtures for detector tests: a network namespace with a veth pair, removed even when a test fails."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def veth_netns() -> Iterator[tuple[str, str, str]]:
    """A fresh namespace holding an up veth pair; yields ``(netns, end_a, end_b)``."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    ns = f"tgdet-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        for cmd in (("link", "add", "tgva", "type", "veth", "peer", "name", "tgvb"),
                    ("link", "set", "tgva", "up"), ("link", "set", "tgvb", "up")):
            done = _ip("-n", ns, *cmd)
            if done.returncode != 0:
                pytest.skip(f"cannot set up a veth pair in a namespace: {done.stderr.strip()}")
        yield ns, "tgva", "tgvb"
    finally:
        _ip("netns", "del", ns)
