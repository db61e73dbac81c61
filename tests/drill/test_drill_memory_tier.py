"""Job-wide memory tier in the cluster drill (2 node agents and a spare, each node in its own network namespace
with its own shared-memory arena, gloo over the data links): a worker SIGKILLed restarts every rank from its own
node's memory; a node agent SIGKILLed with its workers (node lost) is replaced by the spare, which fetches the
lost node's ranks from their buddy's memory before its workers start, so every rank restores from memory again;
the final model equals the fault-free run bitwise."""

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
def test_process_crash_and_node_loss_restore_every_rank_from_memory(tmp_path) -> None:
    netns = netns_unavailable_reason() is None
    # Faults strike once every rank's newest snapshot is a replica in another node's memory: this test is about
    # the buddy's copy (a node lost before its newest snapshot replicated restores that step from disk).
    cfg = SoakConfig(wall_s=6.0, step_delay_s=0.05, save_every=10, trace_faults=0, extra=("kill", "agentkill"),
                     nodes=2, spares=1, netns=netns, workdir=str(tmp_path / "soak"), strike_after_replication=True,
                     early_reference=True)
    lines: list[str] = []
    rep = run_soak(cfg, progress=lines.append)
    text = "\n".join(lines)
    assert rep.equal_to_reference is True, text
    kill = next(f for f in rep.faults if f.kind == "kill")
    assert kill.level == "process", text
    assert kill.restore_tiers == {0: "memory", 1: "memory"}, text
    assert kill.restore_s is not None and kill.recovery_s is not None
    lost = next(f for f in rep.faults if f.kind == "agentkill")
    assert lost.level == "node", text
    assert lost.restore_tiers == {0: "memory", 1: "memory"}, text
    spare_logs = "".join(p.read_text() for p in (tmp_path / "soak").glob("spare*.log"))
    assert f"fetched rank {lost.rank} step" in spare_logs, text  # from the buddy's memory, before the workers
    node_logs = [p.read_text() for p in (tmp_path / "soak").glob("*.log") if not p.name.startswith("coordinator")]
    serving = [ln for log in node_logs for ln in log.splitlines() if "serving in-memory checkpoint replicas" in ln]
    assert serving and all("job token required" in ln for ln in serving), serving  # the drill sets a token
