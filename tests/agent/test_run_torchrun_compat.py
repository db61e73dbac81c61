"""`trainguard run` takes torchrun's command lines: the same lines through both launchers give the workers the
same environment, key by key; bad values are one-line errors naming the flag."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tg_testutil
from tg_testutil import REPO, run_cli

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PRINT_ENV = str(SCRIPTS / "print_env.py")

#: Values that differ between the launchers by design: each generation's store is on a new port at the
#: address of rank 0's node (torchrun: localhost and its rendezvous port), the error files lie in each
#: launcher's own folder, and without --rdzv-id each launcher names the run its own way.
DIFFER_BY_DESIGN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


def _port() -> int:
    return tg_testutil.free_port()


def _launch(launcher: str, line: list[str], out: Path, env: dict) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else \
        [sys.executable, "-m", "trainguard.cli", "run"]
    out.mkdir()
    r = subprocess.run(cmd + line + [str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, f"{launcher} {' '.join(line)} failed:\n{r.stderr[-3000:]}"
    envs = {}
    for f in out.glob("env*.json"):
        envs[int(f.stem[3:])] = json.loads(f.read_text())
    return envs


#: Stands for a port picked when the test runs: picked at collection (parametrize), it was used minutes later,
#: free or not by then.
PORT = "<free port>"


def _lines() -> list[tuple[str, list[str], dict]]:
    return [
        ("underscores-standalone-role", ["--standalone", "--nnodes=1", "--nproc_per_node=2", "--max_restarts=1",
                                         "--role", "trainer", "--monitor_interval", "0.1", PRINT_ENV], {}),
        ("c10d-auto-virtual", ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{PORT}",
                               "--rdzv-id", "compat-job", "--nnodes", "1:1", "--nproc-per-node", "auto",
                               "--max-restarts", "0", "--virtual-local-rank", PRINT_ENV], {}),
        ("static-master-pet", ["--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master-port",
                               PORT, "--max-restarts", "2", PRINT_ENV], {"PET_NPROC_PER_NODE": "2"}),
        ("module", ["--nproc-per-node", "1", "--max-restarts", "0", "--module", "print_env_mod"],
         {"PYTHONPATH": str(SCRIPTS)}),
        ("no-python", ["--nproc-per-node", "1", "--max-restarts", "0", "--no-python", sys.executable, PRINT_ENV],
         {}),
        pytest.param("gpu", ["--standalone", "--nproc-per-node", "gpu", "--max-restarts", "0", "--virtual-local-rank",
                             PRINT_ENV], {},
                     marks=pytest.mark.skipif(not os.path.exists("/dev/nvidia0"), reason="needs an NVIDIA GPU")),
    ]


@pytest.mark.parametrize("name,line,extra_env", _lines(),
                         ids=[getattr(c, "values", c)[0] for c in _lines()])
def test_same_command_line_same_worker_environment(tmp_path: Path, tg_env: dict, name: str, line: list[str],
                                                   extra_env: dict) -> None:
    env = {**tg_env, **extra_env}
    port = str(_port())
    line = [arg.replace(PORT, port) for arg in line]
    theirs = _launch("torchrun", line, tmp_path / "torchrun", env)
    ours = _launch("trainguard", line, tmp_path / "trainguard", env)
    assert sorted(theirs) == sorted(ours) and theirs, (sorted(theirs), sorted(ours))
    named_run = "--rdzv-id" in line
    for rank, t in theirs.items():
        te, oe = t["env"], ours[rank]["env"]
        set_by_torchrun = {k for k, v in te.items() if env.get(k) != v}
        assert set_by_torchrun >= {"RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"}
        for key in sorted(set_by_torchrun):
            assert key in oe, f"{name}: rank {rank}: trainguard does not set {key} (torchrun: {te[key]!r})"
            if key in DIFFER_BY_DESIGN or (key == "TORCHELASTIC_RUN_ID" and not named_run):
                continue
            assert oe[key] == te[key], f"{name}: rank {rank}: {key} is {oe[key]!r}, torchrun gives {te[key]!r}"
        # Each worker has its own error file in a folder of the generation.
        assert oe["TORCHELASTIC_ERROR_FILE"].endswith(f"/g1/rank{rank}/error.json")
        assert t["argv"][:-1] == ours[rank]["argv"][:-1]  # the same script and arguments, less the out dir


def test_record_error_becomes_the_failure_reason(tmp_path: Path, tg_env: dict) -> None:
    script = tmp_path / "boom.py"
    # Only the failing rank imports torch for @record: rank 0 has nothing to record and just succeeds (a torch
    # import is ~3 s of CPU on the CI box).
    script.write_text(
        "import os\n"
        "if os.environ['RANK'] == '1':\n"
        "    from torch.distributed.elastic.multiprocessing.errors import record\n"
        "    @record\n"
        "    def main():\n"
        "        raise RuntimeError('disk full on /data/shard-7')\n"
        "    main()\n")
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "0", str(script)], tg_env)
    assert r.returncode == 1, r.stderr
    # The coordinator logs it as the reason, and the summary names it.
    coord = [ln for ln in r.stderr.splitlines() if "trainguard.recovery.coordinator" in ln and "rank 1" in ln]
    assert any("RuntimeError: disk full on /data/shard-7" in ln for ln in coord), r.stderr[-3000:]
    assert "job FAILED" in r.stderr and "RuntimeError: disk full on /data/shard-7" in r.stderr.splitlines()[-2] \
        + r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_redirects_tee_and_ranks_filter(tmp_path: Path, tg_env: dict) -> None:
    script = tmp_path / "talk.py"
    script.write_text("import os, sys\nr = os.environ['LOCAL_RANK']\nprint('out-' + r)\n"
                      "print('err-' + r, file=sys.stderr)\n")
    logs = tmp_path / "logs"
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "0", "--log-dir", str(logs), "--tee", "1",
                 "--redirects", "2", "--local-ranks-filter", "0", str(script)], tg_env)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert (logs / f"rank{rank}.stdout.log").read_text() == f"out-{rank}\n"
        assert (logs / f"rank{rank}.stderr.log").read_text() == f"err-{rank}\n"
    assert "[default0]:out-0" in r.stdout and "out-1" not in r.stdout, r.stdout
    assert "err-0" not in r.stderr and "err-1" not in r.stderr


def test_ranks_not_named_by_redirects_stay_on_the_console(tmp_path: Path, tg_env: dict) -> None:
    """Black-box review: `--redirects 1:3` (torchrun: only local rank 1 to files) sent rank 0's output, silently,
    into rank0.log of a temporary folder too: the one-file-per-rank layout of a bare --log-dir took it."""
    script = tmp_path / "talk.py"
    script.write_text("import os, sys\nr = os.environ['LOCAL_RANK']\nprint('out-' + r)\n"
                      "print('err-' + r, file=sys.stderr)\n")
    logs = tmp_path / "logs"
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "0", "--log-dir", str(logs), "--redirects", "1:3",
                 str(script)], tg_env)
    assert r.returncode == 0, r.stderr
    assert "out-0" in r.stdout and "err-0" in r.stderr and "out-1" not in r.stdout, (r.stdout, r.stderr[-2000:])
    assert (logs / "rank1.stdout.log").read_text() == "out-1\n" and not (logs / "rank0.log").exists()


@pytest.mark.parametrize("flags,words", [
    (["--nnodes", "3:1"], ["--nnodes", "MIN <= MAX"]),
    (["--nnodes", "two"], ["--nnodes", "N or MIN:MAX"]),
    (["--nproc-per-node", "banana"], ["--nproc-per-node", "gpu, auto or cpu"]),
    (["--nproc_per_node", "0"], ["--nproc-per-node", ">= 1"]),
    (["--rdzv-conf", "join_timeout"], ["--rdzv-conf", "key=value"]),
    (["--rdzv-conf", "join_timeout=soon"], ["--rdzv-conf", "join_timeout", "seconds"]),
    # nan passed the '> 0' check: on the host a coordinator error naming no flag, elsewhere taken without a word
    (["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=nan"], ["--rdzv-conf last_call_timeout='nan'", "finite"]),
    (["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.7:29400", "--rdzv-conf",
      "last_call_timeout=inf"], ["--rdzv-conf last_call_timeout='inf'", "finite"]),
    (["--rdzv-conf", "join_timeout=nan"], ["--rdzv-conf join_timeout='nan'", "finite"]),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379"], ["--rdzv-backend etcd", "c10d"]),
    (["--rdzv-backend", "zookeeper"], ["--rdzv-backend", "static or c10d"]),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:99999"], ["--rdzv-endpoint", "0..65535"]),
    (["--standalone", "--nnodes", "2"], ["--standalone", "one node"]),
    # A URL or an etcd-style endpoint list was taken for an IPv6 host and dialled until the join timeout.
    (["--rdzv-backend", "c10d", "--nnodes", "2", "--rdzv-endpoint", "http://192.0.2.7:29400", "--rdzv-conf",
      "join_timeout=1"], ["--rdzv-endpoint 'http://192.0.2.7:29400'", "without a scheme"]),
    (["--rdzv-backend", "c10d", "--nnodes", "2", "--rdzv-endpoint", "192.0.2.7:29400,192.0.2.8:29400",
      "--rdzv-conf", "join_timeout=1"], ["--rdzv-endpoint", "one HOST[:PORT]"]),
    (["--coordinator", "grpc://192.0.2.7:29400", "--rdzv-conf", "join_timeout=1"], ["--coordinator", "one HOST"]),
    # gRPC dials a target without a port at 443: the join timeout was waited out there
    (["--coordinator", "127.0.0.1:", "--rdzv-conf", "join_timeout=1"], ["--coordinator '127.0.0.1:'", "HOST:PORT"]),
    (["--coordinator", "127.0.0.1:1,192.0.2.7", "--rdzv-conf", "join_timeout=1"],
     ["--coordinator '192.0.2.7'", "HOST:PORT"]),
    (["--log-dir", "/tmp", "--redirects", "7"], ["--redirects", "0 (none)"]),
    # made only when the first worker started: a traceback once the job had registered (this file is no folder)
    (["--log-dir", f"{__file__}/logs"], ["--log-dir", "cannot create it", "Not a directory"]),
    (["--local-ranks-filter", "a,b"], ["--local-ranks-filter", "comma list"]),
    (["--signals-to-handle", "SIGTERM,SIGFOO"], ["--signals-to-handle", "SIGFOO"]),
    (["--no-python", "-m"], ["--no-python", "--module"]),
    (["--nnodes", "2", "--node-rank", "5"], ["--node-rank 5", "0..1"]),
    (["--node-rank", "-1"], ["--node-rank -1", ">= 0"]),
    # int32 on the wire: the registration crashed with a ValueError traceback once the job had started
    (["--node-index", "99999999999"], ["--node-index 99999999999", "0..2147483647"]),
    (["--node-rank", "99999999999"], ["--node-rank 99999999999", "0..2147483647"]),
    (["--node-index", "-3"], ["--node-index -3", "0..2147483647"]),  # said by the coordinator, once it ran
    (["--master-port", "99999"], ["--master-port 99999", "1..65535"]),
    (["--nnodes", "2", "--master-port", "0"], ["--master-port 0", "1..65535"]),  # one node may give 0
    (["--rdzv-backend", "c10d", "--rdzv-conf", "is_host=maybe"], ["--rdzv-conf is_host='maybe'", "true or false"]),
    (["--monitor-interval", "0"], ["--monitor-interval", "> 0"]),
    (["--start-method", "thread"], ["--start-method", "invalid choice"]),
])
def test_bad_torchrun_values_are_one_line_errors(capsys, flags: list[str], words: list[str]) -> None:
    from trainguard.cli import main

    try:
        code = main(["run", *flags, PRINT_ENV, "/tmp"])  # refused before anything starts
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_torchrun_lines_torchrun_accepts_are_accepted(tmp_path: Path, caplog) -> None:
    """Found by a review: ``-t 3`` without ``--log-dir`` (torchrun logs to a temporary folder), an ``--rdzv-id``
    holding ``/`` or spaces (an id from a scheduler), and ``--master-port 0`` on one node were refused."""
    import argparse
    import shutil

    from trainguard.agent.run_args import add_run_arguments
    from trainguard.agent.run_torchrun import resolve_rendezvous, stream_specs
    from trainguard.recovery.spec import JOB_NAME_RE
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--tee", "3", PRINT_ENV])
    with caplog.at_level(logging.WARNING):
        specs = stream_specs(args, 2)
    try:
        assert args.log_dir and os.path.isdir(args.log_dir) and args.log_dir in caplog.text
        assert specs[0].stdout == specs[1].stderr == "tee"
    finally:
        shutil.rmtree(args.log_dir, ignore_errors=True)
    jobs = [resolve_rendezvous(parser.parse_args(["--rdzv-id", rid, PRINT_ENV])).job
            for rid in ("team/run 7", "team/run 7", "team_run_7", "plain-id")]
    assert all(JOB_NAME_RE.match(j) for j in jobs) and jobs[0] == jobs[1] != jobs[2] and jobs[3] == "plain-id"
    assert resolve_rendezvous(parser.parse_args(["--master-port", "0", PRINT_ENV])).endpoint in ("", None)


def test_a_missing_script_is_the_only_thing_said_to_be_missing(capsys) -> None:
    """`trainguard run` alone said "required: script, script_args": a script takes no arguments of necessity."""
    from trainguard.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "--nproc-per-node", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "required: script " in err and "script_args" not in err, err


def test_bad_value_through_the_console_script(tg_env: dict) -> None:
    r = run_cli(["run", "--nproc_per_node", "many", PRINT_ENV, "/tmp"], tg_env, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--nproc-per-node 'many'" in r.stderr


def test_every_torchrun_flag_is_accepted() -> None:
    """The installed torch's own torchrun parser is the reference: each of its option strings parses here."""
    import argparse

    from torch.distributed.run import get_args_parser

    from trainguard.agent.run_args import add_run_arguments

    ours = argparse.ArgumentParser()
    add_run_arguments(ours)
    mine = {s for a in ours._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs - mine == set()


def _two_nodes(launcher: str, port: int, out: Path, env: dict) -> tuple[dict[int, dict], list[str]]:
    """Two agents on this machine form a 2-node job through the c10d endpoint; one worker each joins a gloo
    group across them (tests/agent/scripts/dump_env.py)."""
    out.mkdir()
    line = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--max-restarts", "0"]
    procs = []
    for i, node in enumerate(("node-a", "node-b")):
        extra = ["--node-id", node, *(["--local-addr", "127.0.0.1"] if i else [])] if launcher == "trainguard" \
            else []
        cmd = [sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else \
            [sys.executable, "-m", "trainguard.cli", "run"]
        procs.append(subprocess.Popen(cmd + line + extra + [str(SCRIPTS / "dump_env.py"), str(out)], env=env,
                                      cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            errs.append(err)
            assert p.returncode == 0, f"{launcher}: {err[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return {int(f.stem[3:]): json.loads(f.read_text()) for f in out.glob("env*.json")}, errs


def test_two_nodes_through_a_c10d_endpoint_like_torchrun(tmp_path: Path, tg_env: dict) -> None:
    theirs, _ = _two_nodes("torchrun", _port(), tmp_path / "torchrun", tg_env)
    ours, errs = _two_nodes("trainguard", _port(), tmp_path / "trainguard", tg_env)
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for rank in (0, 1):
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_RANK",
                    "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "dist_rank", "dist_world"):
            assert ours[rank][key] == theirs[rank][key], (rank, key, ours[rank][key], theirs[rank][key])
        assert ours[rank]["GROUP_RANK"] == str(rank)  # one worker per node: the node's rank is the worker's
    # Both nodes are told that loopback addresses are unreachable from other nodes: the one left to the
    # default, and the one given --local-addr 127.0.0.1.
    assert "coordinator at loopback" in errs[0] and "pass --local-addr" in errs[0], errs[0][-2000:]
    assert "--address/--local-addr 127.0.0.1 is a loopback address" in errs[1], errs[1][-2000:]


def _staggered_nodes(line: list[str], per_node: list[list[str]], out: Path, env: dict,
                     delay_s: float = 1.5, last_fails_first: bool = True) -> list[str]:
    """Starts one `trainguard run` per entry of ``per_node`` (``line`` plus that entry), each ``delay_s`` after the
    previous one (nodes of a real job never start in the same second), and returns their stderr; every node
    must succeed. The workers run print_env.py: what these tests check is how the launchers form one job (the
    rank table's RANK/WORLD_SIZE/run id), and a gloo group across nodes is test_two_nodes_...'s check; a torch
    import per worker (~2.5 s CPU each) would only repeat it."""
    import time

    out.mkdir()
    procs = []
    try:
        for extra in per_node:
            if procs:
                time.sleep(delay_s)
            procs.append(subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", *line, *extra,
                                           PRINT_ENV, str(out)], env=env, cwd=REPO,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        errs = []
        order = list(reversed(procs)) if last_fails_first else procs  # wait first for the one that would fail
        errs = {}
        for p in order:
            _, err = p.communicate(timeout=120)
            errs[p.pid] = err
            assert p.returncode == 0, err[-3000:]
        return [errs[p.pid] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def test_static_nodes_without_rdzv_id_agree_on_the_job_name(tmp_path: Path, tg_env: dict) -> None:
    """A torchrun line with no --rdzv-id: node 1 starts a second and a half after node 0 and still joins its job
    (the default job name is the same on every node, not stamped with each node's start time)."""
    port = _port()
    line = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--max-restarts", "0"]
    _staggered_nodes(line, [["--node-rank", "0", "--node-id", "sa"], ["--node-rank", "1", "--node-id", "sb"]],
                     tmp_path / "out", tg_env)
    envs = {int(f.stem[3:]): json.loads(f.read_text())["env"] for f in (tmp_path / "out").glob("env*.json")}
    assert sorted(envs) == [0, 1] and {e["WORLD_SIZE"] for e in envs.values()} == {"2"}
    assert envs[0]["TORCHELASTIC_RUN_ID"] == envs[1]["TORCHELASTIC_RUN_ID"] == f"print_env-{port}"


def test_two_c10d_agents_on_one_host_without_node_id(tmp_path: Path, tg_env: dict) -> None:
    """The README's "two agents on one host: the second joins" with torchrun's line unchanged (no --node-id):
    the agent that finds the endpoint taken joins under its own node id instead of taking over the first
    agent's slot (which ended the first agent, and the coordinator it embeds, with ALREADY_EXISTS)."""
    line = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{_port()}", "--rdzv-id", "twoag", "--max-restarts", "0"]
    _staggered_nodes(line, [[], []], tmp_path / "out", tg_env, delay_s=1.0, last_fails_first=False)
    envs = {int(f.stem[3:]): json.loads(f.read_text())["env"] for f in (tmp_path / "out").glob("env*.json")}
    assert sorted(envs) == [0, 1] and {e["WORLD_SIZE"] for e in envs.values()} == {"2"}
    assert envs[0]["TRAINGUARD_NODE_ID"] != envs[1]["TRAINGUARD_NODE_ID"], envs


def test_nnodes_min_max_waits_for_the_last_call_like_torchrun(tmp_path: Path, tg_env: dict) -> None:
    """``--nnodes 1:2``: the second node starts a second and a half after the first. torchrun's rendezvous waits
    last_call_timeout after MIN joined for more nodes, so both nodes form one 2-node world; starting on MIN at once
    ran the job on one node and left the other idle as a standby."""
    line = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{_port()}", "--rdzv-id", "lastcall", "--rdzv-conf", "last_call_timeout=20",
            "--max-restarts", "0"]
    _staggered_nodes(line, [["--node-id", "lc-a"], ["--node-id", "lc-b", "--local-addr", "127.0.0.1"]],
                     tmp_path / "out", tg_env, delay_s=1.5, last_fails_first=False)
    envs = {int(f.stem[3:]): json.loads(f.read_text())["env"] for f in (tmp_path / "out").glob("env*.json")}
    assert sorted(envs) == [0, 1], envs
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"2"} and {e["GROUP_WORLD_SIZE"] for e in envs.values()} \
        == {"2"}, envs


def test_default_node_ids_are_unique_per_agent_where_agents_share_a_host() -> None:
    from trainguard.agent.run_torchrun import Rendezvous, default_node_id

    def rdzv(**kw) -> Rendezvous:
        return Rendezvous(coordinator=None, listen="127.0.0.1:0", min_nodes=2, max_nodes=2, job="j",
                          multi_node=True, **kw)

    # Static rendezvous: the node rank tells the agents apart and survives a restart of the agent.
    assert default_node_id(rdzv(static_rank=0), None, "vm", 11) == "vm-r0"
    assert default_node_id(rdzv(static_rank=1), "127.0.0.1:29500", "vm", 12) == "vm-r1"
    # c10d: the embedding agent keeps the host name; one joining it on the same host gets its pid.
    assert default_node_id(rdzv(), None, "vm", 11) == "vm"
    assert default_node_id(rdzv(), "127.0.0.1:29400", "vm", 12) == "vm-p12"
    assert default_node_id(rdzv(), "localhost:29400", "vm", 13) == "vm-p13"
    # Joining another host's coordinator (TEST-NET address, never local): the host name, stable.
    assert default_node_id(rdzv(), "192.0.2.7:29400", "vm", 12) == "vm"
    # One node: the host name.
    one = Rendezvous(coordinator=None, listen="127.0.0.1:0", min_nodes=1, max_nodes=1, job=None)
    assert default_node_id(one, None, "vm", 11) == "vm"


@pytest.mark.parametrize("flags,warned", [
    ([], False),  # one node joining a coordinator on this host: 127.0.0.1 is the right address
    (["--nnodes", "2"], True),  # a multi-node job whose coordinator is at loopback: other hosts cannot join
])
def test_loopback_warning_only_for_a_real_multi_node_job(caplog, flags: list[str], warned: bool) -> None:
    import argparse
    import logging

    from trainguard.agent.run_args import add_run_arguments
    from trainguard.agent.run_torchrun import default_address, resolve_rendezvous

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--coordinator", "127.0.0.1:29400", *flags, PRINT_ENV])
    with caplog.at_level(logging.WARNING, logger="trainguard.agent.run_torchrun"):
        assert default_address(resolve_rendezvous(args), None) == "127.0.0.1"
    assert ("coordinator at loopback" in caplog.text) is warned, caplog.text


def test_one_node_default_job_name_follows_the_checkpoint_directory(tmp_path: Path) -> None:
    """Without --job/--rdzv-id, rerunning a one-node command later is the same job when it checkpoints to the
    same place (so it finds its memory copy); other directories, or none, are other jobs."""
    from trainguard.agent.run_torchrun import Rendezvous, default_job_name

    solo = Rendezvous(coordinator=None, listen="127.0.0.1:0", min_nodes=1, max_nodes=1, job="", multi_node=False)
    a, b = tmp_path / "a", tmp_path / "b"
    name = default_job_name("train.py", solo, 1000.0, str(a))
    assert name.startswith("train-") and name == default_job_name("/x/train.py", solo, 9999.0, str(a / ".." / "a"))
    assert name != default_job_name("train.py", solo, 1000.0, str(b))
    assert default_job_name("train.py", solo, 1000.0, "s3://bucket/run") != default_job_name(
        "train.py", solo, 1000.0, "s3://bucket/other")
    # Nothing to resume: the start time and the launcher's pid (two runs started in the same second are apart).
    import re

    assert re.fullmatch(r"train-1000-42-[0-9a-f]{4}", default_job_name("train.py", solo, 1000.0, pid=42))
    assert re.fullmatch(rf"train-1000-{os.getpid()}-[0-9a-f]{{4}}", default_job_name("train.py", solo, 1000.9))
    # Launchers of one pid (containers sharing the memory-tier root) are apart too.
    assert len({default_job_name("train.py", solo, 1000.0, pid=1) for _ in range(8)}) > 1


@pytest.mark.skipif(not tg_testutil.ipv6_loopback(), reason="no IPv6 loopback here")
def test_c10d_endpoint_at_an_ipv6_literal_like_torchrun(tmp_path: Path, tg_env: dict) -> None:
    """torchrun takes `--rdzv-endpoint [::1]:PORT`; the agent embedding the coordinator there dialled it as
    `::1:PORT` (no brackets), never reached it and ended after its join timeout."""
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(["run", "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", "[::1]:0", "--rdzv-conf", "join_timeout=5", PRINT_ENV, str(out)], tg_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "env0.json").read_text())["env"]["WORLD_SIZE"] == "1"


@pytest.mark.parametrize("rank,coordinator,listen", [
    ("1", "192.0.2.7:29511", ""),  # node rank 1 joins the endpoint's host, not MASTER_ADDR's 127.0.0.1:29500
    ("0", None, "192.0.2.7:29511"),  # node rank 0 embeds the coordinator there (is_host is not consulted)
])
def test_static_backend_takes_the_rdzv_endpoint_like_torchrun(rank: str, coordinator: str | None,
                                                                listen: str) -> None:
    """``torchrun --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`` (static backend, the default): torchrun
    puts the rendezvous at the endpoint (``get_rdzv_endpoint``); trainguard ignored it and used
    ``--master-addr:--master-port``'s defaults, so node 1 dialled its own loopback port 29500."""
    import argparse

    from trainguard.agent.run_args import add_run_arguments
    from trainguard.agent.run_torchrun import resolve_rendezvous

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--nnodes=2", f"--node-rank={rank}", "--rdzv-endpoint=192.0.2.7:29511", PRINT_ENV])
    rdzv = resolve_rendezvous(args)
    assert (rdzv.coordinator, rdzv.listen, rdzv.endpoint) == (coordinator, listen, "192.0.2.7:29511")
    # Without a port the endpoint keeps --master-port's (else 29500), as the static backend's default.
    args = parser.parse_args(["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=192.0.2.7", "--master-port=29522",
                              PRINT_ENV])
    assert resolve_rendezvous(args).coordinator == "192.0.2.7:29522"


def test_join_timeout_defaults_to_torchrun_s_600_s_for_the_first_generation_only() -> None:
    """torchrun waits 600 s (its join_timeout default) for the nodes of a rendezvous; ours gave up on peers after
    60 s, the bound meant for an unreachable coordinator, so nodes of one job starting minutes apart failed. A given
    join_timeout bounds both, as torchrun's bounds its whole rendezvous."""
    import argparse

    from trainguard.agent.run_args import add_run_arguments
    from trainguard.agent.run_torchrun import resolve_rendezvous

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    base = ["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=192.0.2.7:29511"]
    rdzv = resolve_rendezvous(parser.parse_args(base + [PRINT_ENV]))
    assert (rdzv.form_timeout_s, rdzv.join_timeout_s) == (600.0, 60.0)
    rdzv = resolve_rendezvous(parser.parse_args(base + ["--rdzv-conf", "join_timeout=7", PRINT_ENV]))
    assert (rdzv.form_timeout_s, rdzv.join_timeout_s) == (7.0, 7.0)


def test_a_coordinator_list_joins_the_one_that_answers(tmp_path: Path, tg_env: dict) -> None:
    """``--coordinator A,B`` (a coordinator and where it may be restarted; the link tries them in turn) was refused
    as 'one HOST[:PORT]' by the launcher although the link takes a list."""
    from trainguard.recovery.service import CoordinatorServer
    from trainguard.recovery.spec import JobSpec

    srv = CoordinatorServer(JobSpec(job="listed", nnodes=1, heartbeat_interval_s=0.1), listen="127.0.0.1:0").start()
    try:
        dead = f"127.0.0.1:{_port()}"
        r = run_cli(["run", "--coordinator", f"{dead},{srv.target}", "--job", "listed", "--nproc-per-node", "1",
                     "--no-standby", "--rdzv-conf", "join_timeout=30", PRINT_ENV, str(tmp_path)], tg_env, timeout=90)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads((tmp_path / "env0.json").read_text())["env"]["RANK"] == "0"
    finally:
        srv.stop()
    import argparse

    from trainguard.agent.run_args import add_run_arguments
    from trainguard.agent.run_torchrun import default_job_name, default_node_id, resolve_rendezvous

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    rdzv = resolve_rendezvous(parser.parse_args(["--coordinator", "192.0.2.7:29400,192.0.2.8:29400", PRINT_ENV]))
    assert rdzv.multi_node  # not loopback: the job may span hosts
    # Without --job every node names the job after the first address's port, as for one address.
    assert default_job_name("train.py", rdzv, 0.0) == default_job_name(
        "train.py", resolve_rendezvous(parser.parse_args(["--coordinator", "192.0.2.7:29400", PRINT_ENV])), 0.0)
    assert default_node_id(rdzv, rdzv.coordinator, "h", 1) == "h"


@pytest.mark.parametrize("count", ["cpu", "auto"])
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind the launchers to one")
def test_nproc_cpu_counts_the_cpus_the_launcher_may_use_like_torchrun(tmp_path: Path, tg_env: dict,
                                                                      count: str) -> None:
    """Under taskset / a cgroup cpuset / Slurm's binding, ``--nproc-per-node cpu`` (and ``auto`` without an
    accelerator) starts one worker per CPU the launcher may run on, as torchrun does; it started one per CPU of
    the machine (64 workers on the 2 cores a job was given)."""
    one_cpu = min(os.sched_getaffinity(0))
    line = ["--standalone", "--nproc-per-node", count, "--max-restarts", "0", PRINT_ENV]
    ours, theirs = tmp_path / "trainguard", tmp_path / "torchrun"
    for launcher, out in (("trainguard", ours), ("torchrun", theirs)):
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else \
            [sys.executable, "-m", "trainguard.cli", "run"]
        r = subprocess.run(cmd + line + [str(out)], env=tg_env, cwd=REPO, capture_output=True, text=True, timeout=90,
                           preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}))
        assert r.returncode == 0, f"{launcher}: {r.stderr[-3000:]}"
    assert sorted(f.name for f in theirs.glob("env*.json")) == ["env0.json"]  # torchrun: one CPU, one worker
    assert sorted(f.name for f in ours.glob("env*.json")) == ["env0.json"]


@pytest.mark.parametrize("name,ckpt", [("_my train (copy).py", True), ("训练.py", False)])
def test_any_script_name_runs_as_under_torchrun(tmp_path: Path, tg_env: dict, name: str, ckpt: bool) -> None:
    """torchrun runs a script of any name; the default job name built from one with a leading ``_``, spaces or
    non-ASCII letters was refused ("job name '_my train (copy)-...' is invalid"), naming a job the user never
    gave. Now such characters become ``_`` in the default name, which the workers get as $TRAINGUARD_JOB."""
    from trainguard.recovery.spec import JOB_NAME_RE

    script = tmp_path / name
    script.write_text((SCRIPTS / "print_env.py").read_text())
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(["run", "--nproc-per-node", "1", "--max-restarts", "0",
                 *(["--checkpoint-dir", str(tmp_path / "ck")] if ckpt else []), str(script), str(out)], tg_env)
    assert r.returncode == 0, r.stderr[-3000:]
    job = json.loads((out / "env0.json").read_text())["env"]["TRAINGUARD_JOB"]
    assert JOB_NAME_RE.match(job), job


def _another_local_ipv4(name: str) -> str | None:
    """An IPv4 address of this host that ``name`` does not resolve to here (None when there is none)."""
    import psutil

    named = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    mine = sorted(a.address for nics in psutil.net_if_addrs().values() for a in nics if a.family == socket.AF_INET)
    return next((a for a in mine if a not in named), None)


def test_an_endpoint_named_by_host_name_serves_every_interface_like_torchrun(tmp_path: Path, tg_env: dict) -> None:
    """``--rdzv-endpoint $(hostname):PORT``: the host's name may resolve to loopback on the host itself (Debian's
    127.0.1.1) and to its network address on the other nodes. torchrun's store listens on every interface at
    the port; the embedded coordinator bound only what the name meant locally, so the other nodes were refused
    (here: a second agent dialling another address of this host started a coordinator of its own, and both waited
    for a second node forever)."""
    name = socket.gethostname()
    other = _another_local_ipv4(name)
    if other is None:
        pytest.skip(f"every IPv4 address of this host is one {name!r} resolves to")
    port = _port()
    out = tmp_path / "out"
    out.mkdir()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "by-name",
              "--max-restarts", "0", "--rdzv-conf", "join_timeout=20"]
    procs = []
    try:
        for endpoint in (f"{name}:{port}", f"{other}:{port}"):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainguard.cli", "run", *common, "--rdzv-endpoint", endpoint, PRINT_ENV,
                 str(out)], env=tg_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
            if len(procs) == 1:  # the first one embeds the coordinator: wait until it serves
                deadline = time.monotonic() + 30
                while _port_free_on("127.0.0.1", port) and _port_free_on(other, port):
                    assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()[1]
                    time.sleep(0.05)
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert sorted(f.name for f in out.glob("env*.json")) == ["env0.json", "env1.json"]


def _port_free_on(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


@pytest.mark.parametrize("flags,bind", [
    (["--nnodes=2", "--master-addr=head-node", "--master-port=29533"], "0.0.0.0:29533"),  # a name: every interface
    (["--nnodes=2", "--master-addr=192.0.2.7", "--master-port=29533"], ""),  # an address: that interface
    (["--nnodes=2", "--master-addr=head-node", "--coordinator-listen=10.0.0.1:29533"], ""),  # the user's choice
    (["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29533"], ""),  # one node
])
def test_static_node_rank_0_binds_a_named_master_on_every_interface(flags: list[str], bind: str) -> None:
    """The static backend's node rank 0 embeds the coordinator at MASTER_ADDR:MASTER_PORT; a MASTER_ADDR given
    as a host name binds every interface at that port, as torchrun's store does (see the c10d test above)."""
    import argparse

    from trainguard.agent.run_args import add_run_arguments
    from trainguard.agent.run_torchrun import resolve_rendezvous

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert resolve_rendezvous(parser.parse_args([*flags, PRINT_ENV])).bind == bind


def _name_means_loopback(name: str) -> bool:
    try:
        return all(ipaddress.ip_address(i[4][0]).is_loopback for i in socket.getaddrinfo(name, None))
    except OSError:
        return False


@pytest.mark.skipif(not _name_means_loopback(socket.gethostname()),
                    reason="this host's name does not resolve to loopback here (as Debian's 127.0.1.1 makes it)")
@pytest.mark.parametrize("joining", [True, False])
def test_a_host_name_meaning_loopback_here_is_no_loopback_node_address(joining: bool) -> None:
    """A multi-node job whose coordinator is named by this host's name, which resolves to loopback here: the
    node's address (MASTER_ADDR when it holds rank 0) was the route's source, 127.0.0.1, so the other nodes'
    workers dialled themselves. It is the host name, which they resolve to this host, as under torchrun."""
    from trainguard.agent.run_torchrun import Rendezvous, default_address

    endpoint = f"{socket.gethostname()}:29400"
    rdzv = Rendezvous(coordinator=endpoint if joining else None, listen="" if joining else endpoint, min_nodes=2,
                      max_nodes=2, job="j", multi_node=True, endpoint=endpoint)
    address = default_address(rdzv, None)
    assert address == socket.getfqdn() and not address.startswith("127."), address


def test_a_restart_budget_beyond_a_rank_table_is_a_one_line_error(tg_env: dict) -> None:
    """``--max-restarts 99999999999`` ("restart forever"): the budget travels in every rank table as an int32, so
    every heartbeat answer of the embedded coordinator failed with a traceback and the run waited for its first
    command forever. It is refused before anything starts, naming the flag and the limit."""
    r = run_cli(["run", "--max-restarts", "99999999999", PRINT_ENV, "/tmp"], tg_env, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "--max-restarts must be 0..2147483647" in r.stderr


def test_a_module_job_is_named_as_the_hook_names_it_under_torchrun(tmp_path: Path, tg_env: dict) -> None:
    """``-m pkg.train --checkpoint-dir D``: the hook under a one-node torchrun names the job after its
    ``sys.argv[0]`` (the module's file, ``.../pkg/train.py``: ``train-<hash of D>``); trainguard run named it
    ``pkg-<hash>``, so neither launcher found the other's checkpoints, and ``-m pkg.finetune`` on the same
    directory was the same job as ``-m pkg.train``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for mod in ("train", "finetune"):
        (pkg / f"{mod}.py").write_text(
            "import json, os, sys\n"
            "from trainguard.worker_env import checkpoint_job_name\n"
            "json.dump({'job': os.environ['TRAINGUARD_JOB'], 'hook': checkpoint_job_name(sys.argv[0], sys.argv[1])},"
            f" open(os.path.join(sys.argv[2], '{mod}.json'), 'w'))\n")
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    env = {**tg_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), tg_env.get("PYTHONPATH")]))}
    for mod in ("train", "finetune"):
        r = run_cli(["run", "--max-restarts", "0", "--checkpoint-dir", str(ck), "-m", f"pkg.{mod}", str(ck),
                     str(out)], env)
        assert r.returncode == 0, r.stderr[-3000:]
    train, finetune = (json.loads((out / f"{m}.json").read_text()) for m in ("train", "finetune"))
    assert train["job"] == train["hook"] and train["job"].startswith("train-"), train
    assert finetune["job"] == finetune["hook"] != train["job"], finetune


def test_a_taken_rendezvous_port_is_one_line_naming_it(capfd) -> None:
    # Node 0 of a static rendezvous embeds the coordinator at --master-port; a port another process holds was
    # reported by gRPC's own C++ log line first, then by ours with two different "pick another" hints.
    from trainguard.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(["run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                     str(port), "--local-addr", "127.0.0.1", PRINT_ENV, "/tmp"])
    err = capfd.readouterr().err
    assert code == 2, err
    errors = [ln for ln in err.splitlines() if "error" in ln.lower() or ln.startswith("E")]
    assert errors == [f"trainguard: error: cannot embed the coordinator on 127.0.0.1:{port}: port {port} is in use "
                      "by another process; pick another --rdzv-endpoint/--master-port or --coordinator-listen"], err


def test_node_0_stopped_by_a_signal_does_not_linger_for_its_peers(monkeypatch, capfd) -> None:
    # The node embedding the coordinator waited up to 10 s "for every node to hear that the job is over" after a
    # SIGTERM, though the job was not over (every live peer counts as untold then): a stopped launcher took 15 s
    # to exit. Its extras already linger, only for a job that ended.
    import grpc

    from trainguard.agent.node import NodeAgent
    from trainguard.cli import main
    from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc

    def stopped_once_a_peer_joined(self) -> int:
        with grpc.insecure_channel(self.config.coordinator) as ch:
            info = common_pb2.NodeInfo(node_id="peer", address="127.0.0.1", topology=common_pb2.Topology(
                pod_id="p", node_index=1, host="peer", device_count=1))
            coordinator_pb2_grpc.CoordinatorStub(ch).RegisterNode(pb.RegisterNodeRequest(
                job=self.config.job, node=info, free_port=_port()), timeout=10)
        return 128 + signal.SIGTERM  # what run() returns after a SIGTERM

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    seen = Lines()
    logging.getLogger("trainguard").addHandler(seen)  # main() sets up its own handlers: caplog sees nothing
    monkeypatch.setattr(NodeAgent, "run", stopped_once_a_peer_joined)
    try:
        code = main(["run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                     str(_port()), "--local-addr", "127.0.0.1", PRINT_ENV, "/tmp"])
    finally:
        logging.getLogger("trainguard").removeHandler(seen)
    err = capfd.readouterr().err
    assert code == 143, err
    assert not [ln for ln in seen.lines if "heard" in ln], seen.lines


def test_a_predictor_model_that_is_no_model_is_refused_before_anything_starts(tmp_path: Path, tg_env: dict) -> None:
    """--predictor-model was loaded only once the node had registered: a corrupt or foreign file ended the run
    after its coordinator formed generation 1 and counted the node lost (restart 1/3 logged)."""
    bad = tmp_path / "model.json"
    bad.write_text("{not json")
    r = run_cli(["run", "--predictor-model", str(bad), "--nproc-per-node", "1", PRINT_ENV, str(tmp_path)],
                tg_env, timeout=60)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("trainguard: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert "--predictor-model" in errors[0] and "not a JSON model file" in errors[0], errors
    assert "registered node" not in r.stderr and "generation" not in r.stderr, r.stderr[-2000:]
