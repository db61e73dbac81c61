"""Every shipped rule file is valid, and the validators reject each kind of bad rule."""

from __future__ import annotations

import json

import pytest

from trainguard.detectors.errors import RuleFileError
from trainguard.detectors.events import Action
from trainguard.detectors.rules import (
    LOADERS,
    load_counter_rules,
    load_kmsg_rules,
    load_xid_catalog,
    shipped_rule_files,
)


def test_every_shipped_rule_file_has_a_schema_and_validates() -> None:
    files = shipped_rule_files()
    assert set(files) == set(LOADERS), f"rule files without a loader: {set(files) - set(LOADERS)}"
    for name in files:
        assert LOADERS[name](), f"{name} loaded empty"


def test_xid_catalog_covers_the_codes_that_end_training() -> None:
    codes, default = load_xid_catalog()
    for code in (48, 79, 95, 119, 140):
        assert codes[code].action == Action.DRAIN_NODE, code
    for code in (13, 31, 43, 94):
        assert codes[code].action == Action.RESTART_PROCESS, code
    assert default.action == Action.WATCH


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


def test_xid_and_counter_validation_reject(tmp_path) -> None:
    entry = {"name": "n", "severity": "error", "action": "watch", "nvidia_action": "IGNORE", "description": "d"}
    with pytest.raises(RuleFileError, match="decimal"):
        load_xid_catalog(write(tmp_path, {"default": entry, "codes": {"x1": entry}}))
    with pytest.raises(RuleFileError, match="missing fields"):
        load_xid_catalog(write(tmp_path, {"default": entry, "codes": {"1": {"name": "n"}}}))
    rule = {"source": "ib_counters", "counter": "symbol_error", "mode": "rate", "threshold": 1, "kind": "a.b",
            "severity": "warning", "action": "watch", "description": "d"}
    assert load_counter_rules(write(tmp_path, {"rules": [rule]}))[0].matches("symbol_error")
    for change, needle in (({"source": "snmp"}, "source"), ({"mode": "avg"}, "mode"),
                           ({"threshold": -1}, "threshold"), ({"counter": "^rx_prio(\\d"}, "bad regex")):
        with pytest.raises(RuleFileError, match=needle):
            load_counter_rules(write(tmp_path, {"rules": [{**rule, **change}]}))
