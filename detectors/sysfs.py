"""Strict readers for sysfs/procfs files: every value is checked against its documented format.

Each reader raises :class:`~trainguard.detectors.errors.DetectorReadError` naming the file when it is missing,
unreadable, empty, truncated or not in the expected format, so a detector can record the error and go on.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import stat
from collections.abc import Callable

from trainguard.detectors.errors import DetectorReadError

# ASCII digits only (``\d`` also takes other scripts' digits, which int() reads: garbage read as a number), and
# at most 20 of them (u64); int() of more than 4300 digits raised ValueError out of the sample.
_INT = re.compile(r"^[+-]?[0-9]{1,20}$")
# The same for a decimal fraction (PSI ``avg10=1.23``, npu-smi's ``93.4``): float() also took other scripts'
# digits, '1_0', 'nan', 'inf' and '1e999'.
_DECIMAL = re.compile(r"^[+-]?[0-9]{1,20}(?:\.[0-9]{1,20})?$")
_MAX_TEXT = 1 << 20
#: The range a kernel prints an integer attribute in (s64 to u64): a value outside it is a corrupt file, read
#: before as a temperature of 1e27 degrees or a counter rate of 1e31 per second.
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1


def parse_int(text: str, path: str, expected: str = "one integer") -> int:
    """Parses a decimal integer as the kernel prints one (``-5``, ``18446744073709551615``).

    Args:
        text: the value, without surrounding whitespace.
        path: the file it came from, for errors.
        expected: what the file should hold, for errors.

    Returns:
        The integer.

    Raises:
        DetectorReadError: not a decimal integer, or outside the 64-bit range a kernel prints.
    """
    if not _INT.match(text):
        raise DetectorReadError(path, f"expected {expected}, found {text[:40]!r}")
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise DetectorReadError(path, f"value {text[:40]} is outside the 64-bit range a kernel prints (a corrupt file)")
    return value


def parse_count(text: str, path: str, bits: int = 64, expected: str = "one counter") -> int:
    """Parses an error or traffic counter as the kernel prints one: a non-negative integer of at most ``bits``.

    A counter is unsigned (``%u``, ``%llu``): a negative value or one past its width is a corrupt file. Read as a
    count, ``-5`` gave negative rates, and the next sane reading then a jump from -5 taken for 5 new errors; a
    u64 in a 32-bit EDAC counter read as 1.8e19 uncorrectable memory errors (a drain).

    Args:
        text: the value, without surrounding whitespace.
        path: the file it came from, for errors.
        bits: the counter's width in the kernel (32 for EDAC's ``ce_count``, 8 for an IB ``link_downed``).
        expected: what the file should hold, for errors.

    Returns:
        The counter.

    Raises:
        DetectorReadError: not a decimal integer, negative, or past the counter's width.
    """
    value = parse_int(text, path, expected)
    if value < 0:
        raise DetectorReadError(path, f"counter value {text[:40]} is negative (a counter never is: a corrupt file)")
    if value >> bits:
        raise DetectorReadError(path, f"counter value {text[:40]} is beyond the {bits}-bit counter the kernel keeps "
                                      "there (a corrupt file)")
    return value


def parse_decimal(text: str, path: str, expected: str = "one decimal number") -> float:
    """Parses a decimal number as the kernel or a vendor tool prints one (``0.00``, ``93.4``, ``41``).

    Args:
        text: the value, without surrounding whitespace.
        path: the file or command it came from, for errors.
        expected: what it should be, for errors.

    Returns:
        The number (always finite).

    Raises:
        DetectorReadError: not ASCII digits with at most one decimal point.
    """
    if not _DECIMAL.match(text):
        raise DetectorReadError(path, f"expected {expected}, found {text[:40]!r}")
    return float(text)


def read_text(path: str) -> str:
    """Reads a small text file and strips the trailing newline.

    Args:
        path: file to read.

    Returns:
        Its content without surrounding whitespace.

    Raises:
        DetectorReadError: the file cannot be read or holds invalid UTF-8.
    """
    # os.read straight into bytes: sysfs attributes are at most a page, and this runs thousands of times a minute.
    try:
        # O_NONBLOCK: a FIFO in a file's place (a fake tree, a bad bind mount) waited for a writer forever, and the
        # sample with it; sysfs and procfs attributes are regular files, so anything else is refused.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DetectorReadError(path, "not a regular file (a FIFO, socket or device in a file's place)")
            chunks = []
            size = 0
            while size < _MAX_TEXT:
                chunk = os.read(fd, 8192)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise DetectorReadError(path, f"cannot read ({exc.strerror or exc})") from exc
    data = b"".join(chunks)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise DetectorReadError(path, "not valid UTF-8 text") from exc


def read_int(path: str) -> int:
    """Reads a file holding one decimal integer (``ce_count``, ``temp``, ``statistics/rx_errors``).

    Args:
        path: file to read.

    Returns:
        The integer.

    Raises:
        DetectorReadError: unreadable, empty or not a single integer.
    """
    return parse_int(read_text(path), path)


def read_count(path: str, bits: int = 64) -> int:
    """Reads a file holding one counter (``ce_count``, ``statistics/rx_errors``): see :func:`parse_count`.

    Args:
        path: file to read.
        bits: the counter's width in the kernel.

    Returns:
        The counter.

    Raises:
        DetectorReadError: unreadable, empty, not an integer, negative or past ``bits``.
    """
    return parse_count(read_text(path), path, bits)


def read_pma_counter(path: str, bits: int = 64) -> int | None:
    """Reads an RDMA port counter (``/sys/class/infiniband/<dev>/ports/<n>/counters/*``).

    A device without a performance management agent (irdma, rxe, siw, efa...) or one whose query failed prints
    ``N/A (no PMA)`` there instead of a number: the counter is not available, which is no read error.

    Args:
        path: file to read.
        bits: the counter's width (the IB PortCounters fields are 4 to 16 bits wide, hw_counters 64).

    Returns:
        The counter, or None when the device does not provide it.

    Raises:
        DetectorReadError: unreadable, empty, neither a counter nor ``N/A``, negative or past ``bits``.
    """
    text = read_text(path)
    if text.startswith("N/A"):
        return None
    return parse_count(text, path, bits, "one integer or 'N/A (no PMA)'")


def read_counter_table(path: str) -> dict[str, int]:
    """Reads a ``NAME VALUE`` per line table, the format of the PCIe ``aer_dev_*`` files.

    Names may hold spaces (older kernels print ``Receiver Error 2``, newer ones ``RxErr 2``); the value is the
    last token of the line.

    Args:
        path: file to read.

    Returns:
        Name -> value.

    Raises:
        DetectorReadError: unreadable, empty, or a line that is not ``<name> <integer>``.
    """
    text = read_text(path)
    if not text:
        raise DetectorReadError(path, "empty; expected lines of '<name> <count>'")
    table: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.rsplit(None, 1)
        if len(parts) != 2 or not _INT.match(parts[1]):
            raise DetectorReadError(path, f"line {number} {line[:40]!r} is not '<name> <count>'")
        table[parts[0].strip()] = parse_count(parts[1], path, 64, f"'<name> <count>' on line {number}")
    return table


def read_key_values(path: str) -> dict[str, str]:
    """Reads ``key=value`` tokens separated by spaces (PSI lines use this after their first word).

    Args:
        path: file to read.

    Returns:
        First word of each line -> {key: value} flattened as ``"<word>.<key>"``.

    Raises:
        DetectorReadError: unreadable or a token without ``=``.
    """
    out: dict[str, str] = {}
    text = read_text(path)
    if not text:
        raise DetectorReadError(path, "empty")
    for line in text.splitlines():
        if not line.strip():
            continue  # a blank line raised ValueError ("not enough values to unpack") out of the reader
        word, *tokens = line.split()
        for token in tokens:
            key, sep, value = token.partition("=")
            if not sep:
                raise DetectorReadError(path, f"token {token[:40]!r} is not key=value")
            out[f"{word}.{key}"] = value
    return out


#: What reading a sysfs attribute fails with once its device was removed: ENOENT when opened after the removal,
#: ENODEV (kernfs) or ENXIO (some drivers) when the file was open as it went.
_REMOVED_ERRNOS = (errno.ENOENT, errno.ENODEV, errno.ENXIO)


def removed_while_read(exc: DetectorReadError, device_dir: str) -> bool:
    """Whether a read failed because the device was removed meanwhile (hot-unplug, a driver unbinding it): the
    read failed as a removed attribute does and the device's folder is gone. Such a device is not an unreadable
    input but a device gone, which the detector judges as such (now, or at its next listing).

    Args:
        exc: the read error (from :func:`read_text` and the readers built on it).
        device_dir: the device's folder (a ``/sys/bus/.../devices/<id>`` link is followed).

    Returns:
        True when the device is gone.
    """
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno in _REMOVED_ERRNOS and not os.path.exists(device_dir)


def list_dir(path: str) -> list[str]:
    """Sorted entries of a directory, or an empty list when it does not exist.

    Args:
        path: directory.

    Returns:
        Entry names.

    Raises:
        DetectorReadError: the directory exists but cannot be listed (permission denied, I/O error, a symlink
            loop), so a detector records it as an unreadable input instead of raising out of its sample.
    """
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise DetectorReadError(path, f"cannot list ({exc.strerror or exc})") from exc


def list_dir_or_record(path: str, record: Callable[[DetectorReadError], None] | None) -> list[str]:
    """:func:`list_dir`, but a directory that cannot be listed counts as empty and its error goes to ``record``
    (a sample's ``error``; None drops it), so one unreadable folder does not end the whole sample: the events
    of the devices read before it would be lost with it.

    Args:
        path: directory.
        record: receives the read error, if any.

    Returns:
        Entry names (none when the directory cannot be listed).
    """
    try:
        return list_dir(path)
    except DetectorReadError as exc:
        if record is not None:
            record(exc)
        return []


def glob_sorted(pattern: str) -> list[str]:
    """Sorted :func:`glob.glob` matches.

    Args:
        pattern: glob pattern.

    Returns:
        Matching paths.
    """
    return sorted(glob.glob(pattern))
