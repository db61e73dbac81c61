"""RoCE detector: real link events from a veth pair in a namespace; counters on fake sysfs trees."""

from __future__ import annotations

import errno
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from trainguard.detectors.base import DetectorState
from trainguard.detectors.ethtool import parse_ethtool_s
from trainguard.detectors.netlink import LinkInfo, link_from_message, open_iproute
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.roce import RoceConfig, RoceDetector
from trainguard.detectors.runner import DetectorRunner
from trainguard.testing.sysfs import write_file, write_rdma_port


def next_event(q: "queue.Queue[HealthEvent]", kind: str, subject: str, timeout: float = 5.0) -> HealthEvent:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if ev.kind == kind and ev.subject == subject:
            return ev
    raise AssertionError(f"no {kind} for {subject} within {timeout} s")


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, timeout=10)


@pytest.mark.netns
def test_link_down_up_and_flapping_on_a_real_veth_pair(veth_netns, tmp_path) -> None:
    ns, a, b = veth_netns
    cfg = RoceConfig(root=str(tmp_path), netns=ns, interfaces=("tgv*",), flap_threshold=3, flap_window_s=60,
                     down_grace_s=3600, ethtool=False, interval_s=0.2)
    det = RoceDetector(cfg)
    q: queue.Queue[HealthEvent] = queue.Queue()
    with DetectorRunner([det], on_event=q.put) as runner:
        assert det.wait_ready(30.0), "the netlink listener did not start"
        t0 = time.time()
        ip(ns, "link", "set", a, "down")
        down = next_event(q, "net.link_down", a)
        latency = down.time - t0
        assert latency < 5.0
        assert down.severity == Severity.ERROR and down.action == Action.CHECKPOINT_NOW
        assert "administratively down" in down.message
        peer = next_event(q, "net.link_down", b)
        assert "no carrier" in peer.message and peer.evidence["carrier"] == "0"
        deadline = time.monotonic() + 10
        while runner.latest_metrics().get("roce.links_down") != 2.0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the next polled sample reflects the listener's table
        assert runner.latest_metrics()["roce.links_down"] == 2.0
        assert runner.statuses()[0].state == DetectorState.FAILED
        ip(ns, "link", "set", a, "up")
        up = next_event(q, "net.link_up", a)
        assert up.severity == Severity.INFO
        for _ in range(2):
            ip(ns, "link", "set", a, "down")
            ip(ns, "link", "set", a, "up")
        flap = next_event(q, "net.link_flapping", a)
        assert flap.severity == Severity.CRITICAL and flap.action == Action.DRAIN_NODE
        assert flap.evidence["downs_in_window"] == "3"
    print(f"link down -> event latency: {latency * 1000:.1f} ms")


@pytest.mark.netns
def test_persistent_down_and_one_shot_dump_without_listener(veth_netns, tmp_path) -> None:
    ns, a, _ = veth_netns
    ip(ns, "link", "set", a, "down")
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=0.0, ethtool=False))
    s = det.sample()  # no listener running: the detector dumps the link table once
    assert s.metrics[f"link_up[{a}]"] == 0.0 and s.state == DetectorState.FAILED
    assert [e.kind for e in s.events] == ["net.link_down_persistent"]


@pytest.mark.netns
def test_a_renamed_link_leaves_no_ghost_that_reads_down_forever(veth_netns, tmp_path) -> None:
    """``ip link set X down; ip link set X name Y; ip link set Y up`` (a rename needs the link down): the table
    was keyed by name, so X stayed in it as down forever and the next sample reported
    net.link_down_persistent (CRITICAL, drain the node) for an interface that no longer exists."""
    ns, a, b = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=("tgv*",), down_grace_s=0.0,
                                  ethtool=False))
    q: queue.Queue[HealthEvent] = queue.Queue()
    listener = threading.Thread(target=det.listen, args=(q.put,), daemon=True)
    listener.start()
    try:
        assert det.wait_ready(30.0), "the netlink listener did not start"
        ip(ns, "link", "set", a, "down")
        ip(ns, "link", "set", a, "name", "tgvr")
        ip(ns, "link", "set", "tgvr", "up")
        next_event(q, "net.link_up", "tgvr")
        deadline = time.monotonic() + 10
        while not all(i.up for i in det.links().values()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the peer's carrier comes back in a message of its own
        s = det.sample()
    finally:
        det.stop_listening()
        listener.join(10)
    assert sorted(det.links()) == sorted([b, "tgvr"])
    assert [e.kind for e in s.events] == [] and s.metrics["links_down"] == 0.0
    assert s.state != DetectorState.FAILED and f"link_up[{a}]" not in s.metrics


@pytest.mark.netns
def test_first_samples_beside_the_listener_raise_no_import_deadlock_error(veth_netns) -> None:
    """At agent start the sampler's one-shot link dump and the listener imported pyroute2 at once from two
    threads, and Python's import deadlock detection ("deadlock detected by _ModuleLock('pyroute2.netlink.rtnl')")
    turned into a detector.error in most starts. Needs a fresh interpreter each time (pyroute2 not yet imported);
    the race is not certain in one start, so a few are tried."""
    ns, _, _ = veth_netns
    code = f"""
import tempfile
from trainguard.detectors.roce import RoceConfig, RoceDetector
from trainguard.detectors.runner import DetectorRunner
root = tempfile.mkdtemp()
dets = [RoceDetector(RoceConfig(root=root, netns={ns!r}, interfaces=("tgv*",), ethtool=False)) for _ in range(3)]
events = []
runners = [DetectorRunner([d], on_event=events.append) for d in dets]
for r in runners:
    r.start()
for d in dets:
    assert d.wait_ready(30)
for r in runners:
    r.stop()
print([e.message for e in events if e.kind == "detector.error"])
"""
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.netns
def test_lost_link_notifications_resync_the_table_and_report_the_change(veth_netns, tmp_path) -> None:
    """A burst of link messages (other veths churning, as a Kubernetes node's pod veths do) while the listener is
    busy overflows its socket: the kernel drops messages and the next read fails with ENOBUFS. That ended the
    listener, so the watched link's change that was dropped in the burst was never reported; now the table is
    resynchronised from a dump and the change reported."""
    ns, a, _ = veth_netns
    n = 60
    subprocess.run(["ip", "-n", ns, "-batch", "-"], check=True, timeout=60, text=True,
                   input="".join(f"link add tgn{i} type veth peer name tgp{i}\n" for i in range(n)))
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), ethtool=False))
    q: queue.Queue[HealthEvent] = queue.Queue()
    release = threading.Event()

    def busy_emit(ev: HealthEvent) -> None:
        q.put(ev)
        release.wait(30)  # the listener is held while the burst fills its socket

    failure: list[BaseException] = []

    def listen() -> None:
        try:
            det.listen(busy_emit)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failure.append(exc)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        assert det.wait_ready(30.0), "the netlink listener did not start"
        ip(ns, "link", "set", a, "down")
        next_event(q, "net.link_down", a)
        churn = "".join(f"link set tgn{i} up\nlink set tgp{i} up\nlink set tgn{i} down\n" for i in range(n))
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input=churn * 3, text=True, check=True, timeout=60)
        ip(ns, "link", "set", a, "up")  # lost with the burst's tail
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input=churn * 3, text=True, check=True, timeout=60)
        release.set()
        up = next_event(q, "net.link_up", a, timeout=20.0)
        assert up.evidence["admin_up"] == "1"
        assert det.links()[a].up and not failure, failure
    finally:
        release.set()
        det.stop_listening()
        listener.join(10)


@pytest.mark.netns
def test_without_a_listener_every_sample_reads_the_link_table_again(veth_netns, tmp_path) -> None:
    """``trainguard detect --window`` (no listener): only the first sample dumped the link table, so a link that
    went down after it still read up in every later sample."""
    ns, a, _ = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=0.0, ethtool=False))
    s = det.sample()
    assert s.metrics[f"link_up[{a}]"] == 1.0 and s.events == []
    ip(ns, "link", "set", a, "down")
    s = det.sample()
    assert s.metrics[f"link_up[{a}]"] == 0.0 and s.state == DetectorState.FAILED
    assert sorted(e.kind for e in s.events) == ["net.link_down", "net.link_down_persistent"]
    ip(ns, "link", "set", a, "up")
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["net.link_down_persistent.cleared", "net.link_up"]


@pytest.mark.netns
def test_bounces_between_two_link_readings_count_as_flaps(veth_netns, tmp_path) -> None:
    """The kernel coalesces carrier changes (link-watch), and ``trainguard detect`` reads the link table 1 s
    apart: a link whose peer bounced 5 times in a few ms was up at both readings, so no down was counted and no
    net.link_flapping raised (seen with the listener too: 10 bounces in 21 ms came as one down and one up).
    The kernel's carrier-loss counter now counts them."""
    ns, a, b = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), flap_threshold=3,
                                  down_grace_s=3600, ethtool=False))
    assert det.sample().events == []

    def downs() -> tuple[int, bool]:
        ipr = open_iproute(ns)
        try:
            info = link_from_message(ipr.get_links(ifname=a)[0])
        finally:
            ipr.close()
        assert info is not None and info.carrier_down_count is not None
        return info.carrier_down_count, info.up

    before, _ = downs()
    subprocess.run(["ip", "-n", ns, "-batch", "-"], check=True, timeout=30, text=True,
                   input=f"link set {b} down\nlink set {b} up\n" * 5)
    deadline = time.monotonic() + 10
    while downs() != (before + 5, True) and time.monotonic() < deadline:
        time.sleep(0.02)  # the carrier comes back through the kernel's link-watch work
    s = det.sample()
    kinds = [e.kind for e in s.events]
    assert kinds == ["net.link_down", "net.link_up", "net.link_flapping"], kinds
    assert s.events[0].evidence["downs_since_last"] == "5"
    assert s.metrics[f"link_downs_in_window[{a}]"] == 5.0 and s.metrics[f"link_up[{a}]"] == 1.0


@pytest.mark.netns
def test_a_link_that_went_down_before_the_listener_started_is_reported(veth_netns, tmp_path) -> None:
    """The runner samples and starts the listener at once (and restarts a listener that failed, 5 s later); the
    listener's initial dump was recorded silently, so a link seen up by a sample and down in that dump had no
    net.link_down at all (only net.link_down_persistent, down_grace_s later)."""
    ns, a, _ = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=3600, ethtool=False))
    assert det.sample().metrics[f"link_up[{a}]"] == 1.0
    ip(ns, "link", "set", a, "down")
    q: queue.Queue[HealthEvent] = queue.Queue()
    listener = threading.Thread(target=det.listen, args=(q.put,), daemon=True)
    listener.start()
    try:
        assert det.wait_ready(30.0), "the netlink listener did not start"
        down = next_event(q, "net.link_down", a)
    finally:
        det.stop_listening()
        listener.join(10)
    assert "administratively down" in down.message


@pytest.mark.netns
def test_a_link_gone_while_no_notification_was_read_is_down(veth_netns, tmp_path) -> None:
    """A watched link deleted or moved to another namespace between two dumps (``trainguard detect --window``,
    before a listener's start, in a burst that overflowed its socket) is simply absent from the next dump: it
    stayed in the table as up for good. It is down (removed) now, and up again once it is back."""
    ns, a, _ = veth_netns
    other = f"{ns}-away"
    subprocess.run(["ip", "netns", "add", other], check=True, timeout=10)
    try:
        det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=3600,
                                      ethtool=False))
        assert det.sample().metrics[f"link_up[{a}]"] == 1.0
        ip(ns, "link", "set", a, "netns", other)
        s = det.sample()
        assert [(e.kind, e.subject) for e in s.events] == [("net.link_down", a)]
        assert "removed" in s.events[0].message and s.metrics[f"link_up[{a}]"] == 0.0
        assert s.state == DetectorState.FAILED
        # Gone before a listener starts: its initial dump says so too.
        det2 = RoceDetector(RoceConfig(root=str(tmp_path), netns=other, interfaces=(a,), down_grace_s=3600,
                                       ethtool=False))
        ip(other, "link", "set", a, "up")  # a link moved to another namespace arrives down
        assert det2.sample().metrics[f"link_up[{a}]"] == 1.0
        ip(other, "link", "set", a, "netns", ns)
        q: queue.Queue[HealthEvent] = queue.Queue()
        listener = threading.Thread(target=det2.listen, args=(q.put,), daemon=True)
        listener.start()
        try:
            assert det2.wait_ready(30.0), "the netlink listener did not start"
            next_event(q, "net.link_down", a)
        finally:
            det2.stop_listening()
            listener.join(10)
        ip(ns, "link", "set", a, "up")
        s = det.sample()
        assert ("net.link_up", a) in [(e.kind, e.subject) for e in s.events] and s.metrics[f"link_up[{a}]"] == 1.0
    finally:
        subprocess.run(["ip", "netns", "del", other], timeout=10)


def test_carrier_downs_are_counted_from_carrier_changes_on_kernels_without_a_down_count() -> None:
    """Before Linux 4.19 only IFLA_CARRIER_CHANGES (every transition) is reported: from carrier on, the odd
    transitions are downs; from carrier off, the even ones."""
    up = LinkInfo("eth0", 2, True, True, "UP", 10)
    down = LinkInfo("eth0", 2, True, False, "DOWN", 11)
    assert LinkInfo("eth0", 2, True, True, "UP", 16).carrier_downs_since(up) == 3
    assert LinkInfo("eth0", 2, True, False, "DOWN", 15).carrier_downs_since(up) == 3
    assert LinkInfo("eth0", 2, True, True, "UP", 14).carrier_downs_since(down) == 1
    assert LinkInfo("eth0", 3, True, True, "UP", 16).carrier_downs_since(up) == 0  # another link, same name
    assert LinkInfo("eth0", 2, True, True, "UP", 0).carrier_downs_since(up) == 0


@pytest.mark.netns
def test_an_rdma_netdev_that_appears_after_the_start_is_watched(veth_netns, tmp_path) -> None:
    """No interfaces configured and no RDMA device yet at the start (the driver loads late): the listener
    returned at once for good, and the sampler's one-shot dump stood as the link table, so the NIC going down
    later still read up."""
    ns, a, _ = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, down_grace_s=0.0, ethtool=False))
    q: queue.Queue[HealthEvent] = queue.Queue()
    listener = threading.Thread(target=det.listen, args=(q.put,), daemon=True)
    listener.start()
    try:
        assert det.wait_ready(30.0), "the listener gave up with no RDMA device yet"
        write_rdma_port(tmp_path, netdev=a)
        assert det.sample().metrics[f"link_up[{a}]"] == 1.0
        ip(ns, "link", "set", a, "down")
        next_event(q, "net.link_down", a)
        s = det.sample()
    finally:
        det.stop_listening()
        listener.join(10)
    assert s.metrics[f"link_up[{a}]"] == 0.0
    assert [(e.kind, e.subject) for e in s.events] == [("net.link_down_persistent", a)]


@pytest.mark.netns
def test_ethtool_ioctl_reads_real_driver_statistics(veth_netns) -> None:
    ns, a, _ = veth_netns
    code = ("from trainguard.detectors.ethtool import ethtool_stats; import json; "
            f"print(json.dumps(ethtool_stats({a!r})))")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    import json
    stats = json.loads(out)
    assert "peer_ifindex" in stats and stats["peer_ifindex"] > 0  # veth's own statistic, from the kernel


@pytest.mark.netns
def test_ethtool_read_while_the_queue_count_changes_never_returns_blank_statistics(veth_netns) -> None:
    """veth (like mlx5) exports per-queue statistics; a channel change (``ethtool -L``) between the ioctl's three
    calls made the kernel answer another count (0 on recent kernels, nothing written): blank names and every
    value 0, taken by the counter tracker as a reset and then as one huge increase (a false PFC storm)."""
    ns, _, _ = veth_netns
    ip(ns, "link", "add", "tgq0", "numtxqueues", "16", "numrxqueues", "16", "type", "veth", "peer", "name", "tgq1",
       "numtxqueues", "16", "numrxqueues", "16")
    code = """
import ctypes, fcntl, json, socket, struct, threading
from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.ethtool import ethtool_stats

def set_channels(n):  # ETHTOOL_SCHANNELS: struct ethtool_channels, rx_count and tx_count
    buf = ctypes.create_string_buffer(struct.pack("=9I", 0x3D, 0, 0, 0, 0, n, n, 0, 0))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sP", b"tgq0", ctypes.addressof(buf))
        fcntl.ioctl(s.fileno(), 0x8946, ifreq + b"\\0" * (40 - len(ifreq)))

stop = threading.Event()
def flip():
    while not stop.is_set():
        set_channels(16)
        set_channels(1)
t = threading.Thread(target=flip)
t.start()
bad, good, retried = 0, 0, 0
try:
    for _ in range(300):
        try:
            stats = ethtool_stats("tgq0")
        except DetectorReadError:
            retried += 1
            continue
        if "peer_ifindex" in stats and "" not in stats:
            good += 1
        else:
            bad += 1
finally:
    stop.set()
    t.join()
print(json.dumps({"bad": bad, "good": good, "retried": retried}))
"""
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    import json
    counts = json.loads(out)
    assert counts["bad"] == 0 and counts["good"] > 0, counts


def test_rdma_counters_on_a_fake_tree(tmp_path) -> None:
    write_rdma_port(tmp_path)
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    det._listening = True  # the link table comes from the listener; this test is about counters only
    assert det.rdma_netdevs() == ["ens1f0np0"]
    s = det.sample()
    assert s.events == [] and s.metrics["port_active[mlx5_0/1]"] == 1.0
    time.sleep(0.05)
    write_rdma_port(tmp_path, link_downed=1, symbol=1000, oos=10**6, rx_crc=500)
    s = det.sample()
    kinds = sorted(e.kind for e in s.events)
    assert kinds == ["net.crc_errors", "roce.link_downed", "roce.out_of_sequence", "roce.symbol_errors"]
    downed = next(e for e in s.events if e.kind == "roce.link_downed")
    assert downed.subject == "mlx5_0/1" and downed.evidence["delta"] == "1"
    assert s.metrics["out_of_sequence_per_s[mlx5_0/1]"] > 100
    assert s.state == DetectorState.FAILED
    # No further increase: every condition clears.
    s = det.sample()
    assert sorted(e.kind for e in s.events) == [k + ".cleared" for k in kinds]


def test_a_64_bit_counter_jumping_to_near_2_64_is_a_misread_not_an_error_storm(tmp_path) -> None:
    """hw_counters and netdev statistics are 64-bit: no width to saturate at. One reading of 0 then near 2**64
    (a misread) was 1e18 errors a second: roce.out_of_sequence and a FAILED detector. More than any port can
    count in the time is now a read error naming the file; no rule fires, and the value is the new baseline:
    steady there reads nothing, back to a small value reads as a reset, and a real rise is judged again."""
    write_rdma_port(tmp_path, netdev=None, oos=10)
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    det.sample()
    write_rdma_port(tmp_path, netdev=None, oos=2**64 - 5)
    s = det.sample()
    assert s.events == [] and s.state == DetectorState.ERROR
    (err,) = s.errors
    assert err.path.endswith("hw_counters/out_of_sequence") and "misread" in err.reason
    assert s.metrics["out_of_sequence_per_s[mlx5_0/1]"] == 0.0
    s = det.sample()
    assert (s.events, s.errors, s.state) == ([], [], DetectorState.OK)
    write_rdma_port(tmp_path, netdev=None, oos=0)  # back to a small value: a reset, counted from zero
    assert det.sample().events == []
    time.sleep(0.05)
    write_rdma_port(tmp_path, netdev=None, oos=10**6)
    assert [e.kind for e in det.sample().events] == ["roce.out_of_sequence"]


def test_a_saturated_port_error_counter_is_said_and_does_not_clear_its_condition(tmp_path) -> None:
    """IB PortCounters error counters stop at all ones (symbol_error is 16 bits, link_downed 8). A cable
    throwing symbol errors saturates symbol_error within hours; its rate then read 0 and roce.symbol_errors
    cleared while the cable kept failing, and a link_downed stuck at 255 hid every later down without a word.
    Now a counter at its maximum is said (info), and a rate condition it raised holds until the reset."""
    write_rdma_port(tmp_path, netdev=None, symbol=100, link_downed=255)
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    s = det.sample()
    assert [(e.kind, e.evidence["counter"]) for e in s.events] == [("roce.counter_saturated", "link_downed")]
    assert "stopped at its maximum 255" in s.events[0].message and s.state == DetectorState.OK
    time.sleep(0.05)
    write_rdma_port(tmp_path, netdev=None, symbol=65535, link_downed=255)
    s = det.sample()
    assert sorted((e.kind, e.evidence["counter"]) for e in s.events) == [
        ("roce.counter_saturated", "symbol_error"), ("roce.symbol_errors", "symbol_error")]
    for _ in range(2):  # stuck at 65535: no rate can be read, the cable is not known to be better
        s = det.sample()
        assert s.events == [] and s.state == DetectorState.DEGRADED
    write_rdma_port(tmp_path, netdev=None, symbol=0, link_downed=0)  # perfquery -R
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["roce.counter_saturated.cleared", "roce.counter_saturated.cleared",
                                                "roce.symbol_errors.cleared"]


def test_rdma_counters_a_device_does_not_provide_are_no_read_errors(tmp_path) -> None:
    """An RDMA device without a performance management agent (irdma on Intel E810 RoCE NICs, rxe, efa) prints
    "N/A (no PMA)" in every ports/<n>/counters file: each was a read error, the detector in ERROR for good and
    trainguard detect exiting 1 on every such node. Its hw_counters are still read."""
    write_rdma_port(tmp_path, device="irdma0", netdev=None)
    base = "sys/class/infiniband/irdma0/ports/1/counters"
    for name in os.listdir(tmp_path / base):
        write_file(tmp_path, f"{base}/{name}", "N/A (no PMA)\n")
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    s = det.sample()
    assert (s.errors, s.events, s.state) == ([], [], DetectorState.OK)
    time.sleep(0.05)
    write_rdma_port(tmp_path, device="irdma0", netdev=None, oos=10**6)
    for name in os.listdir(tmp_path / base):
        write_file(tmp_path, f"{base}/{name}", "N/A (no PMA)\n")
    assert [e.kind for e in det.sample().events] == ["roce.out_of_sequence"]
    write_file(tmp_path, f"{base}/link_downed", "12 packets\n")
    assert "expected one integer" in det.sample().errors[0].reason  # anything else is still malformed


def test_port_not_active_and_malformed_files(tmp_path) -> None:
    write_rdma_port(tmp_path, state="1: DOWN")
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    det._listening = True
    s = det.sample()
    assert [e.kind for e in s.events] == ["roce.port_down"] and "DOWN" in s.events[0].message
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    (port / "state").write_text("ACTIVE\n")
    (port / "counters" / "symbol_error").write_text("12abc\n")
    (port / "hw_counters" / "out_of_sequence").write_text("")
    events: list[HealthEvent] = []
    runner = DetectorRunner([det], on_event=events.append)
    runner.run_once()
    errors = [e for e in events if e.kind == "detector.error"]
    assert len(errors) == 3, [e.message for e in errors]
    assert {os.path.basename(e.subject) for e in errors} == {"state", "symbol_error", "out_of_sequence"}
    assert runner.statuses()[0].state == DetectorState.ERROR


MLX5_ETHTOOL = """NIC statistics:
     rx_packets: 1234567
     tx_packets: 7654321
     rx_prio3_pause: {rx3}
     tx_prio3_pause: 0
     rx_prio3_pause_duration: 1000
     rx_pause_ctrl_phy: 0
     tx_pause_storm_error_events: {storm}
"""


def test_pfc_pause_storm_from_ethtool_statistics(tmp_path) -> None:
    write_rdma_port(tmp_path)
    values = {"rx3": 0, "storm": 0}

    def fake_ethtool_s(ifname: str) -> dict[str, int]:
        assert ifname == "ens1f0np0"
        return parse_ethtool_s(MLX5_ETHTOOL.format(**values))

    det = RoceDetector(RoceConfig(root=str(tmp_path)), ethtool=fake_ethtool_s)
    det._listening = True
    det.sample()
    time.sleep(0.05)
    values.update(rx3=10**6, storm=1)
    s = det.sample()
    assert sorted(e.kind for e in s.events) == ["roce.pfc_pause_rx", "roce.pfc_storm"]
    assert s.metrics["rx_prio3_pause_per_s[ens1f0np0]"] > 10000


def test_a_port_that_disappears_is_down_until_it_is_back(tmp_path) -> None:
    """An RDMA device removed from sysfs (mlx5 health recovery, unbind, fallen off the bus) vanished from the
    detector without an event; with every device gone it even read as "no hardware"."""
    write_rdma_port(tmp_path, device="mlx5_0", netdev=None)
    write_rdma_port(tmp_path, device="mlx5_1", netdev=None)
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    assert det.sample().events == []
    ib = tmp_path / "sys/class/infiniband"
    shutil.rmtree(ib / "mlx5_1")
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("roce.port_down", "mlx5_1/1")]
    assert "gone" in s.events[0].message and s.metrics["port_active[mlx5_1/1]"] == 0.0
    assert s.state == DetectorState.FAILED
    shutil.rmtree(ib)
    s = det.sample()
    assert [(e.kind, e.subject) for e in s.events] == [("roce.port_down", "mlx5_0/1")]
    assert s.state == DetectorState.FAILED
    write_rdma_port(tmp_path, device="mlx5_0", netdev=None)
    write_rdma_port(tmp_path, device="mlx5_1", netdev=None)
    s = det.sample()
    assert sorted((e.kind, e.subject) for e in s.events) == [("roce.port_down.cleared", "mlx5_0/1"),
                                                              ("roce.port_down.cleared", "mlx5_1/1")]


def test_an_rdma_device_renamed_is_the_same_port_not_a_lost_one(tmp_path) -> None:
    """udev's RDMA naming policy renames mlx5_0 to rocep59s0f0 (at boot, and again after the driver reloads): the
    old name read as a port gone from sysfs for good, roce.port_down and a FAILED detector for a name that no
    longer exists. The same PCI function's port under the new name is the same port; a device really gone still
    counts."""
    ib = tmp_path / "sys/class/infiniband"
    for dev, pci in (("mlx5_0", "0000:3b:00.0"), ("mlx5_1", "0000:5e:00.0")):
        write_rdma_port(tmp_path, device=dev, netdev=None)
        (tmp_path / "sys/devices/pci0000:00" / pci).mkdir(parents=True)
        (ib / dev / "device").symlink_to(f"../../../devices/pci0000:00/{pci}")
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    assert det.sample().events == []
    os.rename(ib / "mlx5_0", ib / "rocep59s0f0")
    s = det.sample()
    assert (s.events, s.state) == ([], DetectorState.OK)
    assert s.metrics["port_active[rocep59s0f0/1]"] == 1.0 and "port_active[mlx5_0/1]" not in s.metrics
    shutil.rmtree(ib / "mlx5_1")  # gone for real: still a port down
    assert [(e.kind, e.subject) for e in det.sample().events] == [("roce.port_down", "mlx5_1/1")]


def test_parse_ethtool_s_rejects_garbage() -> None:
    with pytest.raises(DetectorReadError, match="NIC statistics"):
        parse_ethtool_s("no such device")
    with pytest.raises(DetectorReadError, match="line 2"):
        parse_ethtool_s("NIC statistics:\n     rx_packets: lots\n")


def test_no_rdma_and_no_interfaces_is_no_hardware(tmp_path) -> None:
    s = RoceDetector(RoceConfig(root=str(tmp_path))).sample()
    assert s.state == DetectorState.NO_HARDWARE and "infiniband" in s.detail


def test_a_folder_that_cannot_be_listed_loses_no_other_ports_event(tmp_path) -> None:
    """One port's counters folder cannot be listed (EACCES under a container's LSM, EIO from a wedged device; a
    symlink loop here, since root reads past permissions): recorded as that folder's read error, while the other
    port's DOWN is still reported. It used to raise out of sample(), dropping the event after its condition had
    latched, so it was never reported at all."""
    write_rdma_port(tmp_path, device="mlx5_0", netdev=None)
    write_rdma_port(tmp_path, device="mlx5_1", netdev=None)
    hw = tmp_path / "sys/class/infiniband/mlx5_1/ports/1/hw_counters"
    for f in hw.iterdir():
        f.unlink()
    hw.rmdir()
    hw.symlink_to("hw_counters")  # ELOOP on listing
    events: list[HealthEvent] = []
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    runner = DetectorRunner([det], on_event=events.append)
    runner.run_once()
    write_rdma_port(tmp_path, device="mlx5_0", state="1: DOWN", netdev=None)
    runner.run_once()
    assert [e.subject for e in events if e.kind == "roce.port_down"] == ["mlx5_0/1"]
    errors = [e for e in events if e.kind == "detector.error"]
    assert [e.subject for e in errors] == [str(hw)]
    assert "cannot list (Too many levels of symbolic links)" in errors[0].message
    assert "DetectorReadError" not in errors[0].message and "OSError" not in errors[0].message


def test_interfaces_patterns_that_match_nothing_are_said_until_an_interface_matches(tmp_path) -> None:
    """A typo in ``interfaces`` (``ens1f*`` on a host whose NICs are ``enp*``) left no link watched while the
    detector read healthy, without a word; now a warning until a matching interface appears (udev renaming the
    NIC after the start)."""
    import socket

    if any(name.startswith("ens1f") for _, name in socket.if_nameindex()):
        pytest.skip("this host has an ens1f* interface: the pattern matches")
    for name in ("enp1s0f0", "enp1s0f1"):
        write_file(tmp_path, f"sys/class/net/{name}/statistics/rx_crc_errors", "0\n")
    det = RoceDetector(RoceConfig(root=str(tmp_path), interfaces=("ens1f*",), rdma=False, ethtool=False))
    first, second = det.sample(), det.sample()
    assert [(e.kind, e.severity) for e in first.events] == [("roce.interfaces_unmatched", Severity.WARNING)]
    assert second.events == []  # said once, held while it lasts
    for s in (first, second):
        assert s.state == DetectorState.DEGRADED
        assert s.detail.startswith("interfaces pattern(s) ens1f* match no network interface, so no link is watched; "
                                   "present: "), s.detail
        assert "enp1s0f0, enp1s0f1" in s.detail
    (tmp_path / "sys/class/net/enp1s0f0").rename(tmp_path / "sys/class/net/ens1f0np0")
    s = det.sample()
    assert [e.kind for e in s.events] == ["roce.interfaces_unmatched.cleared"]
    assert s.state == DetectorState.OK and "rx_crc_errors_per_s[ens1f0np0]" in s.metrics, s.metrics


@pytest.mark.netns
def test_a_namespace_deleted_or_recreated_while_watched_is_not_read_as_healthy(veth_netns, tmp_path) -> None:
    """The listener's socket keeps its namespace alive after ``ip netns del``: the detector read that namespace's
    links (up) for good, OK while nothing of that name existed, and still OK once a namespace of the same name
    came back with its link down (a restarted container's). Now a deleted namespace is a read error naming it
    (no drain), and the links of the one re-created under the name are read."""
    ns, a, b = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=3600, ethtool=False,
                                  interval_s=0.1))
    q: queue.Queue[HealthEvent] = queue.Queue()
    with DetectorRunner([det], on_event=q.put) as runner:
        assert det.wait_ready(30.0), "the netlink listener did not start"
        subprocess.run(["ip", "netns", "del", ns], check=True, timeout=10)
        deadline = time.monotonic() + 5
        while runner.statuses()[0].state != DetectorState.ERROR and time.monotonic() < deadline:
            time.sleep(0.02)
        status = runner.statuses()[0]
        assert status.state == DetectorState.ERROR and f"no network namespace {ns!r}" in status.detail, status
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
        ip(ns, "link", "add", a, "type", "veth", "peer", "name", b)  # created down
        down = next_event(q, "net.link_down", a)
        assert down.action == Action.CHECKPOINT_NOW
        next_event(q, "detector.error.cleared", "")
    drains = [e for e in list(q.queue) if e.action == Action.DRAIN_NODE]
    assert drains == []


@pytest.mark.netns
def test_ethtool_reads_an_interface_whose_name_is_no_utf8(veth_netns) -> None:
    """An interface name is bytes to the kernel; one that is no UTF-8 (b'tg\\xffx') is listed by os.listdir with a
    surrogate, and the ioctl's str.encode() raised UnicodeEncodeError out of every RoCE sample that watched it."""
    ns, _, _ = veth_netns
    subprocess.run(["ip", "-n", ns, "link", "add", b"tg\xffx", "type", "veth", "peer", "name", "tgpeer"], check=True,
                   timeout=10)
    code = ("import json, os; from trainguard.detectors.ethtool import ethtool_stats; "
            "name = next(n for n in os.listdir('/sys/class/net') if n.startswith('tg') and not n.isascii()); "
            "print(json.dumps(ethtool_stats(name)))")
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    assert json.loads(done.stdout)["peer_ifindex"] > 0  # veth's own statistic, from the kernel


@pytest.mark.netns
def test_a_link_whose_name_is_no_utf8_does_not_blind_the_link_table(veth_netns, tmp_path) -> None:
    """pyroute2 hands over a link name that is no UTF-8 as bytes; matching it against the interface patterns
    raised TypeError, so one such link beside the watched ones failed every dump and the listener for good: no
    watched link's state was read any more. It is named as /sys/class/net lists it now."""
    ns, a, _ = veth_netns
    subprocess.run(["ip", "-n", ns, "link", "add", b"tg\xffx", "type", "veth", "peer", "name", "tgpeer"], check=True,
                   timeout=10)
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=("tg*",), down_grace_s=3600,
                                  ethtool=False))
    s = det.sample()
    assert s.errors == [], s.errors
    assert s.metrics[f"link_up[{a}]"] == 1.0 and s.metrics["link_up[tg\udcffx]"] == 0.0
    ip(ns, "link", "set", a, "down")
    assert ("net.link_down", a) in [(e.kind, e.subject) for e in det.sample().events]


@pytest.mark.netns
def test_a_watched_link_whose_name_is_no_utf8_reaches_the_wire(veth_netns, tmp_path) -> None:
    """Its name holds a lone surrogate (os.fsdecode), which no protobuf string can carry: the link-down event
    about it and the detector's status (a metric per link) raised UnicodeEncodeError in to_proto, so the agent's
    report of that very event failed. The surrogate is escaped now, the rest of the name kept."""
    ns, _, _ = veth_netns
    bad = b"tg\xffx"
    subprocess.run(["ip", "-n", ns, "link", "add", bad, "type", "veth", "peer", "name", "tgpeer"], check=True,
                   timeout=10)
    subprocess.run(["ip", "-n", ns, "link", "set", bad, "up"], check=True, timeout=10)
    subprocess.run(["ip", "-n", ns, "link", "set", "tgpeer", "up"], check=True, timeout=10)
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=("tg*",), down_grace_s=3600,
                                  ethtool=False))
    runner = DetectorRunner([det])
    runner.run_once()
    subprocess.run(["ip", "-n", ns, "link", "set", bad, "down"], check=True, timeout=10)
    events = runner.run_once()
    down = [e for e in events
            if e.kind == "net.link_down" and e.subject.startswith("tg") and e.subject != "tgpeer"]
    assert down and down[0].to_proto().subject == "tg\\udcffx"
    status = next(s for s in runner.statuses() if s.name == det.name).to_proto()
    assert status.metrics["link_up[tg\\udcffx]"] == 0.0


def test_a_nic_removed_while_its_files_are_read_is_gone_not_unreadable(tmp_path, monkeypatch) -> None:
    """A RoCE NIC hot-unplugged (or unbound by mlx5 health recovery) between the listing of sysfs and the reading
    of its files: the read of an open attribute fails with ENODEV, later opens with ENOENT. Each file was a
    detector.error (the detector in ERROR) and the port's loss was said one sample later. The port is down in
    that sample now, its netdev statistics are skipped (its link says it is gone), and nothing is a read error."""
    write_rdma_port(tmp_path, device="mlx5_0", netdev="ens1f0np0")
    write_rdma_port(tmp_path, device="mlx5_1", netdev="ens2f0np0")
    det = RoceDetector(RoceConfig(root=str(tmp_path)), ethtool=lambda ifname: {})
    det._listening = True  # the link table is not what this is about: no dump of this machine's links
    assert det.sample().events == []
    real_read = os.read

    def kernel_read(fd: int, n: int) -> bytes:
        path = os.readlink(f"/proc/self/fd/{fd}")
        for name, folder in (("/ens2f0np0/statistics/rx_crc_errors", tmp_path / "sys/class/net/ens2f0np0"),
                             ("/mlx5_1/ports/1/counters/symbol_error", tmp_path / "sys/class/infiniband/mlx5_1")):
            if path.endswith(name):
                # the device goes while this file is open: kernfs answers the read with ENODEV
                shutil.rmtree(folder)
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", kernel_read)
    s = det.sample()
    assert s.errors == [], [str(e) for e in s.errors]
    assert [(e.kind, e.subject) for e in s.events] == [("roce.port_down", "mlx5_1/1")]
    assert s.state == DetectorState.FAILED
    assert det.sample().events == []  # still gone: said once


def _wait_status(runner: DetectorRunner, ok: "Callable[[Any], bool]", timeout: float = 5.0) -> Any:
    """The runner's first detector status once ``ok`` holds for it; fails naming the last one seen."""
    deadline = time.monotonic() + timeout
    status = runner.statuses()[0]
    while not ok(status) and time.monotonic() < deadline:
        time.sleep(0.02)
        status = runner.statuses()[0]
    assert ok(status), status
    return status


@pytest.mark.netns
def test_links_of_a_deleted_namespace_read_unknown_until_it_is_back(veth_netns, tmp_path) -> None:
    """While the watched namespace is gone (the detector in ERROR naming it), its links' ``link_up`` kept the
    values from before: a dashboard showed the link up. They are left out until the namespace is back, and
    come back with the links read there."""
    ns, a, b = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=3600, ethtool=False,
                                  interval_s=0.1))
    with DetectorRunner([det]) as runner:
        assert det.wait_ready(30.0), "the netlink listener did not start"
        _wait_status(runner, lambda st: st.metrics.get(f"link_up[{a}]") == 1.0)
        subprocess.run(["ip", "netns", "del", ns], check=True, timeout=10)
        # Two samples in ERROR: the first stops the listener, later ones find no namespace to dump either.
        first = _wait_status(runner, lambda st: st.state == DetectorState.ERROR)
        status = _wait_status(runner, lambda st: st.state == DetectorState.ERROR and st.samples > first.samples)
        assert f"no network namespace {ns!r}" in status.detail, status
        for st in (first, status):
            assert not any(k.startswith(("link_up[", "link_downs_in_window[")) for k in st.metrics), st.metrics
            assert "links_down" not in st.metrics and st.metrics["links_unknown"] == 1.0, st.metrics
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
        ip(ns, "link", "add", a, "type", "veth", "peer", "name", b)
        ip(ns, "link", "set", a, "up")
        ip(ns, "link", "set", b, "up")
        back = _wait_status(runner, lambda st: st.state == DetectorState.OK and st.metrics.get(f"link_up[{a}]") == 1.0)
        assert back.metrics["links_down"] == 0.0 and back.metrics["links_unknown"] == 0.0, back.metrics


def test_a_nic_made_anew_between_two_samples_counts_its_errors_from_zero(tmp_path) -> None:
    """A driver reload or mlx5 health recovery removes the RDMA device and its netdev and makes them anew
    within seconds, between two samples, with counters from zero. A port with 3 link downs before and 3 new
    ones after read 3 and 3: nothing; a netdev's CRC errors likewise. Their folders are new ones (kernfs
    numbers them anew): their counts are new errors."""
    write_rdma_port(tmp_path, netdev="ens1f0np0", link_downed=3, rx_crc=50)
    det = RoceDetector(RoceConfig(root=str(tmp_path), ethtool=False))
    det.sample()
    assert det.sample().events == []  # the same folders: nothing new
    dev = tmp_path / "sys/class/infiniband/mlx5_0"
    net = tmp_path / "sys/class/net/ens1f0np0"
    dev.rename(dev.with_name("mlx5_0.old"))  # still there while the new one is made: other inodes
    net.rename(net.with_name("ens1f0np0.old"))
    write_rdma_port(tmp_path, netdev="ens1f0np0", link_downed=3, rx_crc=50)
    shutil.rmtree(dev.with_name("mlx5_0.old"))
    shutil.rmtree(net.with_name("ens1f0np0.old"))
    s = det.sample()
    downed = [e for e in s.events if e.kind == "roce.link_downed"]
    assert downed and int(downed[0].evidence["delta"]) == 3, s.events
    crc = [e for e in s.events if e.kind == "net.crc_errors"]
    assert crc and int(crc[0].evidence["delta"]) == 50, s.events
    assert [e.kind for e in det.sample().events if not e.kind.endswith(".cleared")] == []


@pytest.mark.netns
def test_a_dump_that_fails_after_the_listeners_succeeded_leaves_the_table_known(veth_netns, tmp_path,
                                                                                 monkeypatch) -> None:
    """A sample's dump that fails (the namespace was still gone when it looked) after the restarted listener's
    initial dump succeeded (re-created meanwhile) must not mark the fresh table unknown: the listener does not
    dump again, so the links read unknown for good while it ran fine. The interleaving is made with real
    netlink: the listener's dump in the real namespace, then the error of a namespace that does not exist."""
    import trainguard.detectors.roce as roce_mod
    from trainguard.detectors.netlink import LinkWatcher

    ns, a, _ = veth_netns
    det = RoceDetector(RoceConfig(root=str(tmp_path), netns=ns, interfaces=(a,), down_grace_s=3600, ethtool=False))
    assert det.sample().metrics[f"link_up[{a}]"] == 1.0
    real_open = roce_mod.open_iproute

    def listener_dump_then_missing_namespace(netns: str = ""):
        LinkWatcher(det._on_link, ns, on_dump=det._on_dump)._dump(initial=True)  # the listener's, complete
        return real_open(f"tgdet-missing-{os.getpid()}-{time.monotonic_ns()}")  # raises: no such namespace

    monkeypatch.setattr(roce_mod, "open_iproute", listener_dump_then_missing_namespace)
    s = det.sample()
    assert s.errors and "no network namespace" in str(s.errors[0]), s.errors
    assert s.metrics[f"link_up[{a}]"] == 1.0 and s.metrics["links_unknown"] == 0.0, s.metrics
