"""Fault facts as data: every shipped file validates through its loader, the loaders reject bad files, and the
predictor's rules agree with the Xid table they act on."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from trainguard.detectors.events import Action
from trainguard.faultfacts import FactFileError, shipped_fact_files
from trainguard.faultfacts.taxonomy import FaultClass, classify_stepfun, load_taxonomy
from trainguard.faultfacts.throttle import load_bad_throttle_reasons
from trainguard.faultfacts.xid import load_xid_catalog

LOADERS = {"xid.json": load_xid_catalog, "taxonomy.json": load_taxonomy,
           "throttle.json": load_bad_throttle_reasons}


def write(tmp_path, data) -> str:
    p = tmp_path / "facts.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(p)


def test_every_shipped_fact_file_has_a_loader_and_validates() -> None:
    files = shipped_fact_files()
    assert set(files) == set(LOADERS), f"fact files without a loader: {set(files) - set(LOADERS)}"
    for name in files:
        assert LOADERS[name](), f"{name} loaded empty"


def test_xid_table_covers_the_codes_that_end_training() -> None:
    codes, default = load_xid_catalog()
    for code in (48, 79, 95, 119, 140):
        assert codes[code].action == Action.DRAIN_NODE, code
    for code in (13, 31, 43, 94):
        assert codes[code].action == Action.RESTART_PROCESS, code
    assert default.action == Action.WATCH


def test_the_predictor_rules_act_only_on_xids_the_table_says_end_training() -> None:
    codes, _ = load_xid_catalog()
    text = resources.files("trainguard.predictor").joinpath("rules.json").read_text(encoding="utf-8")
    named = {int(n) for n in re.findall(r"gpu_xid_(\d+)_total", text)}
    assert named, "the predictor's rules name no Xid"
    # 63/64 (row remapping) escalate only together with 48: the rule needs both, the table marks 64 as fatal alone.
    for code in sorted(named - {63}):
        assert code in codes and codes[code].action == Action.DRAIN_NODE, (code, codes.get(code))


def test_throttle_bits_are_nvml_s() -> None:
    assert load_bad_throttle_reasons() == {"HwSlowdown": 0x8, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40,
                                           "HwPowerBrakeSlowdown": 0x80}


def test_taxonomy_classifies_by_most_specific_key() -> None:
    assert classify_stepfun("Hardware Failure", "GPU", "GPU Lost") == FaultClass.NODE_FAULT
    assert classify_stepfun("Hardware Failure", "Fan", "anything") == FaultClass.DEGRADED
    assert classify_stepfun("No Such Level", "x", "y") is None


def test_bad_fact_files_are_refused_naming_file_and_entry(tmp_path) -> None:
    entry = {"name": "n", "severity": "error", "action": "watch", "nvidia_action": "IGNORE", "description": "d"}
    with pytest.raises(FactFileError, match="decimal"):
        load_xid_catalog(write(tmp_path, {"default": entry, "codes": {"x1": entry}}))
    with pytest.raises(FactFileError, match="missing fields"):
        load_xid_catalog(write(tmp_path, {"default": entry, "codes": {"1": {"name": "n"}}}))
    with pytest.raises(FactFileError, match="unknown action"):
        load_xid_catalog(write(tmp_path, {"default": entry, "codes": {"1": {**entry, "action": "reboot"}}}))
    with pytest.raises(FactFileError, match="not valid JSON"):
        load_xid_catalog(write(tmp_path, "{"))
    with pytest.raises(FactFileError, match="bit 12 must be a single bit"):
        load_bad_throttle_reasons(write(tmp_path, {"bad_reasons": {"X": {"bit": 12, "description": "d"}}}))
    row = {"level": "L", "class": "C", "fault_class": "crash"}
    llama = {"categories": []}
    with pytest.raises(FactFileError, match="fault_class 'meltdown' is not one of"):
        load_taxonomy(write(tmp_path, {"stepfun": {"classes": [{**row, "fault_class": "meltdown"}]}, "llama3": llama}))
    with pytest.raises(FactFileError, match="appears twice"):
        load_taxonomy(write(tmp_path, {"stepfun": {"classes": [row, row]}, "llama3": llama}))
    with pytest.raises(FactFileError, match="count must be"):
        load_taxonomy(write(tmp_path, {"stepfun": {"classes": []}, "llama3": {"categories": [
            {"category": "x", "count": -1, "fault_class": "crash"}]}}))
