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


def test_checkpoint_throughput_window_holds_the_whole_persist(tmp_path):
    # The throughput run stopped its clock after the last step while the throttled persist of the last saves
    # still ran in the background, so its cost fell outside the window (throttled saves came out faster than no
    # saves). The window now closes only once the last checkpoint is durable, with training going on meanwhile.
    import torch

    from trainguard.checkpoint import CheckpointConfig, Checkpointer

    bc = _bench_module("bench_checkpoint")
    state = {"w": torch.ones(512, 1024)}  # 2 MiB, persisted at 2 MiB/s: about a second per save
    steps_run = []

    def one_step() -> None:
        state["w"].add_(1.0)
        steps_run.append(1)

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), memory={"directory": str(tmp_path / "shm")},
                           disk={"keep": 1}, persist={"bandwidth_mib_s": 2.0})
    with Checkpointer(cfg, job="bench-test") as ck:
        ck.prepare(state)
        done, _ = bc.timed_steps(one_step, ck, lambda s: state, opt, steps=2, every=1)
        assert ck.wait(timeout=0), "the timed window closed before the last checkpoint was durable"
    assert done == len(steps_run) >= 2


def test_failslow_overhead_counts_the_heartbeat_steps():
    # The heartbeat RPC runs on the hook's thread every 250 ms, inside about one step of 50; a median of per-step
    # CPU dropped it, so 'step_done only' showed the bookkeeping and none of the RPC. CPU is now the mean of
    # whole-block totals.
    bf = _bench_module("bench_failslow")
    bare = [(0.005, 0.004)] * 100
    beat = [(0.005, 0.004)] * 98 + [(0.006, 0.005)] * 2  # two steps carried a heartbeat: 1 ms CPU each
    res = {"bare": bare, "heartbeat": beat, "hooked": beat, "heartbeats_sent": 4, "steps_reported": 200,
           "cpu_total_s": {"bare": 0.4, "heartbeat": 0.402, "hooked": 0.402}}
    doc = bf.summarise_overhead(res)
    assert abs(doc["heartbeat_overhead_cpu_pct"] - 0.5) < 1e-6
    assert abs(doc["cpu_us_per_heartbeat"] - 1000.0) < 1e-6
    assert doc["heartbeat"]["wall_ms"] == 5.0  # wall stays the median step


def test_bench_ettr_bad_input_is_one_line(tmp_path):
    # A missing trace or a folder as --json ended bench_ettr.py in a traceback (the folder only after every
    # table and sweep had been computed).
    import subprocess

    for args in (["--trace", str(tmp_path / "missing")], ["--json", str(tmp_path)]):
        done = subprocess.run([sys.executable, str(BENCH / "bench_ettr.py"), *args], capture_output=True,
                              text=True, timeout=120)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1 and err[0].startswith("bench_ettr: error:"), done.stderr
        assert done.stdout == ""
