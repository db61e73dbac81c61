"""Rules as data: the JSON files shipped in this package, and their loaders with strict validation.

Files (one schema each, named by :data:`SCHEMAS`):

``kmsg.json``
    Kernel log patterns: ``{"rules": [{"name", "pattern", "kind", "severity", "action", "message",
    "subject"?, "lookup"?}]}``. ``pattern`` is a Python regex searched in the record's message; ``message`` is a
    ``str.format`` template over the pattern's named groups; ``subject`` names the group that identifies the
    device or process; ``lookup: "xid"`` takes severity and action from the Xid table by the ``xid`` group (the
    fault facts' ``xid.json``: :mod:`trainguard.faultfacts.xid`).
``counters.json``
    Counter thresholds: ``{"rules": [{"source", "counter", "mode", "threshold", "kind", "severity", "action",
    "description"}]}``; ``source`` is ``ib_counters``, ``ib_hw_counters``, ``netdev`` or ``ethtool``;
    ``counter`` an exact name or a regex when it starts with ``^``; ``mode`` ``delta`` (increase within one
    sample above ``threshold``) or ``rate`` (increase per second above ``threshold``).

Operators may pass their own file of the same schema in a detector's config; it is validated the same way.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from collections.abc import Callable
from importlib import resources
from typing import Any

from trainguard.detectors.errors import DetectorConfigError, RuleFileError
from trainguard.detectors.events import Action, Severity
from trainguard.faultfacts import FactFileError, check_fields, read_fact_file

_KIND = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def check_operator_file(key: str, path: str, load: Callable[[str], object]) -> None:
    """Loads an operator's rule or fact file named by a detector's config, so that a bad one is a config error
    when the settings are read (it was found only when the detector was built: ``trainguard run`` had already
    registered with the coordinator, and the error named neither the table nor the key).

    Args:
        key: the config field, e.g. ``"kmsg.rules_file"``.
        path: the file; empty for the shipped one (nothing to check).
        load: the loader (:func:`load_kmsg_rules`, :func:`load_counter_rules`, ``load_xid_catalog``).

    Raises:
        DetectorConfigError: the file cannot be read or is invalid; names the key.
    """
    if not path:
        return
    try:
        load(path)
    except (RuleFileError, FactFileError) as exc:
        raise DetectorConfigError(f"{key}={path!r}: {exc}") from exc


@dataclass(frozen=True)
class KmsgRule:
    """One kernel log pattern.

    Attributes:
        name: unique rule name.
        pattern: compiled regex, searched in each record's message.
        kind: event kind.
        severity: event severity (overridden by the Xid catalog when ``lookup == "xid"``).
        action: recommended action (same).
        message: ``str.format`` template over the named groups.
        subject: named group giving the event subject, or empty.
        lookup: ``"xid"`` or empty.
    """

    name: str
    pattern: re.Pattern[str]
    kind: str
    severity: Severity
    action: Action
    message: str
    subject: str = ""
    lookup: str = ""


@dataclass(frozen=True)
class CounterRule:
    """A threshold on a hardware counter.

    Attributes:
        source: ``ib_counters``, ``ib_hw_counters``, ``netdev`` or ``ethtool``.
        counter: exact name, or a regex when it starts with ``^``.
        mode: ``delta`` or ``rate``.
        threshold: events when the delta (count) or rate (per second) exceeds it.
        kind: event kind.
        severity: event severity.
        action: recommended action.
        description: one line.
    """

    source: str
    counter: str
    mode: str
    threshold: float
    kind: str
    severity: Severity
    action: Action
    description: str

    def matches(self, name: str) -> bool:
        """Whether counter ``name`` is governed by this rule.

        Args:
            name: counter name.

        Returns:
            True on an exact match, or a regex match when :attr:`counter` starts with ``^``.
        """
        if self.counter.startswith("^"):
            return re.match(self.counter, name, re.ASCII) is not None
        return name == self.counter


#: File name -> loader of that schema; the shipped-rules test validates every file through it.
SCHEMAS = ("kmsg.json", "counters.json")
COUNTER_SOURCES = ("ib_counters", "ib_hw_counters", "netdev", "ethtool")


def _read(path: str | None, default_name: str) -> tuple[str, Any]:
    try:
        return read_fact_file(path, default_name, package=__name__)
    except FactFileError as exc:
        raise RuleFileError(str(exc).replace("fact file", "rule file", 1)) from exc


def _fields(label: str, where: str, obj: Any, required: set[str], optional: set[str] = frozenset()) -> dict:
    try:
        return check_fields(label, where, obj, required, optional)
    except FactFileError as exc:
        raise RuleFileError(str(exc)) from exc


def _enums(label: str, where: str, obj: dict) -> tuple[Severity, Action]:
    try:
        return Severity.parse(str(obj["severity"])), Action.parse(str(obj["action"]))
    except ValueError as exc:
        raise RuleFileError(f"{label}: {where}: {exc}") from exc


def _kind(label: str, where: str, kind: Any) -> str:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise RuleFileError(f"{label}: {where}: kind {kind!r} must be dotted lower-case like 'gpu.xid'")
    return kind


def load_kmsg_rules(path: str | None = None) -> list[KmsgRule]:
    """Loads kernel log rules.

    Args:
        path: an operator's rule file; the shipped ``kmsg.json`` when None.

    Returns:
        The rules, in file order.

    Raises:
        RuleFileError: unreadable file or an invalid rule.
    """
    label, data = _read(path, "kmsg.json")
    _fields(label, "top level", data, {"rules"}, {"comment"})
    rules: list[KmsgRule] = []
    names: set[str] = set()
    for i, raw in enumerate(data["rules"]):
        where = f"rule {i}"
        r = _fields(label, where, raw, {"name", "pattern", "kind", "severity", "action", "message"},
                    {"subject", "lookup", "comment", "examples"})
        if r["name"] in names:
            raise RuleFileError(f"{label}: rule name {r['name']!r} appears twice")
        names.add(r["name"])
        try:
            # ASCII: kernel messages print ASCII digits, and '\\d' also matched '٧٩' (Arabic-Indic) or '７９'
            # (fullwidth), which int() read as Xid 79: a drain on text no driver prints.
            pattern = re.compile(r["pattern"], re.ASCII)
        except re.error as exc:
            raise RuleFileError(f"{label}: {where} ({r['name']}): bad regex: {exc}") from exc
        groups = set(pattern.groupindex)
        try:
            used = {f[1] for f in string.Formatter().parse(r["message"]) if f[1]}
        except ValueError as exc:  # a lone '{': a ValueError out of the settings check, naming no file
            raise RuleFileError(f"{label}: {r['name']}: message {r['message'][:60]!r}: {exc}") from exc
        if used - groups:
            raise RuleFileError(f"{label}: {r['name']}: message uses groups {sorted(used - groups)} not in pattern")
        try:
            # The groups are strings: '{}', '{dev:d}' or '{dev!z}' passed the check above and raised out of every
            # sample with a matching record.
            r["message"].format(**{g: "" for g in groups})
        except (ValueError, IndexError, KeyError, AttributeError, TypeError) as exc:
            raise RuleFileError(f"{label}: {r['name']}: message {r['message'][:60]!r} cannot be formatted with "
                                f"the pattern's named groups (strings): {exc!r}") from exc
        subject = r.get("subject", "")
        if subject and subject not in groups:
            raise RuleFileError(f"{label}: {r['name']}: subject group {subject!r} not in pattern")
        lookup = r.get("lookup", "")
        if lookup not in ("", "xid") or (lookup == "xid" and "xid" not in groups):
            raise RuleFileError(f"{label}: {r['name']}: lookup must be 'xid' with an 'xid' group, or absent")
        for example in r.get("examples", []):
            if not pattern.search(example):
                raise RuleFileError(f"{label}: {r['name']}: pattern does not match its example {example!r}")
        severity, action = _enums(label, r["name"], r)
        rules.append(KmsgRule(r["name"], pattern, _kind(label, r["name"], r["kind"]), severity, action,
                              r["message"], subject, lookup))
    return rules


def load_counter_rules(path: str | None = None) -> list[CounterRule]:
    """Loads counter threshold rules.

    Args:
        path: an operator's file; the shipped ``counters.json`` when None.

    Returns:
        The rules.

    Raises:
        RuleFileError: unreadable file or an invalid rule.
    """
    label, data = _read(path, "counters.json")
    _fields(label, "top level", data, {"rules"}, {"comment"})
    rules: list[CounterRule] = []
    for i, raw in enumerate(data["rules"]):
        r = _fields(label, f"rule {i}", raw,
                    {"source", "counter", "mode", "threshold", "kind", "severity", "action", "description"})
        where = f"rule {i} ({r['counter']})"
        if r["source"] not in COUNTER_SOURCES:
            raise RuleFileError(f"{label}: {where}: source {r['source']!r} is not one of {COUNTER_SOURCES}")
        if r["mode"] not in ("delta", "rate"):
            raise RuleFileError(f"{label}: {where}: mode must be 'delta' or 'rate'")
        if not isinstance(r["threshold"], (int, float)) or r["threshold"] < 0:
            raise RuleFileError(f"{label}: {where}: threshold must be a number >= 0")
        if r["counter"].startswith("^"):
            try:
                re.compile(r["counter"], re.ASCII)
            except re.error as exc:
                raise RuleFileError(f"{label}: {where}: bad regex: {exc}") from exc
        severity, action = _enums(label, where, r)
        rules.append(CounterRule(r["source"], r["counter"], r["mode"], float(r["threshold"]),
                                 _kind(label, where, r["kind"]), severity, action, r["description"]))
    return rules


#: Loader of each shipped file, by file name.
LOADERS = {"kmsg.json": load_kmsg_rules, "counters.json": load_counter_rules}


def shipped_rule_files() -> list[str]:
    """Names of every ``*.json`` file shipped in this package."""
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))
