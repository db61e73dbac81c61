"""Job-wide memory tier in the cluster drill: a worker SIGKILLed on one of 2 node agents (each node in its own
network namespace with its own shared-memory arena, gloo over the data links) restarts every rank from its own
node's memory, and the final model equals the fault-free run bitwise."""

from __future__ import annotations

import pytest

from trainguard.drill.netns import netns_unavailable_reason
from trainguard.drill.soak import SoakConfig, run_soak
from trainguard.drill.trace import trace_dir

needs_stepfun = pytest.mark.skipif(not (trace_dir() / "fault_trace.json").is_file(),
                                   reason="StepFun fault trace not found (set TRAINGUARD_FAULT_TRACE_DIR)")


@needs_stepfun
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_process_crash_restores_every_rank_from_its_own_nodes_memory(tmp_path) -> None:
    netns = netns_unavailable_reason() is None
    cfg = SoakConfig(wall_s=5.0, step_delay_s=0.05, save_every=5, trace_faults=0, extra=("kill",), nodes=2,
                     spares=1, netns=netns, workdir=str(tmp_path / "soak"))
    lines: list[str] = []
    rep = run_soak(cfg, progress=lines.append)
    text = "\n".join(lines)
    assert rep.equal_to_reference is True, text
    kill = next(f for f in rep.faults if f.kind == "kill")
    assert kill.level == "process", text
    assert kill.restore_tiers == {0: "memory", 1: "memory"}, text
    assert kill.restore_s is not None and kill.recovery_s is not None
