"""The ETTR model's fail-slow term: without detection the job runs at the straggler's pace while any slow node is
in; detection pays a short slow spell plus one replacement, and only when the episode would outlast it."""

from __future__ import annotations

import math

import pytest

from trainguard.drill.errors import ComponentsError
from trainguard.drill.ettr import FailSlow, failslow_loss, with_failslow

DAY = 86400.0


def test_never_ending_undetected_episodes_slow_the_whole_run():
    assert failslow_loss(1, FailSlow(rate_per_node_day=0.01, slowdown=2.0, detect_s=None)) == pytest.approx(0.5)


def test_undetected_finite_episodes_slow_the_share_of_time_some_node_is_slow():
    fs = FailSlow(rate_per_node_day=1.0, slowdown=2.0, episode_s=3600.0, detect_s=None)
    rate = 100 / DAY
    assert failslow_loss(100, fs) == pytest.approx((1 - math.exp(-rate * 3600)) * 0.5)


def test_detection_costs_the_detection_spell_and_the_replacements():
    fs = FailSlow(rate_per_node_day=1.0, slowdown=2.0, episode_s=3600.0, detect_s=10.0, mitigate_s=120.0)
    rate = 100 / DAY
    expect = 1 - (1 - rate * 120) * (1 - (1 - math.exp(-rate * 10)) * 0.5)
    assert failslow_loss(100, fs) == pytest.approx(expect)
    assert failslow_loss(100, fs) < failslow_loss(100, FailSlow(1.0, 2.0, 3600.0, None))


def test_short_episodes_are_not_worth_a_replacement():
    fs = FailSlow(rate_per_node_day=1.0, slowdown=1.5, episode_s=60.0, detect_s=10.0, mitigate_s=120.0)
    none = FailSlow(rate_per_node_day=1.0, slowdown=1.5, episode_s=60.0, detect_s=None)
    assert failslow_loss(10, fs) == pytest.approx(failslow_loss(10, none))


def test_with_failslow_scales_ettr_and_bad_inputs_name_the_field():
    assert with_failslow(0.99, 100, FailSlow(rate_per_node_day=0.0)) == 0.99
    with pytest.raises(ComponentsError, match="slowdown"):
        FailSlow(slowdown=0.5)
    with pytest.raises(ComponentsError, match="detect_s"):
        FailSlow(detect_s=-1.0)
