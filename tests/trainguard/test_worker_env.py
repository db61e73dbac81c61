"""The worker environment contract: what a launcher writes (:meth:`WorkerEnv.to_env`) is what a worker reads
(:meth:`WorkerEnv.from_env`), names and all."""

from __future__ import annotations

import hashlib

import pytest

from trainguard.errors import ConfigError
from trainguard.worker_env import (
    AGENT_SOCKET_ENV,
    CHECKPOINT_DIR_ENV,
    ERROR_FILE_ENV,
    GENERATION_ENV,
    WorkerEnv,
    WorkerEnvError,
)


def test_what_the_launcher_writes_the_worker_reads_back() -> None:
    sent = WorkerEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, group_rank=1, group_world_size=2,
                     master_addr="10.0.0.1", master_port=29500, restart_count=3, max_restarts=7, run_id="job",
                     role="trainer", use_agent_store=True, error_file="/tmp/e.json", generation=4, job="job",
                     node_id="n1", agent_socket="/run/a.sock", checkpoint_dir="s3://b/ckpt",
                     checkpoint_service="/run/c.sock")
    env = sent.to_env({"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["RANK"] == "5" and env[GENERATION_ENV] == "4"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["OMP_NUM_THREADS"] == "1"
    assert WorkerEnv.from_env(env) == sent


def test_alone_a_worker_is_rank_0_of_1_and_plain_torchrun_names_the_job() -> None:
    alone = WorkerEnv.from_env({})
    assert (alone.rank, alone.world_size, alone.generation, alone.job_name) == (0, 1, 0, "default")
    assert alone.agent_socket is None and alone.checkpoint_dir is None
    torchrun = WorkerEnv.from_env({"RANK": "2", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "tr", "RANK_X": "?"})
    assert (torchrun.rank, torchrun.world_size, torchrun.job_name) == (2, 4, "tr")
    assert WorkerEnv.from_env({"TRAINGUARD_JOB": "tg", "TORCHELASTIC_RUN_ID": "tr"}).job_name == "tg"


def test_optional_variables_are_left_out_and_a_stale_error_file_is_removed() -> None:
    env = WorkerEnv().to_env({ERROR_FILE_ENV: "/old", AGENT_SOCKET_ENV: "/inherited"})
    assert ERROR_FILE_ENV not in env and CHECKPOINT_DIR_ENV not in env
    assert env[AGENT_SOCKET_ENV] == "/inherited"  # only set values override the base


def test_a_malformed_integer_names_the_variable() -> None:
    with pytest.raises(WorkerEnvError, match=r"TRAINGUARD_GENERATION='x' is not an integer"):
        WorkerEnv.from_env({GENERATION_ENV: "x"})
    assert issubclass(WorkerEnvError, ConfigError)


def test_virtual_local_rank_narrows_the_visible_devices() -> None:
    env = WorkerEnv(local_rank=1, local_world_size=2).to_env({"CUDA_VISIBLE_DEVICES": "4,5"},
                                                                virtual_local_rank=True)
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "5")
    with pytest.raises(WorkerEnvError, match="local rank 2 has no device"):
        WorkerEnv(local_rank=2).to_env({"CUDA_VISIBLE_DEVICES": "4,5"}, virtual_local_rank=True)


def test_the_users_own_buffering_wins() -> None:
    """Found by a user's review: PYTHONUNBUFFERED was forced to 1 over the user's own setting."""
    assert WorkerEnv().to_env({})["PYTHONUNBUFFERED"] == "1"
    assert WorkerEnv().to_env({"PYTHONUNBUFFERED": ""})["PYTHONUNBUFFERED"] == ""


def test_only_a_standalone_run_id_is_replaced_by_the_checkpoint_job_name(tmp_path) -> None:
    from trainguard.worker_env import checkpoint_job_name, torchrun_made_run_id

    assert torchrun_made_run_id("1516a3a8-3556-40d7-8f40-61188d81d1c8")
    assert not any(torchrun_made_run_id(r) for r in ("exp7", "", "none", "1516a3a8-3556-10d7-8f40-61188d81d1c8"))
    name = checkpoint_job_name("/x/train.py", str(tmp_path / "ck"))
    assert name.startswith("train-") and name == checkpoint_job_name("train.py", f"{tmp_path}/ck/")
    assert checkpoint_job_name("/x/pkg/__main__.py", "s3://b/p").startswith("pkg-")


def test_one_checkpoint_directory_gives_one_job_name_however_it_is_spelled(tmp_path, monkeypatch) -> None:
    """Found by the checkpoint review: ``--checkpoint-dir file:///d`` and ``/d`` hashed to different names, so a
    launcher and a hook given the two spellings of one directory named the job differently (and resumed nothing)."""
    from trainguard.checkpoint.errors import CheckpointConfigError
    from trainguard.worker_env import checkpoint_job_name

    real = tmp_path / "ck"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    name = checkpoint_job_name("train.py", str(real))
    for spelling in (f"file://{real}", f"file://{real}/", f"file:{real}", f"FILE://{real}", f"local://{real}",
                     f"{real}/", "ck", "./ck/", "link", f"file://{tmp_path}/link", "file:ck"):
        assert checkpoint_job_name("/x/train.py", spelling) == name, spelling
    # Jobs named from a plain absolute path before keep their name (their checkpoints live under it).
    assert checkpoint_job_name("train.py", "/trainguard-no-such-dir/ckpt") == "train-58e6efb7f3"
    # A canonical remote URL keeps its name; a file:// URL with a host part names no agreed directory.
    assert checkpoint_job_name("train.py", "s3://b/p") == "train-7fb9692596"
    with pytest.raises(CheckpointConfigError, match="absolute path"):
        checkpoint_job_name("train.py", "file://ck")


@pytest.mark.parametrize("script", ["_train.py", "my train (copy).py", "训练.py", "train.py"])
def test_the_hook_names_an_odd_script_as_trainguard_run_does(tmp_path, script) -> None:
    """Under a one-node torchrun the hook names the job ``checkpoint_job_name(sys.argv[0], dir)``; trainguard run
    made odd script names valid (``_train`` -> ``train``) while the hook kept them, so the two launchers used two
    job folders of one checkpoint directory and neither resumed the other's steps."""
    from trainguard.agent.run_torchrun import Rendezvous, default_job_name
    from trainguard.recovery.spec import JOB_NAME_RE
    from trainguard.worker_env import checkpoint_job_name

    ck = str(tmp_path / "ck")
    hook = checkpoint_job_name(str(tmp_path / script), ck)
    assert JOB_NAME_RE.match(hook), hook
    assert hook == default_job_name(str(tmp_path / script), Rendezvous(None, "127.0.0.1:0", 1, 1, None), 0.0, ck)


def test_one_remote_location_gives_one_job_name_however_it_is_spelled() -> None:
    """Found by review: the URL was hashed as typed, so ``s3://b/x/`` and ``s3://b/x`` (one folder in the bucket,
    one canonical URL since the checkpoint layer's canonical form) named two jobs and a relaunch spelled
    differently resumed none of the checkpoints. The canonical spelling keeps the name it had."""
    from trainguard.worker_env import checkpoint_job_name

    name = checkpoint_job_name("train.py", "s3://b/x")
    assert name == "train-" + hashlib.sha256(b"s3://b/x").hexdigest()[:10]  # as named before: checkpoints live there
    for spelling in ("s3://b/x/", "s3://b//x", "S3://b/x", "s3://b/x//"):
        assert checkpoint_job_name("train.py", spelling) == name, spelling
    assert checkpoint_job_name("train.py", "s3://b/y") != name
