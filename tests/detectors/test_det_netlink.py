"""Opening rtnetlink sockets inside a named network namespace (detectors/netlink.py)."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from trainguard.detectors.netlink import LinkWatcher, link_from_message, open_iproute


@pytest.mark.netns
def test_a_namespace_socket_is_opened_without_forking(veth_netns, monkeypatch) -> None:
    """pyroute2's ``IPRoute(netns=...)`` forks a child to enter the namespace. Forking the agent (torch, gRPC and
    sampler threads) can leave the child stuck on a lock another thread held; under CI load the child missed
    pyroute2's 2 s deadline for ten seconds and the RoCE link listener never started. A thread enters the
    namespace instead, so nothing may fork here."""
    ns, a, b = veth_netns

    def no_fork() -> int:
        raise AssertionError("opening a namespace socket forked the process")

    monkeypatch.setattr(os, "fork", no_fork)
    ipr = open_iproute(ns)
    try:
        names = {info.ifname for info in map(link_from_message, ipr.get_links()) if info is not None}
    finally:
        ipr.close()
    assert {a, b} <= names
    # the socket is in the namespace, and the calling thread is still in its own one
    assert a not in os.listdir("/sys/class/net")

    seen: list[str] = []
    watcher = LinkWatcher(lambda info, initial: seen.append(info.ifname), ns)
    t = threading.Thread(target=watcher.run, daemon=True)
    t.start()
    try:
        assert watcher.ready.wait(10.0)
        assert a in seen
    finally:
        watcher.stop()
        t.join(10.0)
    assert not t.is_alive()


def test_a_missing_namespace_is_named_and_not_created() -> None:
    """pyroute2 opened namespaces with ``O_CREAT``: a typo in ``roce.netns`` created an empty namespace and the
    detector watched nothing in it, silently."""
    name = f"tgmissing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(FileNotFoundError, match=name):
        open_iproute(name)
    assert not os.path.exists(f"/run/netns/{name}")
