"""NIC driver statistics (what ``ethtool -S`` prints), read through the SIOCETHTOOL ioctl without the tool.

Three calls, as ethtool(8) makes them (linux/ethtool.h):

1. ``ETHTOOL_GSSET_INFO`` for ``ETH_SS_STATS``: how many statistics the driver exports;
2. ``ETHTOOL_GSTRINGS``: their names, 32 bytes each (``rx_prio3_pause``, ``tx_pause_storm_error_events``...);
3. ``ETHTOOL_GSTATS``: their values, one u64 each.

The driver strings differ per vendor; the PFC counters of mlx5 are ``rx_prio<N>_pause``/``tx_prio<N>_pause``.
:func:`parse_ethtool_s` reads the text output of ``ethtool -S`` for where the tool's output is what is at hand.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import socket
import struct

from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.sysfs import parse_int

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSTATS = 0x1D
ETHTOOL_GSSET_INFO = 0x37
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16


def _ioctl(sock: socket.socket, ifname: str, buf: ctypes.Array) -> None:
    # struct ifreq: char ifr_name[16]; then a union whose member ifr_data is a pointer to our buffer.
    # fsencode: a name is bytes to the kernel (any but '/', ':', blanks); one that is no UTF-8 is listed by
    # os.listdir with surrogates, and str.encode() raised UnicodeEncodeError out of the whole RoCE sample.
    ifreq = struct.pack(f"{IFNAMSIZ}sP", os.fsencode(ifname)[: IFNAMSIZ - 1], ctypes.addressof(buf))
    ifreq += b"\0" * (40 - len(ifreq))
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)


def ethtool_stats(ifname: str, attempts: int = 3) -> dict[str, int]:
    """Reads the driver statistics of ``ifname`` in the current network namespace.

    The number of statistics can change between the three calls (mlx5 and veth export per-queue counters, and
    ``ethtool -L`` changes the queues); the kernel then answers with another count (recent kernels with 0 and
    nothing written), and the names and values would not match: every value read as 0, which the counter
    tracker takes as a reset, so the next sample saw the whole counter as one increase (a false PFC storm).
    Such a read is tried again.

    Args:
        ifname: interface name.
        attempts: reads tried while the number of statistics keeps changing.

    Returns:
        Statistic name -> value; empty when the driver exports none (or does not support the request).

    Raises:
        DetectorReadError: no such interface, the number of statistics kept changing, or the request failed.
    """
    for _ in range(attempts):
        stats = _read_stats(ifname)
        if stats is not None:
            return stats
    raise DetectorReadError(f"ethtool -S {ifname}",
                            f"the number of driver statistics changed during each of {attempts} reads")


def _read_stats(ifname: str) -> dict[str, int] | None:
    """One read of the statistics; None when their number changed between the calls."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # struct ethtool_sset_info { u32 cmd; u32 reserved; u64 sset_mask; u32 data[]; }
        info = ctypes.create_string_buffer(struct.pack("=IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0))
        _ioctl(sock, ifname, info)
        _, _, mask, count = struct.unpack("=IIQI", info.raw[:20])
        if not mask & (1 << ETH_SS_STATS) or count == 0:
            return {}
        # struct ethtool_gstrings { u32 cmd; u32 string_set; u32 len; u8 data[]; }
        strings = ctypes.create_string_buffer(
            struct.pack("=III", ETHTOOL_GSTRINGS, ETH_SS_STATS, count) + b"\0" * (count * ETH_GSTRING_LEN)
        )
        _ioctl(sock, ifname, strings)
        if struct.unpack("=I", strings.raw[8:12])[0] != count:
            return None
        raw_names = strings.raw[12 : 12 + count * ETH_GSTRING_LEN]
        names = [raw_names[i : i + ETH_GSTRING_LEN].split(b"\0", 1)[0].decode("ascii", "replace")
                 for i in range(0, len(raw_names), ETH_GSTRING_LEN)]
        # struct ethtool_stats { u32 cmd; u32 n_stats; u64 data[]; }
        stats = ctypes.create_string_buffer(struct.pack("=II", ETHTOOL_GSTATS, count) + b"\0" * (8 * count))
        _ioctl(sock, ifname, stats)
        if struct.unpack("=I", stats.raw[4:8])[0] != count:
            return None
        values = struct.unpack(f"={count}Q", stats.raw[8 : 8 + 8 * count])
        return dict(zip(names, values))
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return {}  # the driver exports no statistics: nothing to watch, not a read error
        raise DetectorReadError(f"ethtool -S {ifname}", f"SIOCETHTOOL failed: {exc.strerror or exc}") from exc
    finally:
        sock.close()


# ASCII digits (``\d`` took other scripts' digits, which int() read), at most 20 (u64; int() of 5000 raised).
_LINE = re.compile(r"^\s+(?P<name>[^:]+):\s+(?P<value>[0-9]{1,20})\s*$")


def parse_ethtool_s(text: str, source: str = "ethtool -S") -> dict[str, int]:
    """Parses the text output of ``ethtool -S <if>``.

    Args:
        text: the output: a ``NIC statistics:`` header, then ``     name: value`` lines.
        source: names the output in errors.

    Returns:
        Statistic name -> value.

    Raises:
        DetectorReadError: the header is missing or a line is not ``name: value``.
    """
    lines = text.splitlines()
    if not lines or not lines[0].startswith("NIC statistics"):
        raise DetectorReadError(source, "output does not start with 'NIC statistics:'")
    out: dict[str, int] = {}
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if not m:
            raise DetectorReadError(source, f"line {number} {line[:40]!r} is not 'name: value'")
        out[m.group("name").strip()] = parse_int(m.group("value"), source, f"a count on line {number}")
    return out
