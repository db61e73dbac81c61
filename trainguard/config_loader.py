"""The one TOML loader of trainguard's configuration: file -> text -> document -> table -> typed dataclass.

The agent (:mod:`trainguard.agent.config`), the detectors (:mod:`trainguard.detectors.settings`) and the
checkpointer (:mod:`trainguard.checkpoint.config`) read their files with :func:`read_toml` and build their
dataclasses with :func:`build`, so every file gets the same checks and the same one-line errors:

- a missing, unreadable or directory path;
- bytes that are not UTF-8 (the byte offset and line are named);
- TOML syntax (the line and column named);
- a table that is not a table, unknown keys (with a "did you mean"), required keys left out;
- values of the wrong type, checked against the dataclass annotations: a boolean is not an integer, an integer
  is taken for a float, list items are checked one by one, sub-tables build nested dataclasses;
- ``nan`` and ``inf`` where a float goes, unless the field allows them (:func:`config_field`): TOML has both
  literals, and a NaN passes every range check written as ``if x < 0: refuse``.

Ranges and cross-field rules stay with each module's dataclass. Errors are of the class the caller passes (its
subsystem's :class:`~trainguard.errors.ConfigError` subclass) and read ``FILE: TABLE.KEY: what is wrong``.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import functools
import math
import os
import re
import select
import stat
import time
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from trainguard.errors import ConfigError

T = TypeVar("T")

# Field metadata keys read by the loader (set through config_field).
_NAN = "trainguard.config.allow_nan"
_INF = "trainguard.config.allow_inf"
_EXPECTED = "trainguard.config.expected"
_INTERNAL = "trainguard.config.internal"

_TOML_POSITION = re.compile(r"^(?P<reason>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def config_field(*, nan: bool = False, inf: bool = False, expected: str | None = None, internal: bool = False,
                 **kwargs: Any) -> Any:
    """A :func:`dataclasses.field` with what the loader needs to know about it.

    Args:
        nan: a TOML ``nan`` is accepted (e.g. a float whose NaN means "unset").
        inf: ``inf`` and ``-inf`` are accepted (e.g. a limit whose infinity means "no limit").
        expected: how errors describe a right value (``"an array of detector names"``) instead of the type's
            own words.
        internal: not settable from a file (the loader refuses the key as unknown); the program fills it.
        **kwargs: passed to :func:`dataclasses.field` (``default``, ``default_factory``, ``compare``...).
    """
    meta = dict(kwargs.pop("metadata", None) or {})
    meta.update({_NAN: nan, _INF: inf, _EXPECTED: expected, _INTERNAL: internal})
    return dataclasses.field(metadata=meta, **kwargs)


# ------------------------------------------------------------------------------------------------- the file
def read_bytes(path: str | os.PathLike[str], *, error: type[ConfigError] = ConfigError, what: str = "config file",
               flag: str | None = None) -> bytes:
    """The bytes of a config file.

    Args:
        path: the file.
        error: the exception class raised.
        what: how messages call the file (``"detector config file"``).
        flag: the option that named the file (``--config``), for the advice in messages.

    Raises:
        error: the file is missing, a directory, unreadable, larger than :data:`MAX_CONFIG_BYTES`, or a FIFO/pipe
            without content within :data:`PIPE_READ_TIMEOUT_S` (one line naming the path).
    """
    source = os.fspath(path)
    pass_one = f"pass an existing {flag} PATH" if flag else "check the path"
    try:
        # O_NONBLOCK: a named FIFO without a writer blocked the open forever (the command never started, nor said
        # why); a pipe with a writer (``--config <(envsubst < agent.toml.in)``) is still read, within a deadline.
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), source)
            if stat.S_ISREG(st.st_mode):
                if st.st_size > MAX_CONFIG_BYTES:
                    raise error(f"{source}: {st.st_size / 2**20:.0f} MiB is no {what} (at most "
                                f"{MAX_CONFIG_BYTES >> 20} MiB); check the path")
                os.set_blocking(fd, True)
                return _read_all(fd, source, error, what, deadline=None)
            return _read_all(fd, source, error, what, deadline=time.monotonic() + PIPE_READ_TIMEOUT_S)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise error(f"{source}: {what} not found; {pass_one}") from None
    except IsADirectoryError:
        takes = f"{flag} takes a TOML file" if flag else f"a {what} is a TOML file; check the path"
        raise error(f"{source}: is a directory; {takes}") from None
    except OSError as exc:
        raise error(f"{source}: cannot read {what} ({exc.strerror}); check its permissions") from exc


#: A config file is a few KiB; one this large is a wrong path (a log, a dataset), read whole into memory before.
MAX_CONFIG_BYTES = 4 << 20
#: How long a pipe or FIFO given as a config file may take to deliver its content.
PIPE_READ_TIMEOUT_S = 30.0


def _read_all(fd: int, source: str, error: type[ConfigError], what: str, deadline: float | None) -> bytes:
    """Reads ``fd`` to its end, at most :data:`MAX_CONFIG_BYTES`; a pipe (``deadline`` set) by then.

    Raises:
        error: the content is larger than the cap, a pipe delivers nothing before its deadline, or a FIFO has no
            writer (it reads as empty at once).
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise error(f"{source}: the pipe gave no end of its {what} within {PIPE_READ_TIMEOUT_S:g} s; "
                            "give a regular file")
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
        else:
            chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_CONFIG_BYTES:
            raise error(f"{source}: more than {MAX_CONFIG_BYTES >> 20} MiB is no {what}; check the path")
    if deadline is not None and not chunks:
        # a FIFO opened without a writer reads as empty at once: that is no config, not an empty one
        raise error(f"{source}: a FIFO or pipe that gave no bytes (no writer?); give a regular file")
    return b"".join(chunks)


def decode(raw: bytes, source: str, *, error: type[ConfigError] = ConfigError) -> str:
    """``raw`` as UTF-8 text (TOML is UTF-8 by definition), a leading byte-order mark dropped.

    Raises:
        error: bytes that are not UTF-8, naming the byte offset and the line.
    """
    try:
        # utf-8-sig: a byte-order mark (Windows editors save UTF-8 with one) is no TOML, and tomllib said
        # "Invalid statement (at line 1, column 1)" of a file that looks right in every editor
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise error(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start}, line {line}); save the file as "
                    "UTF-8") from exc


def parse(text: str, source: str, *, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The TOML document ``text``.

    Raises:
        error: a syntax error, as ``SOURCE: not valid TOML at line L, column C: reason``.
    """
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = _TOML_POSITION.match(str(exc))
        where = f" at line {found['line']}, column {found['col']}" if found else ""
        reason = found["reason"] if found else str(exc)
        raise error(f"{source}: not valid TOML{where}: {reason}; fix the file") from exc
    except ValueError as exc:
        # tomllib lets int()'s own limit through: an integer literal of more than 4300 digits raised ValueError
        # past every caller's ConfigError handling (a traceback instead of a line naming the file)
        raise error(f"{source}: not valid TOML: {exc.args[0].split(':')[0]} (an integer literal far too long); fix "
                    "the file") from exc


def read_toml(path: str | os.PathLike[str], *, error: type[ConfigError] = ConfigError, what: str = "config file",
              flag: str | None = None) -> dict[str, Any]:
    """Reads, decodes and parses a TOML file (:func:`read_bytes`, :func:`decode`, :func:`parse`).

    Raises:
        error: missing, unreadable, not UTF-8 or not TOML.
    """
    source = os.fspath(path)
    return parse(decode(read_bytes(source, error=error, what=what, flag=flag), source, error=error), source,
                 error=error)


def select_table(document: Mapping[str, Any], table: str, source: str, *,
                 error: type[ConfigError] = ConfigError) -> Mapping[str, Any] | None:
    """The table ``table`` (dotted for a sub-table: ``"a.b"``) of a document, or None when the file has none.

    Raises:
        error: the key is there but is not a table.
    """
    current: Any = document
    for depth, part in enumerate(table.split(".")):
        if part not in current:
            return None
        current = current[part]
        if not isinstance(current, Mapping):
            name = ".".join(table.split(".")[:depth + 1])
            raise error(f"{_prefix(source)}{name}: expected a table [{name}], got {describe(current)}")
    return current


# ------------------------------------------------------------------------------------------------- values
#: A URL's start (``scheme://``): taken for a path, ``file:///sys`` became the relative ``file:/sys``.
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path_problem(value: str) -> str | None:
    """Why ``value`` cannot be a local absolute path, as the end of a message (``"is a URL; ..."``), or None.

    Every path a daemon reads is resolved against the folder it started in (``/`` under systemd), so a relative
    one names another place than the operator meant, and a URL one that does not exist.
    """
    if URL_RE.match(value):
        return "is a URL; give a local absolute path"
    if not os.path.isabs(value):
        return "is a relative path; give an absolute one"
    return None


def type_name(value: Any) -> str:
    """How messages call the type of a TOML value (``"an integer"``)."""
    if value is None:
        return "nothing"
    if isinstance(value, Mapping):
        return "a table"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            tuple: "an array"}.get(type(value), type(value).__name__)


def describe(value: Any) -> str:
    """``an integer 7350``: a value's type and (shortened) text, for "got ..." in messages."""
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type_name(value)} {text}"


def suggest(name: str, known: typing.Iterable[str]) -> str:
    """``" did you mean 'listen'?"`` for the known name closest to ``name``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" did you mean '{close[0]}'?" if close else ""


def check_value(value: Any, hint: Any, key: str, *, source: str = "", error: type[ConfigError] = ConfigError,
                field: dataclasses.Field[Any] | None = None) -> Any:
    """Checks ``value`` against the annotation ``hint`` and returns it as the field holds it.

    An integer becomes a float where a float goes, an array a tuple where a tuple goes, and a table the nested
    dataclass (built by :func:`build`) where one goes.

    Args:
        value: the value as read.
        hint: the field's resolved annotation (``int``, ``list[str]``, ``str | None``, a dataclass...).
        key: its dotted name in the file (``grpc.listen``, ``coordinator.addresses[1]``), for messages.
        source: the file, first in messages.
        error: the exception class raised.
        field: the dataclass field, for what :func:`config_field` set on it.

    Raises:
        error: a value of the wrong type, or nan/inf where the field does not allow them.
    """
    meta = field.metadata if field is not None else {}

    def wrong(expected: str) -> ConfigError:
        return error(f"{_prefix(source)}{key}: expected {meta.get(_EXPECTED) or expected}, got {describe(value)}")

    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        if value is None and len(others) < len(args):
            return None
        if len(others) != 1:
            raise TypeError(f"unsupported config annotation {hint!r} for {key}")  # a bug in the dataclass
        return check_value(value, others[0], key, source=source, error=error, field=field)
    if hint is bool:
        if not isinstance(value, bool):
            raise wrong("a boolean (true or false)")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range (~1.8e308): float() raises instead of giving inf
            raise wrong("a number within a float's range") from None
        if math.isnan(number) and not meta.get(_NAN):
            raise wrong("a finite number (nan is not allowed here)")
        if math.isinf(number) and not meta.get(_INF):
            raise wrong("a finite number (inf is not allowed here)")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if origin in (list, tuple):
        item = args[0] if args else Any
        if not isinstance(value, (list, tuple)):
            raise wrong(f"an array{_of(item)}")
        # Items get the field's nan/inf rules but not its words: those describe the whole array.
        item_field = _without_expected(field)
        items = [check_value(v, item, f"{key}[{i}]", source=source, error=error, field=item_field)
                 for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        value_hint = args[1] if len(args) == 2 else Any
        if not isinstance(value, Mapping):
            raise wrong("a table")
        return {str(k): check_value(v, value_hint, f"{key}.{k}", source=source, error=error)
                for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise wrong(f"a table [{key}] of {', '.join(_settable(hint))}")
        return build(hint, value, source=source, table=key, error=error)
    raise TypeError(f"unsupported config annotation {hint!r} for {key}")  # a bug in the dataclass


def build(cls: type[T], data: Mapping[str, Any], *, source: str = "", table: str = "",
          error: type[ConfigError] = ConfigError, extra: Mapping[str, Any] | None = None) -> T:
    """Builds the dataclass ``cls`` from a table, checking every key and type (not ranges: the class does).

    Args:
        cls: the dataclass; its resolved annotations say what each key takes.
        data: the table as parsed.
        source: the file, first in messages (``""``: none).
        table: the table's dotted name (``"grpc"``, ``"checkpoint.disk"``; ``""`` for the top level).
        error: the exception class raised.
        extra: constructor arguments the program sets (fields made with ``config_field(internal=True)``).

    Returns:
        The instance (its ``__post_init__``, if any, has run).

    Raises:
        error: ``data`` not a table, an unknown key, a required key left out, or a value of the wrong type.
    """
    if not isinstance(data, Mapping):
        name = table or "the document"
        raise error(f"{_prefix(source)}{name}: expected a table [{name}] of {', '.join(_settable(cls))}, got "
                    f"{describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    settable = _settable(cls)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in settable:
            raise error(f"{_prefix(source)}{_unknown(key, value, table)};{suggest(key, settable)} known "
                        f"{_known_what(cls, hints)}: {', '.join(settable)}")
        dotted = f"{table}.{key}" if table else key
        kwargs[key] = check_value(value, hints[key], dotted, source=source, error=error, field=fields[key])
    for name in settable:
        f = fields[name]
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            where = f"[{table}]" if table else "the top level"
            raise error(f"{_prefix(source)}{f'{table}.{name}' if table else name}: required key missing from "
                        f"{where}; set it")
    return cls(**kwargs, **dict(extra or {}))


def check_fields(obj: Any, table: str, *, source: str = "", error: type[ConfigError] = ConfigError) -> None:
    """Checks every settable field of an already built dataclass as :func:`build` checks a file's values.

    For objects made in code (``CheckpointConfig(directory=5)``) rather than read from a file.

    Raises:
        error: the first field whose value is of the wrong type or a refused nan/inf.
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in _settable(type(obj)):
            check_value(getattr(obj, f.name), hints[f.name], f"{table}.{f.name}" if table else f.name,
                        source=source, error=error, field=f)


# ------------------------------------------------------------------------------------------------- helpers
def _prefix(source: str) -> str:
    return f"{source}: " if source else ""


def _unknown(key: str, value: Any, table: str) -> str:
    if not table:
        return f"unknown table [{key}]" if isinstance(value, Mapping) else f"unknown key '{key}' at the top level"
    return f"unknown key '{key}' in [{table}]"


def _known_what(cls: type, hints: Mapping[str, Any]) -> str:
    tables = [dataclasses.is_dataclass(hints[name]) for name in _settable(cls)]
    return "tables" if all(tables) else "tables and keys" if any(tables) else "keys"


def _of(item: Any) -> str:
    words = {str: " of strings", int: " of integers", float: " of numbers", bool: " of booleans"}
    return words.get(item, "")


def _without_expected(field: dataclasses.Field[Any] | None) -> dataclasses.Field[Any] | None:
    if field is None or not field.metadata.get(_EXPECTED):
        return field
    return config_field(nan=bool(field.metadata.get(_NAN)), inf=bool(field.metadata.get(_INF)))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _settable(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get(_INTERNAL))


__all__ = ["URL_RE", "build", "check_fields", "check_value", "config_field", "decode", "describe",
           "local_path_problem", "parse", "read_bytes", "read_toml", "select_table", "suggest", "type_name"]
