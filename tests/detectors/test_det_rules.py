"""Every shipped rule file is valid, and the validators reject each kind of bad rule."""

from __future__ import annotations

import json

import pytest

from trainguard.detectors.errors import RuleFileError
from trainguard.detectors.rules import (
    LOADERS,
    load_counter_rules,
    load_kmsg_rules,
    shipped_rule_files,
)


def test_every_shipped_rule_file_has_a_schema_and_validates() -> None:
    files = shipped_rule_files()
    assert set(files) == set(LOADERS), f"rule files without a loader: {set(files) - set(LOADERS)}"
    for name in files:
        assert LOADERS[name](), f"{name} loaded empty"


def write(tmp_path, data) -> str:
    p = tmp_path / "rules.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(p)


GOOD = {"name": "x", "pattern": "boom (?P<dev>\\w+)", "kind": "hw.boom", "severity": "error", "action": "watch",
        "message": "boom on {dev}"}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"pattern": "boom ("}, "bad regex"),
        ({"kind": "Boom"}, "dotted lower-case"),
        ({"severity": "fatal"}, "unknown severity"),
        ({"action": "reboot"}, "unknown action"),
        ({"message": "boom on {device}"}, "not in pattern"),
        ({"message": "boom on {}"}, "cannot be formatted"),  # these three raised out of every matching sample
        ({"message": "boom on {dev:d}"}, "cannot be formatted"),
        ({"message": "boom on {dev!z}"}, "cannot be formatted"),
        ({"message": "boom on {"}, "Single '{'"),  # a ValueError, not a rule file error
        ({"subject": "nope"}, "subject group"),
        ({"extra": 1}, "unknown fields"),
        ({"examples": ["no match here"]}, "does not match its example"),
        ({"lookup": "xid"}, "lookup must be"),
    ],
)
def test_kmsg_rule_validation_rejects(tmp_path, change, needle) -> None:
    with pytest.raises(RuleFileError, match=needle):
        load_kmsg_rules(write(tmp_path, {"rules": [{**GOOD, **change}]}))


def test_kmsg_rule_names_unique_and_json_syntax(tmp_path) -> None:
    with pytest.raises(RuleFileError, match="twice"):
        load_kmsg_rules(write(tmp_path, {"rules": [GOOD, GOOD]}))
    with pytest.raises(RuleFileError, match="not valid JSON"):
        load_kmsg_rules(write(tmp_path, '{"rules": [}'))
    with pytest.raises(RuleFileError, match="cannot be read"):
        load_kmsg_rules(str(tmp_path / "missing.json"))


def test_counter_validation_rejects(tmp_path) -> None:
    rule = {"source": "ib_counters", "counter": "symbol_error", "mode": "rate", "threshold": 1, "kind": "a.b",
            "severity": "warning", "action": "watch", "description": "d"}
    assert load_counter_rules(write(tmp_path, {"rules": [rule]}))[0].matches("symbol_error")
    for change, needle in (({"source": "snmp"}, "source"), ({"mode": "avg"}, "mode"),
                           ({"threshold": -1}, "threshold"), ({"counter": "^rx_prio(\\d"}, "bad regex")):
        with pytest.raises(RuleFileError, match=needle):
            load_counter_rules(write(tmp_path, {"rules": [{**rule, **change}]}))
