"""Rules tier: every shipped rule fires on its fault and stays quiet on a healthy node; bad files refused."""

from __future__ import annotations

import json

import pytest

from trainguard.detectors.events import Action, Severity
from trainguard.predictor.errors import RuleFileError
from trainguard.predictor.rules import RulesTier

HEALTHY = {
    **{f"gpu_xid_{n}_total": 0.0 for n in (48, 63, 64, 74, 79, 95, 119, 120, 140)},
    "pcie_aer_fatal_total": 0.0, "pcie_link_width": 16.0, "pcie_link_width_max": 16.0, "nic_up": 1.0,
}
FAULTS = {
    "xid48-with-row-remap": {"gpu_xid_48_total": 1.0, "gpu_xid_63_total": 1.0},
    "xid64-row-remap-failure": {"gpu_xid_64_total": 1.0},
    "xid74-nvlink-error": {"gpu_xid_74_total": 2.0},
    "xid79-fell-off-bus": {"gpu_xid_79_total": 1.0},
    "xid95-uncontained-ecc": {"gpu_xid_95_total": 1.0},
    "xid119-120-gsp-error": {"gpu_xid_120_total": 1.0},
    "xid140-unrecovered-ecc": {"gpu_xid_140_total": 1.0},
    "aer-fatal": {"pcie_aer_fatal_total": 1.0},
    "pcie-link-width-degraded": {"pcie_link_width": 8.0},
    "nic-down": {"nic_up": 0.0},
}


def test_every_shipped_rule_is_exercised():
    names = {r["name"] for r in RulesTier.load().rules}
    assert names == set(FAULTS)


@pytest.mark.parametrize("rule", sorted(FAULTS))
def test_shipped_rule_fires_on_its_fault_only(rule):
    tier = RulesTier.load()
    assert tier.evaluate(0.0, "n", HEALTHY) == []
    assert tier.evaluate(5.0, "n", HEALTHY) == []
    hits = tier.evaluate(10.0, "n", {**HEALTHY, **FAULTS[rule]})
    assert rule in [h.rule for h in hits]
    hit = next(h for h in hits if h.rule == rule)
    assert hit.severity is Severity.CRITICAL and hit.action is Action.DRAIN_NODE and hit.evidence


def test_counter_rules_fire_once_per_increase_and_xid48_needs_a_remap():
    tier = RulesTier.load()
    tier.evaluate(0.0, "n", HEALTHY)
    assert [h.rule for h in tier.evaluate(5.0, "n", {**HEALTHY, "gpu_xid_79_total": 1.0})] == ["xid79-fell-off-bus"]
    assert tier.evaluate(10.0, "n", {**HEALTHY, "gpu_xid_79_total": 1.0}) == []  # no new XID
    assert tier.evaluate(15.0, "n", {**HEALTHY, "gpu_xid_79_total": 1.0, "gpu_xid_48_total": 1.0}) == []
    hits = tier.evaluate(20.0, "n", {**HEALTHY, "gpu_xid_79_total": 1.0, "gpu_xid_48_total": 1.0,
                                     "gpu_xid_64_total": 1.0})
    assert {"xid48-with-row-remap", "xid64-row-remap-failure"} <= {h.rule for h in hits}


def test_absent_metrics_are_reported_not_guessed():
    tier = RulesTier.load()
    assert tier.evaluate(0.0, "n", {}) == []
    missing = tier.unevaluable(["nic_up", "gpu_xid_79_total"])
    assert "nic-down" not in missing and "xid79-fell-off-bus" not in missing and "aer-fatal" in missing


@pytest.mark.parametrize(
    "doc, needle",
    [
        ({"rules": [{"name": "x", "description": "d", "severity": "critical", "action": "drain-node",
                     "when": {"metric": "m", "op": "explodes"}}]}, "unknown operator"),
        ({"rules": [{"name": "x", "severity": "critical", "action": "drain-node",
                     "when": {"metric": "m", "op": "increased"}}]}, "missing 'description'"),
        ({"rules": [{"name": "x", "description": "d", "severity": "awful", "action": "drain-node",
                     "when": {"metric": "m", "op": "increased"}}]}, "unknown severity"),
        ({"rules": [{"name": "x", "description": "d", "severity": "critical", "action": "drain-node",
                     "when": {"metric": "m", "op": "gt"}}]}, "needs 'value'"),
        ({"rules": [{"name": "x", "description": "d", "severity": "critical", "action": "drain-node",
                     "when": {"all": []}}]}, "non-empty"),
        ({"no_rules": []}, "'rules' list"),
    ],
)
def test_bad_rule_files(tmp_path, doc, needle):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(RuleFileError, match=needle):
        RulesTier.load(p)
    p.write_text("{not json")
    with pytest.raises(RuleFileError, match="not valid JSON"):
        RulesTier.load(p)


def test_a_counter_standing_at_the_first_sample_is_a_baseline_not_an_alarm():
    """A restarted agent (or a metrics file starting mid-life) first read a node's old fatal counters, an XID 79
    or an AER fatal error handled days ago, as an increase from 0 and drained the node again at once."""
    tier = RulesTier.load()
    old = {**HEALTHY, "gpu_xid_79_total": 3.0, "pcie_aer_fatal_total": 2.0, "gpu_xid_48_total": 1.0,
           "gpu_xid_63_total": 1.0}
    assert tier.evaluate(0.0, "n", old) == []
    assert tier.evaluate(5.0, "n", old) == []
    assert [h.rule for h in tier.evaluate(10.0, "n", {**old, "gpu_xid_79_total": 4.0})] == ["xid79-fell-off-bus"]
    # a counter that fell started again (a reboot): its new value is the baseline, a rise from it an increase
    assert tier.evaluate(15.0, "n", {**old, "gpu_xid_79_total": 1.0}) == []
    assert [h.rule for h in tier.evaluate(20.0, "n", {**old, "gpu_xid_79_total": 2.0})] == ["xid79-fell-off-bus"]
    # a first reading that is no number sets no baseline: the first number is the baseline
    assert tier.evaluate(0.0, "m", {**HEALTHY, "gpu_xid_95_total": float("nan")}) == []
    assert tier.evaluate(5.0, "m", {**HEALTHY, "gpu_xid_95_total": 5.0}) == []
    assert [h.rule for h in tier.evaluate(10.0, "m", {**HEALTHY, "gpu_xid_95_total": 6.0})] == \
        ["xid95-uncontained-ecc"]


def test_counters_declared_from_zero_alarm_at_their_first_reading():
    """The agent's own event counts start at 0 with it: a Xid counted before the first score is new."""
    tier = RulesTier.load()
    tier.count_from_zero(["gpu_xid_*_total"])
    hits = tier.evaluate(0.0, "n", {**HEALTHY, "gpu_xid_79_total": 1.0, "pcie_aer_fatal_total": 1.0})
    assert [h.rule for h in hits] == ["xid79-fell-off-bus"]  # the AER counter is read from sysfs: a baseline
    assert tier.evaluate(5.0, "n", {**HEALTHY, "gpu_xid_79_total": 1.0, "pcie_aer_fatal_total": 1.0}) == []


def test_forgotten_node_comes_back_without_its_old_state():
    """``PredictorRuntime.forget`` kept the rules tier's state: a node that left and came back compared its
    counters with the values it left with, and an increase from before it left was still within
    ``increased_within`` (here a Xid 48 seen before it left joined a Xid 63 after it came back)."""
    from trainguard.predictor.runtime import PredictorRuntime

    rt = PredictorRuntime(None)
    rt.observe(0.0, "n", HEALTHY)
    assert rt.observe(100.0, "n", {**HEALTHY, "gpu_xid_48_total": 1.0}).alarm is False  # 48 alone: no rule
    rt.forget("n")
    # back, its clock and counters started again: nothing from before it left may combine with what comes now
    assert rt.observe(50.0, "n", {**HEALTHY, "gpu_xid_48_total": 0.0, "gpu_xid_63_total": 2.0}).alarm is False
    assert rt.observe(60.0, "n", {**HEALTHY, "gpu_xid_48_total": 0.0, "gpu_xid_63_total": 3.0}).alarm is False
