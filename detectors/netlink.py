"""Link state from rtnetlink, as it happens (pyroute2), for the RoCE detector.

:class:`LinkWatcher` binds an rtnetlink socket to ``RTMGRP_LINK`` (in the current or a named network namespace),
seeds its table with a dump of every link, then blocks on the socket and calls back on each change of a link's
usable state. A link is **up** when it is administratively up (``IFF_UP``) and has carrier (``IFLA_CARRIER``):
operstate alone is not enough, since a veth whose peer went down reports ``DOWN`` on one side and
``LOWERLAYERDOWN`` on the other, and drivers differ. The kernel sends carrier changes through its link-watch
work, which coalesces them: a link that drops and regains carrier several times before that work runs yields one
message with the state it ended in. ``IFLA_CARRIER_DOWN_COUNT`` (Linux 4.19+; else ``IFLA_CARRIER_CHANGES``,
every transition) says how many downs happened meanwhile.

The pyroute2 0.9 socket is read by ``get()``, which blocks; :meth:`LinkWatcher.stop` closes the socket from
another thread, which makes the pending ``get()`` return empty.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

IFF_UP = 0x1

# pyroute2 is imported on first use (it is slow to import). Its modules import each other in a cycle, so two
# threads importing it at once (the sampler's one-shot dump and the listener, both at agent start) can hit
# Python's import deadlock detection ("deadlock detected by _ModuleLock('pyroute2.netlink.rtnl')"), which
# surfaced as a spurious detector.error; one lock makes the first import single-threaded.
_IMPORT_LOCK = threading.Lock()


CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"


def netns_path(netns: str) -> str:
    """The file naming a network namespace: an absolute path as given, else ``/run/netns/<name>``."""
    return netns if netns.startswith("/") else os.path.join(NETNS_RUN_DIR, netns)


def netns_identity(netns: str) -> tuple[int, int] | None:
    """Which namespace a name stands for now: the (device, inode) of its file, the namespace's own inode number.

    A socket opened in a namespace keeps it alive after ``ip netns del``: a listener on it read, for good, the
    links of a namespace nobody else sees any more (all up). This tells it that the name is gone or now names
    another namespace (re-created under the same name, as a restarted container's is).

    Args:
        netns: a name from ``ip netns add``, or the absolute path of a namespace file.

    Returns:
        The identity, or None when no namespace has that name now.
    """
    try:
        st = os.stat(netns_path(netns))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def netlink_socket_in(netns: str) -> socket.socket:
    """Opens an rtnetlink socket inside a named network namespace, without forking.

    A socket belongs to the namespace of the thread that created it, and ``setns(CLONE_NEWNET)`` moves only the
    calling thread; so a short-lived thread enters the namespace, creates the socket and ends. pyroute2's own
    ``IPRoute(netns=...)`` forks a child to do this instead: forking a process with many threads (torch, gRPC,
    the sampler) can leave the child stuck on a lock some other thread held at the fork, and under load the
    child missed pyroute2's 2 s answer deadline ten seconds running, so the link listener never started (CI).
    Its default ``O_CREAT`` also created a namespace that did not exist; a detector must not.

    Args:
        netns: a name from ``ip netns add``, or the absolute path of a namespace file (``/proc/<pid>/ns/net``).

    Returns:
        An unbound ``AF_NETLINK``/``NETLINK_ROUTE`` socket in that namespace.

    Raises:
        FileNotFoundError: no such namespace.
        OSError: the namespace cannot be entered (needs CAP_SYS_ADMIN) or the socket cannot be made.
    """
    path = netns_path(netns)
    result: dict[str, Any] = {}

    def enter_and_open() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            result["error"] = FileNotFoundError(
                errno.ENOENT, f"no network namespace {netns!r} (is it listed by `ip netns list`?)", path)
            return
        except OSError as exc:
            result["error"] = exc
            return
        try:
            if _libc().setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                result["error"] = OSError(err, f"cannot enter network namespace {netns!r}: {os.strerror(err)}",
                                          path)
                return
            result["sock"] = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 0)  # NETLINK_ROUTE
        except OSError as exc:
            result["error"] = exc
        finally:
            os.close(fd)

    # The thread ends inside the namespace; that is harmless, since nothing else ever runs on it.
    worker = threading.Thread(target=enter_and_open, name="trainguard-netns-socket", daemon=True)
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_LIBC: ctypes.CDLL | None = None


def open_iproute(netns: str = "") -> Any:
    """Opens a pyroute2 ``IPRoute`` socket, importing pyroute2 safely from any thread.

    Args:
        netns: name of a network namespace (``ip netns add``) or the path of a namespace file; the current one
            when empty.

    Returns:
        The open socket; the caller closes it.

    Raises:
        OSError / pyroute2 errors: the socket cannot be opened (no such namespace, no permission).
    """
    with _IMPORT_LOCK:
        from pyroute2 import IPRoute
        importlib.import_module("pyroute2.netlink.rtnl")  # imported here, under the lock, for LinkWatcher.run
    if not netns:
        return IPRoute()
    fd = netlink_socket_in(netns).detach()
    try:
        return IPRoute(fileno=fd)
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True)
class LinkInfo:
    """State of one network link.

    Attributes:
        ifname: interface name.
        index: interface index.
        admin_up: ``IFF_UP`` is set.
        carrier: the driver reports carrier.
        operstate: RFC 2863 operational state as the kernel names it (``UP``, ``DOWN``, ``LOWERLAYERDOWN``...).
        carrier_changes: the kernel's count of carrier transitions (0 when not reported).
        carrier_down_count: the kernel's count of carrier losses; None when the kernel does not report it.
        removed: the link was deleted (``RTM_DELLINK``).
        time: Unix time when the message was received.
    """

    ifname: str
    index: int
    admin_up: bool
    carrier: bool
    operstate: str
    carrier_changes: int
    removed: bool = False
    time: float = 0.0
    carrier_down_count: int | None = None

    @property
    def up(self) -> bool:
        """Usable: administratively up, with carrier, and not removed."""
        return self.admin_up and self.carrier and not self.removed

    def carrier_downs_since(self, prev: LinkInfo) -> int:
        """Carrier losses between ``prev`` (an earlier message about the same link) and this message.

        Args:
            prev: the state last seen of this link.

        Returns:
            How many times the carrier went down in between; 0 when the counters cannot tell (another link
            under the same name, counters reset with a new device).
        """
        if prev.index != self.index or prev.removed:
            return 0
        if self.carrier_down_count is not None and prev.carrier_down_count is not None:
            return max(0, self.carrier_down_count - prev.carrier_down_count)
        changes = self.carrier_changes - prev.carrier_changes
        if changes <= 0:
            return 0
        # Transitions alternate: from carrier on, the 1st, 3rd, ... are downs; from carrier off, the 2nd, 4th, ...
        return (changes + 1) // 2 if prev.carrier else changes // 2


def link_from_message(msg: Any, received: float | None = None) -> LinkInfo | None:
    """Decodes an ``RTM_NEWLINK``/``RTM_DELLINK`` message.

    Args:
        msg: a pyroute2 ``ifinfmsg``.
        received: Unix time of reception; now when None.

    Returns:
        The link state, or None for a message that is not about a link.
    """
    event = msg.get("event")
    if event not in ("RTM_NEWLINK", "RTM_DELLINK"):
        return None
    name = msg.get_attr("IFLA_IFNAME")
    if name is None:
        return None
    if isinstance(name, bytes):
        # A name is bytes to the kernel; pyroute2 hands over one that is no UTF-8 undecoded, and matching it
        # against the interface patterns raised TypeError: every dump (and the listener, retried for good) failed
        # over one such link beside the watched NICs. Decoded as os.listdir('/sys/class/net') lists it.
        name = os.fsdecode(name.rstrip(b"\0"))
    carrier = msg.get_attr("IFLA_CARRIER")
    down_count = msg.get_attr("IFLA_CARRIER_DOWN_COUNT")
    return LinkInfo(
        ifname=name,
        index=int(msg.get("index", 0)),
        admin_up=bool(int(msg.get("flags", 0)) & IFF_UP),
        carrier=bool(carrier) if carrier is not None else False,
        operstate=str(msg.get_attr("IFLA_OPERSTATE") or "UNKNOWN"),
        carrier_changes=int(msg.get_attr("IFLA_CARRIER_CHANGES") or 0),
        removed=event == "RTM_DELLINK",
        time=time.time() if received is None else received,
        carrier_down_count=None if down_count is None else int(down_count),
    )


class LinkWatcher:
    """Blocks on rtnetlink link notifications and reports each link's state.

    Args:
        on_link: called from the watching thread with every decoded link message (changes and the initial dump,
            the latter with ``initial=True``; the dump that resynchronises the table after notifications were
            lost comes with ``initial=False``, so a link that changed meanwhile reads as a change).
        netns: name of a network namespace (``ip netns add``) to watch; the agent's own when empty.
        on_dump: called after each complete dump with the names it listed and whether it was the initial one, so
            the caller can tell which links it knew are gone (deleted while no notification was read).
    """

    def __init__(self, on_link: Callable[[LinkInfo, bool], None], netns: str = "",
                 on_dump: Callable[[set[str], bool], None] | None = None) -> None:
        self._on_link = on_link
        self._on_dump = on_dump
        self._netns = netns
        self._lock = threading.Lock()
        self._sock: Any = None
        self._stopped = False
        self.ready = threading.Event()
        #: The identity (:func:`netns_identity`) of the named namespace when the socket was opened.
        self.netns_id: tuple[int, int] | None = None

    def _open(self) -> Any:
        return open_iproute(self._netns)

    def run(self) -> None:
        """Seeds the table and blocks delivering changes until :meth:`stop` (call from a dedicated thread).

        Raises:
            OSError / pyroute2 errors: the socket cannot be opened (no such namespace, no permission).
        """
        if self._netns:
            self.netns_id = netns_identity(self._netns)
        sock = self._open()
        from pyroute2.netlink.rtnl import RTMGRP_LINK  # already imported by _open(), under its lock

        with self._lock:
            if self._stopped:
                sock.close()
                return
            self._sock = sock
        try:
            # Bind before the dump so that no change between the two is lost.
            sock.bind(groups=RTMGRP_LINK)
            self._dump(initial=True)
            self.ready.set()
            while not self._stopped:
                try:
                    msgs = sock.get()
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:
                        raise
                    # A burst of link messages (pod veths churning beside the NICs) overflowed the socket buffer
                    # and the kernel dropped some. The socket still works; a fresh dump brings the table up to
                    # date, and a link whose state differs from the last one seen is reported as a change. (This
                    # ended the listener: 5 s blind, then a re-dump that reported no missed down at all.)
                    log.warning("rtnetlink %s: link notifications were lost (%s); resynchronising from a dump",
                                self._netns or "(own namespace)", exc.strerror or exc)
                    self._dump(initial=False)
                    continue
                received = time.time()
                if not msgs:
                    return  # stop() closed the socket
                for msg in msgs:
                    info = link_from_message(msg, received)
                    if info is not None:
                        self._on_link(info, False)
        finally:
            self.ready.set()
            with self._lock:
                self._sock = None
                self._stopped = True
            try:
                sock.close()
            except Exception:  # noqa: BLE001 - closing twice after stop() is harmless
                pass

    def _dump(self, initial: bool) -> None:
        dump = self._open()
        names: set[str] = set()
        try:
            for msg in dump.get_links():
                info = link_from_message(msg)
                if info is not None:
                    names.add(info.ifname)
                    self._on_link(info, initial)
        finally:
            dump.close()
        if self._on_dump is not None:
            self._on_dump(names, initial)

    def namespace_replaced(self) -> bool:
        """Whether the named namespace this watcher listens in was deleted or replaced by another of the same name
        since its socket was opened (False for the agent's own namespace, or before the socket was opened)."""
        return bool(self._netns) and self.netns_id is not None and netns_identity(self._netns) != self.netns_id

    def stop(self) -> None:
        """Makes :meth:`run` return; safe from any thread, more than once."""
        with self._lock:
            self._stopped = True
            sock = self._sock
        if sock is not None:
            try:
                sock.close()
            except Exception:  # noqa: BLE001
                log.debug("closing the rtnetlink socket failed", exc_info=True)
