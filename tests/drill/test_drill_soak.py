"""The soak drill: schedule drawn from the trace, report plumbing, and one short real drill (a kill, verified)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time

import pytest

from trainguard.drill.errors import SoakError
from trainguard.drill.soak import SKIPPED, FaultOutcome, SoakConfig, SoakReport, _agent_detections, plan_schedule, run_soak
from trainguard.drill.soak_report import drill_schedule_trace, format_soak, measured_components
from trainguard.drill.trace import load_stepfun, trace_dir

STEPFUN = trace_dir()
needs_stepfun = pytest.mark.skipif(
    not (STEPFUN / "fault_trace.json").is_file(),
    reason=f"StepFun fault trace not found at {STEPFUN} (set TRAINGUARD_FAULT_TRACE_DIR to its folder)",
)


@needs_stepfun
def test_schedule_follows_the_trace():
    trace = load_stepfun()
    cfg = SoakConfig(wall_s=3600.0, trace_faults=200.0, extra=("stop", "enospc"), seed=3)
    schedule, compression, window = plan_schedule(trace, cfg)
    assert schedule == plan_schedule(trace, cfg)[0]  # seeded: the same drill every time
    drawn = [p for p in schedule if p.fault_class != "extra"]
    # about 200 trace faults, in the trace's order, with their classes; extras once each
    assert 120 <= len(drawn) <= 300
    assert [p.kind for p in schedule if p.fault_class == "extra"] == ["stop", "enospc"]
    assert all(0 <= p.at_s <= cfg.wall_s for p in schedule)
    assert all(a.at_s <= b.at_s for a, b in zip(schedule, schedule[1:]))
    # mean trace gap at the represented size, compressed: the StepFun job MTBF (2.8 h) / compression
    mtbf = trace.for_job(2048).mtbf_s
    assert compression == pytest.approx(mtbf * 200.0 / (0.8 * 3600.0))
    assert window[1] - window[0] == pytest.approx(0.8 * 3600.0 * compression / 86_400)
    for p in drawn:
        if p.fault_class in ("crash", "node_fault"):
            assert p.kind == "kill"
        elif p.fault_class == "hang":
            assert p.kind == "stop"
        else:
            assert p.kind == "skip" and p.reason == SKIPPED[p.fault_class]


def test_bad_config_is_refused():
    for bad in (dict(nproc=1), dict(wall_s=0), dict(extra=("meteor",)), dict(hang_bound_s=0)):
        with pytest.raises(SoakError):
            SoakConfig(**bad).validate()
    # a NaN passed every range check and an endless span never ended (`trainguard drill --minutes inf` trained
    # until killed); each is refused by its flag
    for field, flag in (("wall_s", "--minutes"), ("trace_faults", "--trace-faults"),
                        ("enospc_window_s", "--enospc-window"), ("hang_bound_s", "--hang-bound")):
        for value in (math.nan, math.inf):
            with pytest.raises(SoakError, match=f"{flag} {value:g}: must be a finite number"):
                SoakConfig(**{field: value}).validate()


def test_agent_log_detection_times():
    line = ("2026-11-29 15:22:44,972 WARNING trainguard.agent.node: generation 1: rank 1 ended with signal SIGKILL "
            "(9); stopping local workers")
    hang = ("2026-11-29 15:49:07,686 WARNING trainguard.agent.node: generation 2: worker rank 1 (pid 32157) sent no "
            "step heartbeat for 60.2 s after step 230 (bound 60.0 s); stopping local workers")
    (t, why), (t2, why2) = _agent_detections("noise\n" + line + "\nother line ended with nothing\n" + hang)
    assert t == pytest.approx(time.mktime(time.strptime("2026-11-29 15:22:44", "%Y-%m-%d %H:%M:%S")) + 0.972)
    assert (why, why2) == ("exit", "hang") and t2 - t == pytest.approx(1582.714)


def test_measured_components_and_report_text():
    faults = [FaultOutcome("kill", "crash", "a", 5.0, 5.0, rank=1, generation=1, detected_s=0.05, recovery_s=4.05,
                           steps_lost=3),
              FaultOutcome("stop", "extra", "b", 20.0, 21.0, rank=0, generation=2, detected_s=3.5, recovery_s=8.5,
                           steps_lost=5),
              FaultOutcome("enospc", "extra", "c", 30.0, 30.0, detected_s=0.3, recovery_s=2.0, level="none")]
    rep = SoakReport(config={"save_every": 10, "represent_gpus": 16384}, compression=400.0, window_days=(1.0, 2.0),
                     steps=500, wall_s=60.0, step_time_s=0.1, ettr=0.8, ettr_steady=0.85, generations=3, exit_code=0,
                     faults=faults, skipped=[], skip_reasons={}, params_sha256="ab" * 32, reference_sha256="ab" * 32,
                     equal_to_reference=True, stall_s=0.002,
                     timeline=[(2.0 + 0.1 * i, 1, i) for i in range(500)])
    m = measured_components(rep)
    assert m["detect_crash_s"] == 0.05 and m["detect_hang_s"] == 3.5
    assert m["recovery_process_s"] == pytest.approx(4.5)  # median of 4.0 and 5.0
    tr = drill_schedule_trace(rep)
    assert [f.fault_class.value for f in tr.faults] == ["crash", "hang"]
    text = format_soak(rep, torch_save_s=0.02)
    assert "EQUAL" in text and "baseline" in text and "16,384 GPUs" in text
    assert "job restart 4.50 s" in text  # the baseline gets trainguard's measured restart unless told otherwise
    assert "job restart 9.00 s" in format_soak(rep, torch_save_s=0.02, baseline_restart_s=9.0)


@needs_stepfun  # the drill's ETTR comparison replays the trace's fault rates
def test_short_real_drill_kill_and_verify(tmp_path):
    """A real 2-worker job under trainguard run: a full checkpoint disk, one SIGKILL, then the fault-free check."""
    cfg = SoakConfig(wall_s=3.0, step_delay_s=0.02, save_every=5, trace_faults=0, extra=("enospc", "kill"),
                     enospc_window_s=1.5, workdir=str(tmp_path / "soak"), early_reference=True)
    rep = run_soak(cfg, progress=lambda _line: None)
    assert rep.exit_code == 0
    assert rep.equal_to_reference is True
    by_kind = {f.kind: f for f in rep.faults}  # a restart the drill did not inject would be listed as "unplanned"
    assert set(by_kind) <= {"enospc", "kill", "unplanned"}, rep.faults
    full, kill = by_kind["enospc"], by_kind["kill"]
    assert full.kind == "enospc" and full.detected_s is not None and full.recovery_s is not None  # saves resumed
    assert kill.kind == "kill" and kill.recovery_s is not None and kill.recovery_s > 0
    assert kill.detected_s is not None and 0 <= kill.detected_s < 5.0
    assert rep.generations >= 2 and 0 < rep.ettr < 1
    mounts = open("/proc/mounts").read()
    assert str(tmp_path / "soak" / "ckpt") not in mounts  # the tmpfs is unmounted
    json.dumps(rep.as_dict(), default=str)


@needs_stepfun
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cluster_drill_every_node_fault_restored_from_memory_and_verified(tmp_path):
    """A real 2-node job with spares, each node in its own network namespace (loopback when namespaces are not
    permitted) with its own shared-memory arena, gloo over the data links: a worker SIGKILLed, a hardware fault, a
    lost agent, a cut data link, a predicted failure and a coordinator kill, each recovered at the level it needs,
    and the final model equal to the fault-free run.

    The job-wide memory tier is checked on the same run (one cluster drill, not two: each costs a cluster start-up
    and a reference run, about a minute of CI): the SIGKILLed worker restarts every rank from its own node's
    memory; the lost node agent (SIGKILLed with its workers) is replaced by the spare, which fetches the lost
    node's ranks from their buddy's memory before its workers start, so every rank restores from memory again.
    Faults strike once every rank's newest snapshot is a replica in another node's memory: the memory checks are
    about the buddy's copy (a node lost before its newest snapshot replicated restores that step from disk)."""
    from trainguard.drill.netns import netns_unavailable_reason

    netns = netns_unavailable_reason() is None
    # The coordinator kill goes before the third node fault: that one waits for a spare started during the drill
    # to warm up (with two spares), and the coordinator kill, not a node fault, needs none: it runs in that wait.
    node_faults = ("hwfault", "agentkill", "coordinator", "linkdown", "precursor") if netns else \
        ("hwfault", "agentkill", "coordinator", "precursor")
    extra = ("kill", *node_faults)  # the process-level fault first: the node-level ones escalate as they repeat
    # save_every 10 leaves 7 steps after each save in which a strike finds the snapshot replicated (5 left 2).
    # Two spares: a node fault waits for a ready spare, and a new one takes 13-20 s to import torch on a loaded
    # 2-core machine; with one spare every node fault after the first waited that out (half the test's time).
    # (A third spare removed the remaining wait but cost ~45 s more CPU: each repair starts another spare.)
    cfg = SoakConfig(wall_s=5.0, step_delay_s=0.05, save_every=10, trace_faults=0, extra=extra, nodes=2, spares=2,
                     netns=netns, lease_timeout_s=3.0, drain_grace_s=1.0, precursor_lead_s=20.0,
                     workdir=str(tmp_path / "soak"), strike_after_replication=True, early_reference=True)
    lines: list[str] = []
    rep = run_soak(cfg, progress=lines.append)
    text = "\n".join(lines)
    assert rep.equal_to_reference is True, text
    by_kind = {f.kind: f for f in rep.faults}
    assert set(extra) <= set(by_kind), text
    for kind in node_faults:
        f = by_kind[kind]
        if kind == "coordinator":
            assert f.level == "none" and f.steps_lost == 0, text  # the job went on without a restart
            continue
        assert f.level == "node" and f.recovery_s is not None and f.detected_s is not None, (kind, text)
    assert by_kind["precursor"].predicted is True, text
    assert by_kind["agentkill"].detected_s >= 2.5  # found by the 3 s lease, not sooner
    assert "retired" in text and "new spare" in text
    # the memory tier: a process crash and a lost node both restore every rank from memory
    kill = by_kind["kill"]
    assert kill.level == "process", text
    assert kill.restore_tiers == {0: "memory", 1: "memory"}, text
    assert kill.restore_s is not None and kill.recovery_s is not None
    lost = by_kind["agentkill"]
    assert lost.restore_tiers == {0: "memory", 1: "memory"}, text
    spare_logs = "".join(p.read_text() for p in (tmp_path / "soak").glob("spare*.log"))
    assert f"fetched rank {lost.rank} step" in spare_logs, text  # from the buddy's memory, before the workers
    node_logs = [p.read_text() for p in (tmp_path / "soak").glob("*.log") if not p.name.startswith("coordinator")]
    serving = [ln for log in node_logs for ln in log.splitlines() if "serving in-memory checkpoint replicas" in ln]
    assert serving and all("job token required" in ln for ln in serving), serving  # the drill sets a token
    if netns:
        # Every namespace, link and bridge the drill made is gone (by its fabric's tag: tests running beside this
        # one make namespaces of their own).
        tag = re.search(r"network fabric (\w+):", text).group(1)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
            subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert not [name for name in (f"tg{tag}n", f"tgM{tag}", f"tgD{tag}", f"{tag}h") if name in left], left


def test_drill_cli_refuses_folder_outputs_before_running(tmp_path, capsys):
    # `trainguard drill --json DIR` (or --components-out DIR) ran the whole drill and then died with a traceback,
    # losing the report it had just measured. The trace is missing too: the output path is checked first, so no
    # drill (and no trace lookup) happens before the refusal.
    from trainguard.cli import main

    folder = tmp_path / "reports"
    folder.mkdir()
    for flag in ("--json", "--components-out", "--plot"):
        code = main(["drill", "--minutes", "0.1", "--trace", str(tmp_path / "no-trace"), "--workdir",
                     str(tmp_path / "work"), flag, str(folder)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1
        assert err[0].startswith(f"trainguard: error: {flag} {folder} is a folder"), err
    assert not (tmp_path / "work").exists()


def test_drill_cli_names_represent_gpus_and_a_file_as_workdir(tmp_path, capsys):
    # --represent-gpus 0 was refused as 'job must have at least one node, got 0' (no flag named); a file as
    # --workdir raised FileExistsError with a traceback once the trace had been loaded.
    from trainguard.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, flag in ((["--represent-gpus", "0"], "--represent-gpus 0"), (["--workdir", str(afile)], "--workdir")):
        assert main(["drill", "--no-verify", "--minutes", "0.1", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"trainguard: error: {flag}"), err
    assert afile.read_text() == "x"


def test_enospc_saves_committed_while_the_disk_was_full_are_not_reported_as_resumed(tmp_path):
    # With retention the checkpoint service makes room on a full disk by removing older steps, so saves went on
    # through the whole ENOSPC window; the drill still reported "saves resumed 0.12 s after the space was freed"
    # (the next periodic save), as if saves had stopped. A commit during the window now reads as no interruption.
    from trainguard.checkpoint.location import CheckpointLocation
    from trainguard.drill.soak import _Tmpfs, enospc_state, follow_enospc

    ckpt = tmp_path / "ckpt"
    store = CheckpointLocation.parse(str(ckpt)).open_store("soak")
    store.commit_rank(5, 0, 1, "d5")
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank0.events").write_text(json.dumps(
        {"t": 100.3, "level": "WARNING", "message": "checkpoint disk tier is full: step 10 fitted only after older "
                                                     "step(s) 5 were removed"}) + "\n")
    cfg = SoakConfig(enospc_window_s=1.5)
    lines: list[str] = []
    o = FaultOutcome("enospc", "extra", "extra: enospc", 0.0, 0.0, level="none")
    state = enospc_state(o, committed_at_fill=5)
    tmpfs = _Tmpfs(ckpt, 1)  # never mounted or filled here: free() only removes a filler it made
    assert follow_enospc(state, cfg, tmpfs, ckpt, tmp_path / "events", 100.0, 100.5, 1, lines.append) is state
    assert o.detected_s == pytest.approx(0.3) and "checkpoint warning reported after 0.30 s" in lines[-1]
    store.commit_rank(10, 0, 1, "d10")  # a save that fitted while the disk was full
    assert follow_enospc(state, cfg, tmpfs, ckpt, tmp_path / "events", 100.0, 101.6, 1, lines.append) is None
    assert o.recovery_s == 0.0 and "saves went on while the disk was full" in lines[-1], lines

    # Saves that did stop: none committed during the window, the next one after the space came back is timed.
    o2 = FaultOutcome("enospc", "extra", "extra: enospc", 0.0, 0.0, level="none")
    state = enospc_state(o2, committed_at_fill=10)
    assert follow_enospc(state, cfg, tmpfs, ckpt, tmp_path / "events", 200.0, 201.6, 1, lines.append) is state
    store.commit_rank(15, 0, 1, "d15")
    assert follow_enospc(state, cfg, tmpfs, ckpt, tmp_path / "events", 200.0, 202.0, 1, lines.append) is None
    assert o2.recovery_s == pytest.approx(0.4) and "saves resumed 0.40 s after the space was freed" in lines[-1]
