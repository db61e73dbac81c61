"""Fixtures for detector tests: a network namespace with a veth pair, removed even when a test fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainguard.testing.netns import NetnsUnavailable, veth_pair


@pytest.fixture
def veth_netns() -> Iterator[tuple[str, str, str]]:
    """A fresh namespace holding an up veth pair; yields ``(netns, end_a, end_b)``."""
    try:
        with veth_pair("tgdet") as made:
            yield made
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
