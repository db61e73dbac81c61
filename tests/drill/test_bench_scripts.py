"""The bench scripts' own arithmetic: what they hand to `trainguard ettr` is what they measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def test_checkpoint_components_count_the_hook_wait_once(tmp_path):
    # stall_tg_overlap_s is measured as the save call plus the optimizer pre-hook's wait; write_components added
    # the hook wait again, so the stall fed to the ETTR model was the visible stall plus one more wait.
    bc = _bench_module("bench_checkpoint")
    res = {"stall_tg_overlap_s": 0.010, "tg_overlap_hook_wait_s": 0.004}
    out = tmp_path / "ck.json"
    bc.write_components(str(out), res, gib=2.0, per_node_gib=4.0)
    data = json.loads(out.read_text())
    assert abs(data["trainguard"]["checkpoint_stall_s"] - 0.020) < 1e-9
