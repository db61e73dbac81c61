"""RoCE network detector: link up/down from netlink as it happens, flaps, and NIC/RDMA error counters.

Event-driven part (its own thread, see :mod:`trainguard.detectors.netlink`): each watched link going down yields
``net.link_down`` at once, coming back ``net.link_up``; ``flap_threshold`` downs within ``flap_window_s`` yield
``net.link_flapping`` (cleared when the window empties). Polled part (``sample()``):

- a link down for longer than ``down_grace_s``: ``net.link_down_persistent``;
- ``link_up[<if>]`` per watched link, ``links_watched``, ``links_down``; while the link table cannot be read (the
  watched namespace was deleted: a read error naming it) the links' state is unknown: ``links_unknown`` counts
  them and they have no ``link_up`` until a dump of the namespace works again;
- ``/sys/class/net/<if>/statistics/*`` (errors, drops, CRC);
- ``/sys/class/infiniband/<dev>/ports/<n>/state`` (``4: ACTIVE``) and the ``counters`` / ``hw_counters`` files
  (symbol errors, link downed, out-of-sequence, sequence errors, ACK timeouts, RNR retries, CNPs);
- PFC pause counters from the NIC driver statistics (``ethtool -S``, read by ioctl).

Thresholds are the ``counters.json`` rules. Watched interfaces are ``interfaces`` (glob patterns) or, when empty,
the netdevs of the RDMA devices (``/sys/class/infiniband/<dev>/device/net/*``). Patterns that match no interface at
all are ``roce.interfaces_unmatched`` (a warning; the detector reads degraded until an interface matches).
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from trainguard.detectors.base import (
    DetectorConfig,
    DetectorState,
    ListeningDetector,
    Sample,
    register_detector,
)
from trainguard.detectors.counters import CounterTracker
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.ethtool import ethtool_stats
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.netlink import LinkInfo, LinkWatcher, link_from_message, netns_identity, open_iproute
from trainguard.detectors.rules import CounterRule, check_operator_file, load_counter_rules
from trainguard.detectors.sysfs import (
    list_dir_or_record,
    read_count,
    read_pma_counter,
    read_text,
    removed_while_read,
)

_PORT_STATE = re.compile(r"^([0-9]{1,10}):\s*(\S+)$")  # ASCII digits: ``\d`` takes other scripts' too
#: The port states ib_core prints (``"%d: %s"`` of drivers/infiniband/core/sysfs.c's state_name, "UNKNOWN" for a
#: number outside it). A name that does not go with its number is a corrupt or cut file ('4: AC'): it read as a
#: port not ACTIVE, roce.port_down and a FAILED detector, while the number said ACTIVE.
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
#: Widths in bits of the IB PortCounters error counters a port shows in ``ports/<n>/counters`` (the kernel's
#: ``PORT_PMA_ATTR`` table in drivers/infiniband/core/sysfs.c). The IB spec has them stop at all ones rather than
#: wrap: a counter at its maximum counts nothing more until the port's counters are reset (``perfquery -R``).
_PMA_BITS = {"symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
             "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16, "port_xmit_discards": 16,
             "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8, "local_link_integrity_errors": 4,
             "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16}
#: More than any counter of a port can rise in a second: ten times the bytes per second of an 800 Gb/s port (every
#: error, pause or packet counter rises by at most one per frame). A 64-bit counter has no width to saturate at,
#: so a misread (0, then near 2**64) read as 1e18 errors a second and raised the rule's event; see _apply.
_MAX_COUNTER_RATE = 1e12
#: Interfaces named in the message of patterns that match none (all of them are in its evidence).
_SHOWN_NETDEVS = 8


@dataclass
class RoceConfig(DetectorConfig):
    """Settings of the RoCE detector.

    Attributes:
        interval_s: seconds between counter samples. Default 5.0.
        interfaces: glob patterns of the netdevs to watch; empty means the netdevs of the RDMA devices.
        netns: named network namespace holding the interfaces; empty for the agent's own. Link state is read
            there; netdev statistics come from ``/sys/class/net`` and driver statistics from an ioctl, both of
            the agent's own namespace, so with ``netns`` set only interfaces visible there are counted. Entering
            it takes CAP_SYS_ADMIN (setns), which the shipped systemd unit drops: see its RestrictNamespaces= note.
        flap_window_s: window for flap counting, seconds. Default 60.0.
        flap_threshold: downs within the window that make a link "flapping". Default 3.
        down_grace_s: a link down longer than this, seconds, is reported as persistent. Default 30.0.
        rdma: read RDMA port state and counters. Default True.
        ethtool: read NIC driver statistics (PFC pauses). Default True.
        rules_file: an operator counter-rule file replacing the shipped ``counters.json``; empty for shipped.
    """

    interval_s: float = 5.0
    interfaces: tuple[str, ...] = ()
    netns: str = ""
    flap_window_s: float = 60.0
    flap_threshold: int = 3
    down_grace_s: float = 30.0
    rdma: bool = True
    ethtool: bool = True
    rules_file: str = ""

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range, or the operator's rule file is unreadable or invalid.
        """
        super().validate()
        if self.flap_threshold < 1 or self.flap_window_s <= 0 or self.down_grace_s < 0:
            raise DetectorConfigError("roce: flap_threshold must be >= 1, flap_window_s > 0, down_grace_s >= 0")
        check_operator_file("roce.rules_file", self.rules_file, load_counter_rules)


@register_detector
class RoceDetector(ListeningDetector):
    """Watches RoCE links and counters."""

    name: ClassVar[str] = "roce"
    config_class: ClassVar[type[DetectorConfig]] = RoceConfig
    default_interval_s: ClassVar[float] = 5.0

    def __init__(self, config: RoceConfig | None = None,
                 ethtool: Callable[[str], dict[str, int]] | None = None) -> None:
        """Creates the detector.

        Args:
            config: settings.
            ethtool: reads driver statistics of an interface; the SIOCETHTOOL ioctl when None.

        Raises:
            RuleFileError: the counter rule file is invalid.
        """
        super().__init__(config)
        self.config: RoceConfig
        self._ethtool = ethtool or ethtool_stats
        self._rules: dict[str, list[CounterRule]] = collections.defaultdict(list)
        for rule in load_counter_rules(self.config.rules_file or None):
            self._rules[rule.source].append(rule)
        self._counters = CounterTracker()
        self._lock = threading.RLock()
        self._links: dict[str, LinkInfo] = {}
        # Index -> name of the links not removed: a rename is found by index without a scan of the table (a scan
        # per message made a dump of thousands of links, pod veths, take seconds).
        self._names: dict[int, str] = {}
        self._down_since: dict[str, float] = {}
        self._downs: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._emit: Callable[[HealthEvent], None] | None = None
        self._watcher: LinkWatcher | None = None
        self._stopping = False
        self._listening = False
        # Why the link table is not the links' state now (a dump failed: the watched namespace was deleted, no
        # netlink); empty while it is. Set by a failed dump, cleared by the next complete one (a sample's or the
        # listener's), so a listener starting meanwhile does not vouch for the old table either.
        self._table_unknown = ""
        # Complete dumps so far (the sample's and the listener's): a sample's dump that fails after the listener's
        # succeeded (the namespace re-created meanwhile) must not mark the fresh table unknown for good.
        self._complete_dumps = 0
        # Why sample() stopped the listener (its namespace was deleted or replaced); listen() raises it, so the
        # runner starts it again in the namespace the name now stands for.
        self._namespace_lost = ""
        self._auto: tuple[str, ...] | None = None
        self._ports_seen: set[str] = set()
        # Port subject -> the PCI function behind its RDMA device: a device renamed (udev's rdma naming policy
        # renames mlx5_0 to rocep59s0f0, also when the driver reloads) is the same port under another name.
        self._port_devices: dict[str, str] = {}
        # Port subject or netdev name -> the inode of its sysfs folder when last read: a device removed and made
        # anew between two samples (driver reload, health recovery) has a new folder and counters from zero.
        self._folders: dict[str, int] = {}

    # -- which interfaces -------------------------------------------------------------------------------------

    def rdma_netdevs(self) -> list[str]:
        """Netdevs backing the RDMA devices under the root (RoCE NICs).

        Returns:
            Interface names.
        """
        ib = self.config.path("/sys/class/infiniband")
        names: set[str] = set()
        # Also asked from the netlink thread, where no sample records errors: a folder that cannot be listed is
        # skipped (sample() records an unlistable infiniband folder itself).
        for dev in list_dir_or_record(ib, None):
            names.update(list_dir_or_record(os.path.join(ib, dev, "device", "net"), None))
        return sorted(names)

    def _patterns(self) -> tuple[str, ...]:
        # The RDMA netdevs are listed once per sample, not on every netlink message.
        if self.config.interfaces:
            return self.config.interfaces
        if self._auto is None:
            self._auto = tuple(self.rdma_netdevs())
        return self._auto

    def watched(self, ifname: str) -> bool:
        """Whether ``ifname`` is one of the watched interfaces.

        Args:
            ifname: interface name.

        Returns:
            True when it matches a configured pattern (or is an RDMA netdev when none is configured).
        """
        return any(fnmatch.fnmatchcase(ifname, p) for p in self._patterns())

    # -- event-driven link state ------------------------------------------------------------------------------

    def listen(self, emit: Callable[[HealthEvent], None]) -> None:
        """Blocks delivering link events until :meth:`stop_listening` (returns at once with nothing to watch).

        Args:
            emit: receives each event.
        """
        # With no interfaces configured the watched set is the RDMA devices' netdevs, which can appear after the
        # start (the driver loads late): the listener runs anyway. It used to return, and the one-shot dump of
        # the first sample then stood as the link table for good (a NIC that went down still read up).
        if not self._patterns() and (self.config.interfaces or not self.config.rdma):
            return
        with self._lock:
            if self._stopping:
                return
            self._emit = emit
            self._watcher = LinkWatcher(self._on_link, self.config.netns, on_dump=self._on_dump)
            self._listening = True
        try:
            self._watcher.run()
        finally:
            with self._lock:
                self._listening = False
                lost, self._namespace_lost = self._namespace_lost, ""
        if lost and not self._stopping:
            # Returning would end the runner's listener thread for good; raised, it listens again after a pause.
            raise DetectorReadError(f"rtnetlink {self.config.netns}", lost)

    def stop_listening(self) -> None:
        """Makes :meth:`listen` return."""
        with self._lock:
            self._stopping = True
            watcher = self._watcher
        if watcher is not None:
            watcher.stop()

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits until the listener has its initial link table (tests, benchmarks).

        Args:
            timeout_s: seconds to wait.

        Returns:
            True when ready.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            watcher = self._watcher
            if watcher is not None:
                return watcher.ready.wait(max(0.0, deadline - time.monotonic()))
            time.sleep(0.01)
        return False

    def _on_link(self, info: LinkInfo, initial: bool) -> None:
        events = self._link_events(info, initial)
        emit = self._emit
        if emit is not None:
            for ev in events:
                emit(ev)

    def _on_dump(self, names: set[str], initial: bool) -> None:
        events = self._vanished(names)
        with self._lock:
            self._table_unknown = ""  # a complete dump: the table is the links' state again
            self._complete_dumps += 1
        emit = self._emit
        if emit is not None:
            for ev in events:
                emit(ev)

    def _vanished(self, names: set[str]) -> list[HealthEvent]:
        """Links of the table that a complete dump (``names``) no longer lists were deleted or moved to another
        namespace unseen: between two dumps without a listener, before a listener's start, or in a burst that
        overflowed its socket (a driver reset removing a NIC's netdevs with its VFs). They read up for good;
        now each goes through as removed, so a watched one is down."""
        with self._lock:
            gone = [info for name, info in self._links.items() if name not in names and not info.removed]
        events: list[HealthEvent] = []
        for info in gone:
            events.extend(self._link_events(dataclasses.replace(info, removed=True, time=time.time()), False))
        return events

    def _link_events(self, info: LinkInfo, initial: bool) -> list[HealthEvent]:
        """Records one link message; returns the events of a change of its state (none for a first sight).

        ``initial`` (a listener's first dump) changes nothing: a link known from before is compared all the same.
        """
        events: list[HealthEvent] = []
        now = time.monotonic()
        with self._lock:
            renamed = self._take_renamed(info)
            prev = self._links.get(info.ifname, renamed)
            watched = self.watched(info.ifname)
            if info.removed and not watched:
                self._forget(info.ifname)  # pods' veths come and go: the table keeps no unwatched leftovers
                return []
            # Unwatched links are kept too: with no interfaces configured, a NIC becomes watched when its RDMA
            # device appears (the driver loads after the agent), and its state must be known by then.
            self._links[info.ifname] = info
            if info.removed:
                if self._names.get(info.index) == info.ifname:
                    del self._names[info.index]
            else:
                self._names[info.index] = info.ifname
            if info.up:
                self._down_since.pop(info.ifname, None)
            else:
                self._down_since.setdefault(info.ifname, now)
            if not watched:
                return []
            # Only transitions are events; a link first seen (in the dump, or created later) is just recorded,
            # and one that stays down is reported by sample() after down_grace_s. A listener's initial dump is
            # compared with what was seen before it too (a sample's dump at start, the listener before it failed
            # and was restarted): a link that went down in between was recorded silently, its down never said.
            if prev is None:
                return []
            # The kernel coalesces carrier changes (link-watch): a link that bounced several times between two
            # messages shows only the state it ended in. Its carrier-loss counter says how often it went down;
            # without it, 10 bounces in 20 ms read as one down (or none) and the flapping never showed.
            went_down = prev.up and not info.up
            downs_now = max(info.carrier_downs_since(prev), int(went_down))
            if not downs_now and prev.up == info.up:
                return []
            evidence = {"ifname": info.ifname, "operstate": info.operstate, "carrier": int(info.carrier),
                        "admin_up": int(info.admin_up), "carrier_changes": info.carrier_changes,
                        "removed": int(info.removed)}
            downs = self._downs[info.ifname]
            downs.extend([now] * downs_now)
            self._trim(downs, now)
            if went_down or (prev.up and downs_now):
                if went_down:
                    why = "removed" if info.removed else ("administratively down" if not info.admin_up
                                                          else "no carrier")
                    text = f"link {info.ifname} went down ({why}, operstate {info.operstate})"
                else:
                    text = (f"link {info.ifname} lost its carrier {downs_now} time(s) and got it back between two "
                            f"link notifications")
                if downs_now > 1 and went_down:
                    text += f", after {downs_now - 1} more carrier loss(es) since the last notification"
                events.append(self.event("net.link_down", Severity.ERROR, Action.CHECKPOINT_NOW, text,
                                         info.ifname, {**evidence, "downs_in_window": len(downs),
                                                       "downs_since_last": downs_now}))
            if info.up:
                events.append(self.event("net.link_up", Severity.INFO, Action.NONE,
                                         f"link {info.ifname} is up again", info.ifname, evidence))
            if len(downs) >= self.config.flap_threshold:
                s = Sample()
                self._flap_condition(s, info.ifname, len(downs))
                events.extend(s.events)
        return [HealthEvent(**{**ev.__dict__, "time": info.time or ev.time}) for ev in events]

    def _take_renamed(self, info: LinkInfo) -> LinkInfo | None:
        """Drops the entry of a link that now has another name (same index) and returns it.

        The table is keyed by name; without this a renamed link (``ip link set X name Y``, done while down) left
        its old name behind as down forever: ``net.link_down_persistent`` and a FAILED detector for an interface
        that no longer exists. Its down time and flap history move to the new name, which is the same link.
        """
        name = self._names.get(info.index)
        known = self._links.get(name) if name is not None else None
        if known is None or name == info.ifname or known.removed or known.index != info.index:
            return None
        since = self._down_since.get(name)
        downs = self._downs.get(name)
        self._forget(name)
        if since is not None:
            self._down_since.setdefault(info.ifname, since)
        if downs:
            self._downs[info.ifname].extend(downs)
        return known

    def _forget(self, ifname: str) -> None:
        known = self._links.pop(ifname, None)
        if known is not None and self._names.get(known.index) == ifname:
            del self._names[known.index]
        self._down_since.pop(ifname, None)
        self._downs.pop(ifname, None)

    def _trim(self, downs: collections.deque[float], now: float) -> None:
        while downs and now - downs[0] > self.config.flap_window_s:
            downs.popleft()

    def _flap_condition(self, s: Sample, ifname: str, count: int) -> None:
        self.condition(s, f"flap/{ifname}", count >= self.config.flap_threshold, "net.link_flapping",
                       Severity.CRITICAL, Action.DRAIN_NODE,
                       f"link {ifname} went down {count} times within {self.config.flap_window_s:.0f} s",
                       ifname, {"downs_in_window": count, "threshold": self.config.flap_threshold})

    def _dump_links(self, s: Sample) -> None:
        """The link table from a dump when no listener runs (``trainguard detect``, a listener between retries);
        a change since the previous dump is reported in the sample."""
        ipr = open_iproute(self.config.netns)
        names: set[str] = set()
        try:
            for msg in ipr.get_links():
                info = link_from_message(msg)
                if info is not None:
                    names.add(info.ifname)
                    # one_off: the link table already holds the new state; the change is not seen again
                    for ev in self._link_events(info, False):
                        self.one_off(s, ev)
        finally:
            ipr.close()
        for ev in self._vanished(names):
            self.one_off(s, ev)
        with self._lock:
            self._table_unknown = ""
            self._complete_dumps += 1

    # -- polled part -----------------------------------------------------------------------------------------

    def sample(self) -> Sample:
        """Checks persistent downs, flap windows and every counter once.

        Returns:
            Link and counter metrics, counter-threshold and port-state events.
        """
        s = Sample()
        self._auto = None
        patterns = self._patterns()
        ib_root = self.config.path("/sys/class/infiniband")
        ib_devs = list_dir_or_record(ib_root, s.error) if self.config.rdma else []
        ib_unlistable = bool(s.errors)
        if not patterns and not ib_devs and not s.errors and not self._ports_seen:
            return self.no_hardware("no RDMA devices under /sys/class/infiniband and no interfaces configured")
        replaced = self._leave_replaced_namespace()
        if patterns and (not self._listening or replaced):
            dumps = self._complete_dumps
            try:
                self._dump_links(s)
            except Exception as exc:  # noqa: BLE001 - no netlink (namespace gone...) is a read error, not a crash
                s.error(DetectorReadError(f"rtnetlink {self.config.netns or ''}".strip(), str(exc)))
                with self._lock:
                    if self._complete_dumps == dumps:
                        self._table_unknown = str(exc)
        now = time.monotonic()
        self._sample_links(s, now)
        netdev_root = self.config.path("/sys/class/net")
        # The ioctl sees the agent's own namespace only; an injected reader (tests) works on any tree.
        use_ethtool = self.config.ethtool and (
            self._ethtool is not ethtool_stats or (self.config.root == "/" and not self.config.netns)
        )
        netdevs = list_dir_or_record(netdev_root, s.error)
        self._unmatched_condition(s, netdevs)
        for ifname in sorted(i for i in netdevs if self.watched(i)):
            self._renewed(f"net/{ifname}", os.path.join(netdev_root, ifname), ("netdev", "ethtool"), ifname)
            self._sample_netdev(s, os.path.join(netdev_root, ifname, "statistics"), ifname, now)
            if use_ethtool:
                try:
                    stats = self._ethtool(ifname)
                except DetectorReadError as exc:
                    if not removed_while_read(exc, os.path.join(netdev_root, ifname)):
                        s.error(exc)  # a NIC removed meanwhile is no read error: its link says it is gone
                    stats = {}
                for name, value in sorted(stats.items()):
                    self._apply(s, "ethtool", ifname, name, value, now, f"ethtool -S {ifname}")
        present: set[str] = set()
        unlisted: set[str] = set()
        for dev in ib_devs:
            errors = len(s.errors)
            ports = list_dir_or_record(os.path.join(ib_root, dev, "ports"), s.error)
            if len(s.errors) > errors:
                unlisted.add(dev)
            device = os.path.join(ib_root, dev, "device")
            pci = os.path.realpath(device) if os.path.islink(device) else ""
            for port in ports:
                self._renewed(f"port/{dev}/{port}", os.path.join(ib_root, dev, "ports", port),
                              ("ib_counters", "ib_hw_counters"), f"{dev}/{port}")
                present.add(f"{dev}/{port}")
                if pci:
                    self._port_devices[f"{dev}/{port}"] = f"{pci}#{port}"
                if self._sample_ib_port(s, os.path.join(ib_root, dev, "ports", port), f"{dev}/{port}", now):
                    present.discard(f"{dev}/{port}")  # removed while read: gone now (roce.port_down below)
        if self.config.rdma and not ib_unlistable:
            self._sample_gone_ports(s, present, unlisted)
        return s

    def _renewed(self, key: str, folder: str, sources: tuple[str, ...], device: str) -> None:
        """Counts a device's counters from zero when its sysfs folder is a new one since the last sample.

        A NIC removed and added again (a driver reload, mlx5 health recovery, a hot-plug; seconds) between two
        samples comes back with its counters at zero, and one gone for a sample and back likewise. Compared with
        the old values, its errors since went unseen until the counts passed the old ones: a port whose
        link_downed read 3 before and 3 again after three new link downs raised nothing.
        """
        try:
            inode = os.stat(folder).st_ino
        except OSError:
            return  # gone meanwhile: judged where its files are read
        if self._folders.setdefault(key, inode) != inode:
            self._folders[key] = inode
            for source in sources:
                self._counters.restart(f"{source}/{device}/")

    def _leave_replaced_namespace(self) -> bool:
        """Stops the listener when its namespace was deleted (``ip netns del``) or re-created under its name.

        Its socket kept the old namespace alive, and the detector read that namespace's links (up) for good: a
        deleted namespace read OK forever, and one re-created with its links down too. Stopped, this sample reads
        the name's links from a dump (a deleted namespace is then a read error naming it, and a re-created one's
        links are compared with the table), and the listener starts again in what the name now stands for.

        Returns:
            True when the listener was stopped.
        """
        watcher = self._watcher
        if not self.config.netns or not self._listening or watcher is None or not watcher.namespace_replaced():
            return False
        why = "was deleted" if netns_identity(self.config.netns) is None else "was replaced by a new one"
        with self._lock:
            self._namespace_lost = (f"network namespace {self.config.netns!r} {why} while its links were watched; "
                                    "listening again in the namespace of that name")
        watcher.stop()
        return True

    def _unmatched_condition(self, s: Sample, netdevs: list[str]) -> None:
        """Configured ``interfaces`` patterns that match no interface (a typo, a NIC udev has not renamed yet)
        leave no link watched: said as a warning, cleared once a matching interface appears. It read healthy.

        Judged on the netdevs of ``/sys/class/net`` and the link table, and only once that table is complete
        (the listener's initial dump done, or this sample's own dump).
        """
        patterns = self.config.interfaces
        if not patterns:
            return  # the RDMA devices' netdevs: nothing configured to be wrong
        watcher = self._watcher
        if self._listening and (watcher is None or not watcher.ready.is_set()):
            return
        with self._lock:
            present = sorted(set(netdevs) | set(self._links))
        matched = any(fnmatch.fnmatchcase(i, p) for i in present for p in patterns)
        shown = ", ".join(present[:_SHOWN_NETDEVS]) + (f" (+{len(present) - _SHOWN_NETDEVS} more)"
                                                        if len(present) > _SHOWN_NETDEVS else "")
        self.condition(s, "interfaces", not matched, "roce.interfaces_unmatched", Severity.WARNING, Action.NONE,
                       f"interfaces pattern(s) {', '.join(patterns)} match no network interface, so no link is "
                       f"watched; present: {shown or 'none'}",
                       "", {"interfaces": ",".join(patterns), "present": ",".join(present)})

    def _sample_gone_ports(self, s: Sample, present: set[str], unlisted: set[str]) -> None:
        """A port seen before and now missing from sysfs (the driver's health recovery removed the device, it
        was unbound or fell off the bus) is down; it used to vanish without an event, and a port_down already
        raised for it never cleared. Ports of a device whose folder could not be listed are not judged."""
        here = {self._port_devices[p] for p in present if p in self._port_devices}
        for subject in sorted(self._ports_seen - present):
            if subject.split("/", 1)[0] in unlisted:
                continue
            if self._port_devices.get(subject) in here:
                # Renamed: the same PCI function's port is present under the new name and judged there. It used to
                # read as gone for good, roce.port_down and a FAILED detector for a name that no longer exists.
                self.condition(s, f"port/{subject}", False, "roce.port_down", Severity.INFO, Action.NONE,
                               f"RDMA port {subject} is present under another name", subject, {})
                self._ports_seen.discard(subject)
                self._port_devices.pop(subject, None)
                continue
            s.metrics[f"port_active[{subject}]"] = 0.0
            self.condition(s, f"port/{subject}", True, "roce.port_down", Severity.ERROR, Action.CHECKPOINT_NOW,
                           f"RDMA port {subject} is gone from /sys/class/infiniband (device removed or reset)",
                           subject, {"state": "missing"})
        self._ports_seen |= present

    def _sample_links(self, s: Sample, now: float) -> None:
        with self._lock:
            links = {k: v for k, v in self._links.items() if self.watched(k)}
            s.metrics["links_watched"] = float(len(links))
            if self._table_unknown:
                # The last dump failed (the watched namespace was deleted: its read error is in this sample), so
                # the table holds the links as they were before: their link_up read 1 on a dashboard while
                # nothing of the namespace existed. Their state is unknown: no per-link metrics, and their
                # conditions hold as they are, neither raised nor cleared on old readings, until a dump works.
                s.metrics["links_unknown"] = float(len(links))
                return
            s.metrics["links_unknown"] = 0.0
            down = 0
            for ifname, info in sorted(links.items()):
                s.metrics[f"link_up[{ifname}]"] = 1.0 if info.up else 0.0
                downs = self._downs.get(ifname, collections.deque())
                self._trim(downs, now)
                s.metrics[f"link_downs_in_window[{ifname}]"] = float(len(downs))
                if f"flap/{ifname}" in self._active or len(downs) >= self.config.flap_threshold:
                    self._flap_condition(s, ifname, len(downs))
                since = self._down_since.get(ifname)
                if since is not None:
                    down += 1
                    s.worsen(DetectorState.FAILED, f"link {ifname} is down")
                persistent = since is not None and now - since >= self.config.down_grace_s
                self.condition(s, f"down/{ifname}", persistent, "net.link_down_persistent", Severity.CRITICAL,
                               Action.DRAIN_NODE, f"link {ifname} has been down for over "
                               f"{self.config.down_grace_s:.0f} s", ifname,
                               {"operstate": info.operstate, "carrier": int(info.carrier)})
            # Conditions of a name that left the table (the link was renamed) end here, not never.
            for key in [k for k in self._active if k.split("/", 1)[0] in ("down", "flap")]:
                gone = key.split("/", 1)[1]
                if gone not in links:
                    kind = "net.link_down_persistent" if key.startswith("down/") else "net.link_flapping"
                    self.condition(s, key, False, kind, Severity.INFO, Action.NONE,
                                   f"link {gone} no longer exists under that name", gone, {})
            s.metrics["links_down"] = float(down)
            s.metrics["link_flaps_in_window"] = float(sum(len(self._downs.get(i, ())) for i in links))

    def _sample_netdev(self, s: Sample, stats_dir: str, ifname: str, now: float) -> None:
        for name in list_dir_or_record(stats_dir, s.error):
            if not any(r.matches(name) for r in self._rules["netdev"]):
                continue
            try:
                value = read_count(os.path.join(stats_dir, name))
            except DetectorReadError as exc:
                if removed_while_read(exc, stats_dir):
                    return  # the NIC was removed meanwhile: its link says so, no unreadable input
                s.error(exc)
                continue
            self._apply(s, "netdev", ifname, name, value, now, os.path.join(stats_dir, name))

    def _sample_ib_port(self, s: Sample, port_dir: str, subject: str, now: float) -> bool:
        """Reads one RDMA port's state and counters.

        Returns:
            True when the port was removed while read (its device unbound, reset or hot-unplugged): a port gone,
            which the caller reports as such, not one read error per file.
        """
        state_file = os.path.join(port_dir, "state")
        try:
            text = read_text(state_file)
            m = _PORT_STATE.match(text)
            if not m or m.group(2) != _PORT_STATES.get(int(m.group(1)), "UNKNOWN"):
                raise DetectorReadError(state_file, f"expected '<n>: <STATE>' as ib_core prints it "
                                                    f"(4: ACTIVE, 1: DOWN...), found {text[:40]!r}")
            active = m.group(2) == "ACTIVE"
            s.metrics[f"port_active[{subject}]"] = 1.0 if active else 0.0
            phys = ""
            try:
                phys = read_text(os.path.join(port_dir, "phys_state"))
            except DetectorReadError:
                pass  # phys_state is evidence only
            self.condition(s, f"port/{subject}", not active, "roce.port_down", Severity.ERROR, Action.CHECKPOINT_NOW,
                           f"RDMA port {subject} is {m.group(2)} ({phys or 'phys_state unknown'})", subject,
                           {"state": text, "phys_state": phys})
        except DetectorReadError as exc:
            if removed_while_read(exc, port_dir):
                return True
            s.error(exc)
        for folder, source in (("counters", "ib_counters"), ("hw_counters", "ib_hw_counters")):
            cdir = os.path.join(port_dir, folder)
            for name in list_dir_or_record(cdir, s.error):
                if not any(r.matches(name) for r in self._rules[source]):
                    continue
                try:
                    bits = _PMA_BITS.get(name, 64) if folder == "counters" else 64
                    value = read_pma_counter(os.path.join(cdir, name), bits)
                except DetectorReadError as exc:
                    if removed_while_read(exc, port_dir):
                        return True
                    s.error(exc)
                    continue
                if value is not None:
                    self._apply(s, source, subject, name, value, now, os.path.join(cdir, name))
        return False

    def _apply(self, s: Sample, source: str, device: str, name: str, value: int, now: float, where: str) -> None:
        rules = [r for r in self._rules[source] if r.matches(name)]
        if not rules:
            return
        d = self._counters.update(f"{source}/{device}/{name}", value, now, _MAX_COUNTER_RATE)
        if d.implausible:
            # Not judged this sample (each rule's condition holds as it was); the value is the new baseline, so
            # a counter that stays there reads no errors and one that comes back reads as a reset.
            s.error(DetectorReadError(where, f"{name} of {device} jumped to {value}, more than it can count in "
                                             f"the time since its previous reading; taken as a misread"))
            s.metrics[f"{name}_per_s[{device}]"] = 0.0
            s.metrics.setdefault(f"{name}_per_s", 0.0)
            return
        s.metrics[f"{name}_per_s[{device}]"] = d.rate
        s.metrics[f"{name}_per_s"] = s.metrics.get(f"{name}_per_s", 0.0) + d.rate
        bits = _PMA_BITS.get(name) if source == "ib_counters" else None
        saturated = bits is not None and value >= (1 << bits) - 1
        if bits is not None:
            self.condition(s, f"saturated/{device}/{name}", saturated, "roce.counter_saturated", Severity.INFO,
                           Action.WATCH, f"{device} {name} stopped at its maximum {(1 << bits) - 1}: further "
                           f"errors of this kind are not counted until the port's counters are reset "
                           f"(perfquery -R)", device, {"counter": name, "value": value, "bits": bits})
        for rule in rules:
            key = f"{rule.kind}/{device}/{name}"
            measured = d.delta if rule.mode == "delta" else d.rate
            active = not d.first and measured > rule.threshold
            if saturated and rule.mode == "rate" and key in self._active:
                # A saturated counter reads a rate of 0 however many errors arrive: the condition it raised
                # "cleared" while the cable kept failing. Unknown now, so it holds until the counters are reset.
                active = True
            unit = "" if rule.mode == "delta" else "/s"
            self.condition(s, key, active, rule.kind, rule.severity, rule.action,
                           f"{device} {name}: {rule.description} (now {measured:.6g}{unit})", device,
                           {"counter": name, "value": value, "delta": d.delta, "rate_per_s": f"{d.rate:.6g}",
                            "threshold": rule.threshold, "mode": rule.mode})

    def links(self) -> dict[str, Any]:
        """The current table of the watched links (tests and the CLI).

        Returns:
            Interface name -> :class:`~trainguard.detectors.netlink.LinkInfo`.
        """
        with self._lock:
            return {k: v for k, v in self._links.items() if self.watched(k)}
