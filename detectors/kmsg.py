"""Kernel log detector: machine checks, OOM kills, Xids, AER, I/O errors... from ``/dev/kmsg`` records.

Record format (Documentation/ABI/testing/dev-kmsg)::

    <priority>,<sequence>,<timestamp_us>,<flags>[,<more>];<message>
     KEY=value            <- optional continuation lines, each starting with a space

``priority`` is ``facility * 8 + level``. Rules are not filtered on facility: lines injected from user space
(``echo ... > /dev/kmsg``) carry facility 1. Each ``read()`` of the device returns one record; ``EAGAIN`` means
none is pending, ``EPIPE`` that records were overwritten before we read them. A regular file under a fake root
is read as a sequence of records, so tests use the same parser.

Patterns live in ``rules/kmsg.json``; Xid codes map to actions through the fault
facts' ``xid.json`` (:mod:`trainguard.faultfacts.xid`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import ClassVar

from trainguard.detectors.base import Detector, DetectorConfig, DetectorState, Sample, register_detector
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Severity
from trainguard.detectors.rules import KmsgRule, check_operator_file, load_kmsg_rules
from trainguard.faultfacts.xid import XidEntry, load_xid_catalog

# ASCII digits: ``\d`` also takes other scripts' digits, which int() reads as numbers.
_PREFIX = re.compile(r"^([0-9]+),([0-9]+),([0-9]+),([^,;]*)(?:,[^;]*)?$")
#: What an Xid code is: ASCII digits (a rule's ``\d`` is ASCII-only too, but an operator's pattern may capture
#: more), at most 10 of them, so int() neither reads another script's digits nor runs on 5000 of them.
_XID = re.compile(r"^[0-9]{1,10}$")
_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel log record.

    Attributes:
        facility: syslog facility (0 kernel, 1 user...).
        level: syslog level (0 emerg ... 7 debug).
        sequence: record sequence number.
        timestamp_us: microseconds since boot.
        message: the text, ``\\xNN`` escapes decoded.
        fields: continuation ``KEY=value`` pairs (``SUBSYSTEM``, ``DEVICE``).
    """

    facility: int
    level: int
    sequence: int
    timestamp_us: int
    message: str
    fields: dict[str, str]


def parse_record(raw: str) -> KmsgRecord:
    """Parses one record (prefix line plus continuation lines).

    Args:
        raw: the record text, with or without the final newline.

    Returns:
        The record.

    Raises:
        ValueError: the prefix is missing or not in the documented format.
    """
    lines = raw.rstrip("\n").split("\n")
    head, sep, message = lines[0].partition(";")
    if not sep:
        raise ValueError(f"record {lines[0][:60]!r} has no ';' after its prefix")
    m = _PREFIX.match(head)
    if not m:
        raise ValueError(f"record prefix {head[:60]!r} is not 'priority,sequence,timestamp,flags'")
    priority = int(m.group(1))
    fields = {}
    for line in lines[1:]:
        key, eq, value = line.strip().partition("=")
        if line.startswith(" ") and eq:
            fields[key] = value
    # The kernel escapes every byte outside printable ASCII (and '\\') as \xNN: the bytes of UTF-8 text. Each
    # was decoded as its own character, so 'café' read 'cafÃ©' and U+202E three characters, one a C1 control.
    message = _ESCAPE.sub(lambda e: bytes([int(e.group(1), 16)]), message.encode("utf-8", "surrogatepass")).decode(
        "utf-8", "replace")
    return KmsgRecord(priority >> 3, priority & 7, int(m.group(2)), int(m.group(3)), message, fields)


@dataclass
class KmsgConfig(DetectorConfig):
    """Settings of the kernel log detector.

    Attributes:
        interval_s: seconds between reads of the pending records. Default 1.0.
        device: the kernel log device, under ``root``. Default ``/dev/kmsg``.
        rules_file: an operator rule file replacing the shipped ``kmsg.json``; empty for the shipped one.
        xid_file: an operator Xid catalog replacing the shipped ``xid.json``; empty for the shipped one.
        replay: also match records logged before the detector started. Default False.
        dedup_s: the same kind for the same subject is reported at most once per this many seconds. Default 10.0.
        state_window_s: the detector's state reflects matches within this many seconds. Default 300.0.
        max_records: records read per sample at most (the rest wait for the next). Default 20000.
    """

    interval_s: float = 1.0
    device: str = "/dev/kmsg"
    rules_file: str = ""
    xid_file: str = ""
    replay: bool = False
    dedup_s: float = 10.0
    state_window_s: float = 300.0
    max_records: int = 20000

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range, or a rule or Xid file is unreadable or invalid.
        """
        super().validate()
        if self.dedup_s < 0 or self.state_window_s <= 0 or self.max_records <= 0:
            raise DetectorConfigError("kmsg: dedup_s must be >= 0, state_window_s and max_records > 0")
        check_operator_file("kmsg.rules_file", self.rules_file, load_kmsg_rules)
        check_operator_file("kmsg.xid_file", self.xid_file, load_xid_catalog)


@register_detector
class KmsgDetector(Detector):
    """Matches kernel log records against the rule file."""

    name: ClassVar[str] = "kmsg"
    config_class: ClassVar[type[DetectorConfig]] = KmsgConfig
    default_interval_s: ClassVar[float] = 1.0

    def __init__(self, config: KmsgConfig | None = None) -> None:
        """Creates the detector and loads its rules.

        Args:
            config: settings.

        Raises:
            RuleFileError: a rule file is invalid.
        """
        super().__init__(config)
        self.config: KmsgConfig
        self.rules: list[KmsgRule] = load_kmsg_rules(self.config.rules_file or None)
        self.xids, self.xid_default = load_xid_catalog(self.config.xid_file or None)
        self._fd: int | None = None
        self._is_device = False
        self._pending = b""
        self._last_emit: dict[tuple[str, str], float] = {}
        self._recent: list[tuple[float, Severity, str]] = []
        self._counts = {r.name: 0 for r in self.rules}
        self._lost = 0
        self._records = 0
        self._suppressed = 0

    def close(self) -> None:
        """Closes the device."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> None:
        path = self.config.path(self.config.device)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._is_device = stat.S_ISCHR(os.fstat(fd).st_mode)
        if not self.config.replay:
            os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd

    def _read_records(self, s: Sample) -> list[str]:
        """The records pending, at most ``max_records``; a read error ends the reading and is added to ``s``."""
        assert self._fd is not None
        path = self.config.path(self.config.device)
        records: list[str] = []
        while len(records) < self.config.max_records:
            try:
                chunk = os.read(self._fd, 8192 if self._is_device else 1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    self._lost += 1  # the ring buffer wrapped past unread records; the next read resumes
                    continue
                # Reported in the sample beside the records read before it: raising here dropped them, and
                # they were already consumed from the device, so no later sample would see them.
                s.error(DetectorReadError(path, f"read failed: {exc.strerror}"))
                break
            if not chunk:
                break
            if self._is_device:
                records.append(chunk.decode("utf-8", errors="replace"))
                continue
            data = self._pending + chunk
            lines = data.split(b"\n")
            self._pending = lines.pop()
            current: list[str] = []
            for line in lines:
                text = line.decode("utf-8", errors="replace")
                if text.startswith(" ") and current:
                    current.append(text)
                    continue
                if current:
                    records.append("\n".join(current))
                current = [text]
            if current:
                records.append("\n".join(current))
        return records

    def sample(self) -> Sample:
        """Reads the pending records and matches them.

        Returns:
            Counts per rule and events for matching records.
        """
        s = Sample()
        path = self.config.path(self.config.device)
        if self._fd is None:
            try:
                self._open()
            except FileNotFoundError:
                return self.no_hardware(f"no kernel log device {path}")
            except OSError as exc:
                s.error(DetectorReadError(path, f"cannot open ({exc.strerror})"))
                return s
        now = time.monotonic()
        for raw in self._read_records(s):
            if not raw.strip():
                continue
            self._records += 1
            try:
                record = parse_record(raw)
            except ValueError as exc:
                s.error(DetectorReadError(path, f"malformed record: {exc}"))
                continue
            self._match(s, record, now)
        self._recent = [r for r in self._recent if now - r[0] <= self.config.state_window_s][-1000:]
        if len(self._last_emit) > 4096:
            self._last_emit = {k: t for k, t in self._last_emit.items() if now - t < self.config.dedup_s}
        for _, severity, message in self._recent:
            if severity >= Severity.ERROR:
                s.worsen(DetectorState.FAILED, message)
            elif severity == Severity.WARNING:
                s.worsen(DetectorState.DEGRADED, message)
        for rule in self.rules:
            # Node-wide counts, so plain names (no brackets): the predictor keeps these as features.
            s.metrics[f"matches_{rule.name.replace('-', '_')}"] = float(self._counts[rule.name])
        s.metrics.update({"records": float(self._records), "records_lost": float(self._lost),
                          "matches": float(sum(self._counts.values())), "suppressed": float(self._suppressed)})
        return s

    def _match(self, s: Sample, record: KmsgRecord, now: float) -> None:
        for rule in self.rules:
            m = rule.pattern.search(record.message)
            if not m:
                continue
            self._counts[rule.name] += 1
            groups = {k: (v if v is not None else "") for k, v in m.groupdict().items()}
            severity, action = rule.severity, rule.action
            evidence = {"rule": rule.name, "line": record.message[:1000], "facility": record.facility,
                        "level": record.level, "sequence": record.sequence, "kernel_time_us": record.timestamp_us}
            evidence.update({k: v for k, v in record.fields.items()})
            message = rule.message.format(**groups)
            if rule.lookup == "xid":
                if not _XID.match(groups["xid"]):
                    s.error(DetectorReadError(self.config.path(self.config.device),
                                              f"rule {rule.name}: Xid {groups['xid'][:20]!r} is not an Xid code "
                                              "(1 to 10 ASCII digits); the record is not judged"))
                    return
                code = int(groups["xid"])
                entry: XidEntry = self.xids.get(code, self.xid_default)
                severity, action = entry.severity, entry.action
                evidence.update({"xid": code, "xid_name": entry.name, "nvidia_action": entry.nvidia_action})
                message = f"{message} ({entry.name}; NVIDIA: {entry.nvidia_action})"
            subject = groups.get(rule.subject, "") if rule.subject else ""
            key = (rule.kind if rule.lookup != "xid" else f"{rule.kind}.{groups['xid']}", subject)
            last = self._last_emit.get(key)
            self._recent.append((now, severity, message))
            if last is not None and now - last < self.config.dedup_s:
                self._suppressed += 1
                return
            self._last_emit[key] = now
            # one_off: the record is consumed from the device and not read again (see Detector.one_off)
            self.one_off(s, self.event(rule.kind, severity, action, message, subject, evidence))
            return  # first matching rule wins: rules are ordered from specific to general
