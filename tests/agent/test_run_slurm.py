"""`trainguard run` under Slurm: SLURM_* fill in the job, node identity, node index, node count and the
coordinator address, so the same command line runs on every node of an srun step. Two real `trainguard run`
processes as Slurm's two nodes (only SLURM_NODEID differs) run in tests/deploy/test_deploy.py, started by the
shipped sbatch script under a fake srun."""

from __future__ import annotations

import pytest

import tg_testutil
from trainguard.agent.run_deploy import apply_slurm, slurm_placement
from trainguard.cli import build_parser
from trainguard.errors import UsageError


def _env(**kw: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NODEID": "1",
            "SLURM_JOB_NUM_NODES": "3", **kw}


def test_placement_from_a_compressed_node_list() -> None:
    p = slurm_placement(_env(SLURM_STEP_NODELIST="gpu[02-03],gpu01", SLURM_GPUS_ON_NODE="8"))
    assert p.nodes == ("gpu02", "gpu03", "gpu01") and p.host == "gpu03" and not p.first and p.gpus_on_node == 8
    assert slurm_placement({}) is None


@pytest.mark.parametrize("env, needle", [
    (_env(SLURM_NODEID="3"), "SLURM_NODEID=3 is outside"),
    ({"SLURM_JOB_ID": "1", "SLURM_NODEID": "0"}, "no SLURM_STEP_NODELIST"),
    (_env(SLURM_NODEID=""), "SLURM_NODEID is not set"),
    (_env(SLURM_NTASKS="6", SLURM_NNODES="3"), "one task per node"),
    (_env(SLURM_JOB_NODELIST="gpu[01-"), "not a Slurm host list"),
])
def test_inconsistent_slurm_variables_are_one_line_errors(env, needle) -> None:
    with pytest.raises(UsageError, match=needle.replace("$", r"\$")):
        slurm_placement(env)


def test_flags_left_at_defaults_are_filled_and_explicit_ones_win() -> None:
    args = build_parser().parse_args(["run", "train.py"])
    apply_slurm(args, _env(SLURM_GPUS_ON_NODE="4"))
    assert (args.job, args.node_id, args.host, args.address, args.node_index) == \
        ("slurm-4242", "gpu02", "gpu02", "gpu02", 1)
    assert (str(args.nnodes), str(args.nproc_per_node)) == ("3", "4")  # numbers or torchrun-style text
    assert args.coordinator == "gpu01:29400"
    first = build_parser().parse_args(["run", "--coordinator-port", "29555", "train.py"])
    apply_slurm(first, _env(SLURM_NODEID="0"))
    assert first.coordinator is None and first.coordinator_listen == "0.0.0.0:29555" and str(first.nnodes) == "3"
    explicit = build_parser().parse_args(["run", "--job", "mine", "--coordinator", "c:1", "train.py"])
    apply_slurm(explicit, _env())
    assert explicit.job == "mine" and explicit.coordinator == "c:1"
    off = build_parser().parse_args(["run", "--no-slurm", "train.py"])
    assert apply_slurm(off, _env()) is None and off.job is None


def test_an_explicit_nproc_per_node_of_1_is_kept_under_slurm(tmp_path, tg_env) -> None:
    """``srun --gpus-per-node 2 trainguard run --nproc-per-node 1 train.py`` (one process driving every GPU): a
    flag given as its default counted as left alone, so SLURM_GPUS_ON_NODE replaced it and the node started 2
    workers. A real launcher under a one-node Slurm step's variables; its workers write their environment."""
    import json
    import socket
    from pathlib import Path

    from tg_testutil import run_cli

    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).resolve().parent / "scripts" / "print_env.py"
    env = {**tg_env, "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": socket.gethostname(), "SLURM_NODEID": "0",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "2"}
    for flags, workers in ((["--nproc-per-node", "1"], 1), ([], 2)):  # left alone, Slurm's count fills it
        for f in out.iterdir():
            f.unlink()
        r = run_cli(["run", *flags, "--max-restarts", "0", "--address", "127.0.0.1", str(script), str(out)], env)
        assert r.returncode == 0, r.stderr[-3000:]
        envs = [json.loads(f.read_text())["env"] for f in out.glob("env*.json")]
        assert len(envs) == workers and {e["WORLD_SIZE"] for e in envs} == {str(workers)}, (flags, envs)


def test_coordinator_port_variable_is_read_when_used_and_checked_there(monkeypatch) -> None:
    # Read into the flag's default while the parser was built, a $TRAINGUARD_COORDINATOR_PORT that was no number
    # made every trainguard command (`ckpt ls`, `--help`) a ValueError traceback.
    monkeypatch.setenv("TRAINGUARD_COORDINATOR_PORT", "abc")
    args = build_parser().parse_args(["run", "train.py"])
    with pytest.raises(UsageError, match=r"\$TRAINGUARD_COORDINATOR_PORT: 'abc' is not a port number"):
        apply_slurm(args, _env(SLURM_NODEID="0", TRAINGUARD_COORDINATOR_PORT="abc"))
    first = build_parser().parse_args(["run", "train.py"])
    apply_slurm(first, _env(SLURM_NODEID="0", TRAINGUARD_COORDINATOR_PORT="29777"))
    assert first.coordinator_listen == "0.0.0.0:29777"
    for bad in ("0", "70000", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "--coordinator-port", bad, "train.py"])


def test_the_embedded_coordinators_line_names_the_wildcard_it_binds(tmp_path, tg_env) -> None:
    """Found by a user's review: under Slurm the embedded coordinator binds every interface but said "listening on
    127.0.0.1:PORT" (the address this node dials), so an operator whose other nodes could not reach it took it
    for a loopback bind. A real launcher as node 0 of 2, stopped once it has said where it listens."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path


    port = tg_testutil.free_port("0.0.0.0")
    script = Path(__file__).resolve().parent / "scripts" / "print_env.py"
    env = {**tg_env, "SLURM_JOB_ID": "4243", "SLURM_STEP_NODELIST": "localhost,127.0.0.1", "SLURM_NODEID": "0",
           "SLURM_STEP_NUM_NODES": "2", "TRAINGUARD_COORDINATOR_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--max-restarts", "0", str(script),
                             str(tmp_path)], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen: list[str] = []
    # readline() blocks: a launcher silent for a minute is killed, which ends the read with what it said
    watchdog = threading.Timer(60, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        while line := proc.stderr.readline():
            seen.append(line)
            if "listening on" in line:
                break
    finally:
        watchdog.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    said = [ln for ln in seen if "listening on" in ln]
    assert said, "".join(seen)[-3000:]
    assert f"listening on 0.0.0.0:{port} (every interface; this node dials 127.0.0.1:{port})" in said[0], said


def test_the_last_nodes_of_the_step_join_as_spares_and_the_job_trains_on_the_others() -> None:
    # srun starts no new task in a running step, so a node lost under Slurm could only be waited for (a job-level
    # restart ending in the membership timeout): spares must be nodes of the same step.
    placed = []
    for nid in ("0", "1", "2"):
        args = build_parser().parse_args(["run", "--slurm-spares", "1", "train.py"])
        apply_slurm(args, _env(SLURM_NODEID=nid))
        placed.append((args.spare, str(args.nnodes), args.node_index))
    assert placed == [(False, "2", 0), (False, "2", 1), (True, "2", 2)]  # the coordinator's node always trains
    from_env = build_parser().parse_args(["run", "train.py"])
    apply_slurm(from_env, _env(SLURM_NODEID="3", SLURM_JOB_NODELIST="gpu[01-05]", TRAINGUARD_SLURM_SPARES="2"))
    assert from_env.spare and str(from_env.nnodes) == "3"
    elastic = build_parser().parse_args(["run", "--nnodes", "1:2", "--slurm-spares", "1", "train.py"])
    apply_slurm(elastic, _env(SLURM_NODEID="0"))  # an explicit --nnodes (shrink to 1 once spares are out) stays
    assert elastic.nnodes == "1:2" and not elastic.spare


@pytest.mark.parametrize("flags, env, needle", [
    (["--slurm-spares", "3"], {}, r"--slurm-spares 3: the step has 3 node\(s\), which leaves 0 to train on"),
    (["--slurm-spares", "2"], {}, r"which leaves 1 to train on; spares stand in for nodes of a job of 2 or more"),
    (["--slurm-spares", "1", "--nnodes", "2:3"], {}, r"--nnodes 2:3 asks for more nodes than the 2 that train"),
    ([], {"TRAINGUARD_SLURM_SPARES": "one"}, r"\$TRAINGUARD_SLURM_SPARES: expected a whole number of nodes, got 'one'"),
    (["--slurm-spares", "1", "--rdzv-endpoint", "gpu01:29400"], {}, "give --spare to the nodes that are spares"),
])
def test_spares_that_cannot_be_placed_are_one_line_errors(flags, env, needle) -> None:
    args = build_parser().parse_args(["run", *flags, "train.py"])
    with pytest.raises(UsageError, match=needle):
        apply_slurm(args, _env(**env))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--slurm-spares", "-1", "train.py"])
    for flags in (["--slurm-spares", "1"], ["--slurm-spares", "1", "--no-slurm"]):  # not ignored outside Slurm
        with pytest.raises(UsageError, match="give --spare to the nodes that are spares"):
            apply_slurm(build_parser().parse_args(["run", *flags, "train.py"]), {})
    assert apply_slurm(build_parser().parse_args(["run", "train.py"]), {"TRAINGUARD_SLURM_SPARES": "1"}) is None
