"""`trainguard run` refuses, before anything starts, values it used to ignore or refuse late: a malformed
--rdzv-endpoint on any rendezvous, a --fault rank outside the world, a --node-id the coordinator refuses, and
bad $PET_* defaults named as the variable. The real CLI in a subprocess; the script marks whether it ran."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tg_testutil import run_cli

from trainguard.errors import UsageError



def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_", "TRAINGUARD_"))}
    env.update(extra)
    return env


def _refused(tmp_path: Path, args: list[str], **env: str) -> str:
    """Runs `trainguard run ARGS script` and returns its one error line; asserts the script never ran."""
    ran = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    out = run_cli(["run", *args, str(script)], _env(**env), timeout=60, cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, out.stderr
    assert not ran.exists(), "the script ran: the value was not refused before the start"
    return errors[0]


@pytest.mark.parametrize("extra", [[], ["--standalone"], ["--rdzv-backend", "c10d"], ["--nnodes", "2"]],
                         ids=["static-one-node", "standalone", "c10d", "two-nodes"])
def test_a_non_numeric_rdzv_endpoint_port_is_refused_on_every_rendezvous(tmp_path, extra):
    line = _refused(tmp_path, [*extra, "--rdzv-endpoint", "localhost:x"])
    assert "--rdzv-endpoint 'localhost:x': the port must be a number" in line


def test_more_workers_than_a_node_may_run_is_refused_naming_the_flag(tmp_path):
    # the embedded coordinator started first, then refused the registration naming node.topology.device_count
    line = _refused(tmp_path, ["--standalone", "--nproc-per-node=100000"])
    assert "--nproc-per-node 100000: 100000 worker processes on one node; at most 1024" in line, line


def test_a_fault_on_a_rank_outside_the_world_is_refused(tmp_path):
    line = _refused(tmp_path, ["--nproc-per-node", "2", "--fault", "5:10"])
    assert "--fault '5:10'" in line and "rank 5" in line and "world size is 2" in line


def test_a_fault_rank_counts_every_node_of_the_job(tmp_path):
    line = _refused(tmp_path, ["--nnodes", "1:2", "--nproc-per-node", "2", "--fault", "4:10"])
    assert "world size is 4" in line and "--nnodes" in line


def test_a_malformed_node_id_is_refused_by_the_coordinators_rule(tmp_path):
    from trainguard.recovery.errors import InvalidRequestError
    from trainguard.recovery.service import check_node_id

    with pytest.raises(InvalidRequestError):  # what the coordinator answers at registration
        check_node_id("node_id", "gpu 7")
    line = _refused(tmp_path, ["--node-id", "gpu 7"])
    assert "--node-id 'gpu 7' is not a valid node id" in line


@pytest.mark.parametrize("var,value,flag", [
    ("PET_MAX_RESTARTS", "abc", "--max-restarts"),   # an int flag: argparse's own conversion
    ("PET_START_METHOD", "bogus", "--start-method"),  # a choices flag: argparse never checked a default
    ("PET_NNODES", "x", "--nnodes"),                  # a text flag checked by the launcher
    ("PET_RDZV_ENDPOINT", "localhost:x", "--rdzv-endpoint"),
])
def test_a_bad_pet_default_is_named_as_the_variable(tmp_path, var, value, flag):
    line = _refused(tmp_path, [], **{var: value})
    assert f"${var}" in line and f"the default of {flag}" in line, line
    assert not line.split("error: ", 1)[1].startswith(("argument --", flag)), line


def test_a_bad_flag_value_is_still_named_as_the_flag(tmp_path):
    line = _refused(tmp_path, ["--max-restarts", "abc"], PET_MAX_RESTARTS="2")
    assert "--max-restarts" in line and "PET_" not in line


def test_a_typed_switch_is_named_as_the_flag_beside_its_pet_variable(tmp_path):
    """Switches (store_true) were never noted as typed: with $PET_STANDALONE set (even to 0) in the environment,
    an error about a typed --standalone named the variable."""
    line = _refused(tmp_path, ["--standalone", "--nnodes", "2"], PET_STANDALONE="0")
    assert "--standalone is for one node" in line and "PET_" not in line, line


def test_a_node_joining_a_coordinator_without_nnodes_leaves_the_world_size_to_it():
    from trainguard.agent import run_torchrun as tr
    from trainguard.agent.run import _check_fault_ranks
    from trainguard.agent.run_args import parse_fault
    from trainguard.cli import build_parser

    def check(*flags: str) -> None:
        args = build_parser().parse_args(["run", "--coordinator", "127.0.0.1:29400", *flags, "--fault", "5:10",
                                          "train.py"])
        _check_fault_ranks(args, [parse_fault("5:10")], 1, tr.resolve_rendezvous(args))

    check()  # the job may have more nodes than this one: the coordinator knows its size
    with pytest.raises(UsageError, match="world size is 2"):
        check("--nnodes", "2")


def test_a_checkpoint_directory_from_the_environment_is_checked_under_its_name(tmp_path):
    # $TRAINGUARD_CHECKPOINT_DIR is the launcher's checkpoint directory when --checkpoint-dir is not given (the job
    # is named after it, so a relaunch resumes): one no worker could use is refused as the flag's would be.
    line = _refused(tmp_path, ["--nproc-per-node", "1"], TRAINGUARD_CHECKPOINT_DIR="memory://ck")
    assert "$TRAINGUARD_CHECKPOINT_DIR" in line and "memory://" in line, line


def test_max_restarts_given_to_a_node_of_an_external_coordinator_is_said_to_be_the_coordinators(tmp_path):
    # Ignored without a word: the node's --max-restarts 4 ran "restart 1/3" (the coordinator's default budget).
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    flags = ["run", "--coordinator", "127.0.0.1:1", "--job", "jw", "--rdzv-conf", "join_timeout=1", "--no-standby"]
    out = run_cli([*flags, "--max-restarts", "4", str(script)], _env(), timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "--max-restarts 4 is not this node's to set" in out.stderr, out.stderr
    assert "trainguard coordinator --max-restarts N" in out.stderr
    out = run_cli([*flags, str(script)], _env(), timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "--max-restarts" not in out.stderr, out.stderr
