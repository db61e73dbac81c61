"""Log formats of the daemon: journald-friendly lines, timestamped text, or JSON, all on stderr.

- ``journal``: each line starts with the syslog priority in angle brackets (``<6>`` info, ``<4>`` warning...),
  which journald turns into the entry's priority (``SyslogLevelPrefix=yes``, the default), and carries no
  timestamp because journald stamps every entry itself. A multi-line record (a traceback) gets the prefix on
  every line so no line falls back to the default priority.
- ``text``: ``2026-11-29T15:03:29.123Z WARNING trainguard.agent: message`` for a terminal.
- ``json``: one object per line (``ts``, ``level``, ``logger``, ``msg``, optional ``exc`` and extra fields) for
  log shippers.
- ``auto``: ``journal`` when stderr is the stream ``$JOURNAL_STREAM`` names (systemd sets it), else ``text``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import IO, Any

#: ``device:inode`` of the journald stream systemd connected our stdout/stderr to.
JOURNAL_STREAM_ENV = "JOURNAL_STREAM"

#: Python level -> syslog priority (RFC 5424 severities).
SYSLOG_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}

# Attributes every LogRecord has; anything else was passed with extra= and goes into JSON output.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

_HANDLER_MARK = "_trainguard_handler"


def syslog_priority(levelno: int) -> int:
    """Maps a Python log level to a syslog priority (levels between two names round up to the worse one)."""
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        if levelno <= level:
            return SYSLOG_PRIORITY[level]
    return SYSLOG_PRIORITY[logging.CRITICAL]


class JournalFormatter(logging.Formatter):
    """``<N>logger: message`` with the priority prefix on every line and no timestamp."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


class TextFormatter(logging.Formatter):
    """UTC ISO-8601 timestamp (milliseconds), level, logger and message."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (stdlib)
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (Unix seconds), ``level``, ``logger``, ``msg``, ``exc``, extras."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                obj[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        return json.dumps(obj, ensure_ascii=False)


def stderr_is_journal(stream: IO[str] | None = None, environ: dict[str, str] | None = None) -> bool:
    """True when ``stream`` (default stderr) is the journald stream ``$JOURNAL_STREAM`` names."""
    env = os.environ if environ is None else environ
    value = env.get(JOURNAL_STREAM_ENV, "")
    stream = sys.stderr if stream is None else stream
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def resolve_format(fmt: str, stream: IO[str] | None = None) -> str:
    """Turns ``auto`` into ``journal`` or ``text``; other formats are returned unchanged."""
    if fmt != "auto":
        return fmt
    return "journal" if stderr_is_journal(stream) else "text"


def make_formatter(fmt: str) -> logging.Formatter:
    """Returns the formatter of a resolved format name (``journal``, ``text`` or ``json``).

    Raises:
        ValueError: unknown format name.
    """
    if fmt == "journal":
        return JournalFormatter()
    if fmt == "text":
        return TextFormatter()
    if fmt == "json":
        return JsonFormatter()
    raise ValueError(f"unknown log format {fmt!r}; expected auto, journal, text or json")


def configure_logging(fmt: str = "auto", level: str = "info", stream: IO[str] | None = None) -> str:
    """Routes the root logger to ``stream`` (default stderr) in the given format; safe to call again on reload.

    Replaces every handler already on the root logger (e.g. from ``logging.basicConfig``) so no record is
    printed twice with two timestamps.

    Args:
        fmt: ``auto``, ``journal``, ``text`` or ``json``.
        level: ``debug``, ``info``, ``warning`` or ``error``.
        stream: where records go.

    Returns:
        The resolved format name.

    Raises:
        ValueError: unknown format or level.
    """
    levelno = logging.getLevelName(level.upper())
    if not isinstance(levelno, int):
        raise ValueError(f"unknown log level {level!r}; expected debug, info, warning or error")
    stream = sys.stderr if stream is None else stream
    resolved = resolve_format(fmt, stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(make_formatter(resolved))
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if getattr(old, _HANDLER_MARK, False):
            old.close()
    root.addHandler(handler)
    root.setLevel(levelno)
    # grpc's C core logs through absl to stderr in its own format; keep it quiet unless debugging.
    logging.getLogger("grpc").setLevel(max(levelno, logging.WARNING))
    return resolved
