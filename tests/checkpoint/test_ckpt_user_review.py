"""Regression tests for what a new user's review of the checkpoint API and `trainguard ckpt` found."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import tempfile

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.errors import CheckpointConfigError
from trainguard.checkpoint.location import CheckpointLocation
from trainguard.checkpoint.storage import step_dirname
from trainguard.cli import main

# Nothing listens on port 1: a remote location whose tier fails at once, while the disk tier (its local cache)
# still commits, as with an unreachable or misconfigured bucket.
UNREACHABLE = "ftp://127.0.0.1:1"


def _remote_cfg(directory: str, **kw) -> CheckpointConfig:
    return CheckpointConfig(directory=directory, memory={"enabled": False}, persist={"service": "inline"}, **kw)


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ckpt", *args])
    return rc, out.getvalue(), err.getvalue()


def _local_steps(root: str, job: str = "j", steps: tuple[int, ...] = (0, 1, 2, 3)) -> CheckpointConfig:
    cfg = CheckpointConfig(directory=root, memory={"enabled": False}, persist={"service": "inline"},
                           disk={"keep": 10})
    _save(cfg, job, steps, 0.0)
    return cfg


def _save(cfg: CheckpointConfig, job: str, steps: tuple[int, ...], value: float) -> None:
    with Checkpointer(cfg, job=job) as ck:
        for s in steps:
            ck.save({"w": torch.full((1000,), value + s)}, s)


# ---------------------------------------------------------------------- remote locations sharing one disk cache
def test_two_remote_locations_get_their_own_default_local_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = _remote_cfg(f"{UNREACHABLE}/bucket-a/exp1"), _remote_cfg(f"{UNREACHABLE}/bucket-b/other-exp")
    assert a.disk_directory != b.disk_directory  # both were <tmp>/trainguard-ckpt
    assert os.path.dirname(a.disk_directory) == str(tmp_path / "trainguard-ckpt-cache")
    assert _remote_cfg(f"{UNREACHABLE}/bucket-a/exp1/").disk_directory == a.disk_directory
    _save(a, "train", (50, 51, 52), 1.0)
    live = {"w": torch.zeros(1000)}
    with Checkpointer(b, job="train") as ck:
        assert ck.restore(live) is None  # restored A's step 52 from the shared folder
    assert torch.equal(live["w"], torch.zeros(1000))
    with Checkpointer(a, job="train") as ck:
        assert ck.restore(live) == 52 and ck.last_restore_tier == "disk"
    assert torch.equal(live["w"], torch.full((1000,), 53.0))


def test_a_local_cache_shared_by_two_urls_never_restores_the_other_urls_steps(tmp_path, caplog):
    cache = str(tmp_path / "cache")
    a = _remote_cfg(f"{UNREACHABLE}/bucket-a/exp1", local_cache=cache)
    b = _remote_cfg(f"{UNREACHABLE}/bucket-b/other-exp", local_cache=cache)
    _save(a, "train", (7,), 1.0)
    live = {"w": torch.zeros(1000)}
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        with Checkpointer(b, job="train") as ck:
            assert ck.steps() == [] and ck.restore(live) is None
    assert torch.equal(live["w"], torch.zeros(1000))
    warned = [r.getMessage() for r in caplog.records if "not restoring step 7 from the disk tier" in r.getMessage()]
    assert warned and f"{UNREACHABLE}/bucket-a/exp1" in warned[0] and f"{UNREACHABLE}/bucket-b/other-exp" in warned[0]
    with Checkpointer(a, job="train") as ck:  # its own steps still restore
        assert ck.restore(live) == 7 and torch.equal(live["w"], torch.full((1000,), 8.0))


# ---------------------------------------------------------------------- a step folder copied to another step
def test_verify_and_gc_refuse_a_step_folder_copied_to_another_step(tmp_path):
    root = str(tmp_path / "ck")
    cfg = _local_steps(root)
    shutil.copytree(os.path.join(root, "j", step_dirname(3)), os.path.join(root, "j", step_dirname(9)))
    rc, out, _ = _cli("verify", root)
    assert rc == 1 and "step 9 rank 0: CORRUPT: step 9 rank 0: manifest names step 3 rank 0" in out, out  # was OK
    assert "step 3 rank 0: OK" in out
    rc, out, _ = _cli("gc", root, "--keep", "1")
    lines = out.strip().splitlines()
    assert rc == 0 and lines[0].startswith("kept step 9: CORRUPT, not counted toward --keep"), out
    assert lines[1] == "kept step 3: verifies (1 of 1 kept by --keep)"
    assert lines[-1] == "removed 3 step(s): [0, 1, 2]"  # was [0, 1, 2, 3]: nothing restorable left
    live = {"w": torch.zeros(1000)}
    with Checkpointer(cfg, job="j") as ck:
        assert ck.restore(live) == 3 and torch.equal(live["w"], torch.full((1000,), 3.0))


# ---------------------------------------------------------------------- a plain file named like a step
def test_a_stray_file_named_like_a_step_is_skipped_everywhere(tmp_path, caplog):
    root = str(tmp_path / "ck")
    cfg = _local_steps(root)
    stray = os.path.join(root, "j", step_dirname(5))
    with open(stray, "w") as f:
        f.write("x")
    live = {"w": torch.zeros(1000)}
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        with Checkpointer(cfg, job="j") as ck:
            assert ck.restore(live) == 3  # raised NotADirectoryError
        for action in ("ls", "verify"):
            rc, out, err = _cli(action, root)
            assert rc == 0 and "Traceback" not in err, (action, out, err)  # exit 1 with a traceback
        rc, out, _ = _cli("gc", root, "--keep", "2")
        assert rc == 0 and out.strip().splitlines()[-1] == "removed 2 step(s): [0, 1]", out
    assert os.path.isfile(stray)  # not ours to delete
    assert [r.getMessage() for r in caplog.records if stray in r.getMessage()] == [
        f"ignoring {stray}: a file named like a checkpoint step, not a step folder; remove or rename it"]


def test_a_remote_object_named_like_a_step_is_not_a_step(tmp_path):
    store = CheckpointLocation.parse(f"memory://{tmp_path}/ck").open_store("j")
    store.commit_rank(3, 0, 1, "d")
    store.fs.pipe_file(f"{store.job_dir}/{step_dirname(5)}", b"x")
    assert store.list_steps() == [3]  # was [3, 5]


# ---------------------------------------------------------------------- job names that leave the root
def test_cli_refuses_a_job_name_that_is_not_a_folder_of_the_root(tmp_path):
    root = str(tmp_path / "ck")
    _local_steps(root, steps=(4,))
    assert _cli("export", root, str(tmp_path / "dcp"))[0] == 0
    rc, out, err = _cli("import", str(tmp_path / "dcp"), str(tmp_path / "imp"), "--job", "../evil")
    assert rc == 2 and err.strip() == ("trainguard: error: job name '../evil' is not a valid directory name (it is "
                                       "empty, holds '/' or starts with '.'); use letters, digits, -_"), err
    assert not os.path.exists(tmp_path / "evil") and not os.path.exists(tmp_path / "imp")  # was written, rc 0
    for action in ("ls", "verify"):
        rc, _, err = _cli(action, root, "--job", "../ck")
        assert rc == 2 and "job name '../ck' is not a valid directory name" in err, (action, err)


@pytest.mark.parametrize("kw, words", [
    ({"job": "step_000000000001"}, "named like a step folder"),  # saved, then no ckpt command could reach it
    ({"job": "x\x00y"}, "holds a control character"),  # a bare ValueError: embedded null byte
    ({"rank": "0", "world_size": "2"}, "rank must be an integer, got str '0'; pass int(...)"),  # a bare TypeError
    ({"world_size": 2.0}, "world_size must be an integer, got float 2.0"),
])
def test_checkpointer_arguments_a_user_gets_wrong_are_named(tmp_path, kw, words):
    from trainguard.checkpoint import CheckpointError

    cfg = _local_steps(str(tmp_path / "ck"), steps=(1,))
    with pytest.raises(CheckpointError, match=re.escape(words)):
        Checkpointer(cfg, **kw)
    rc, _, err = _cli("ls", str(tmp_path / "ck"), "--job", "step_000000000001")
    assert rc == 2 and "named like a step folder" in err, err


# ---------------------------------------------------------------------- file:/abs (one slash), as fsspec reads it
def test_a_single_slash_file_url_is_the_local_absolute_path(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    loc = CheckpointLocation.parse(f"file:{tmp_path}/ck")
    assert loc.is_local and loc.local_path == f"{tmp_path}/ck"  # was ./file:/.../ck
    assert CheckpointLocation.parse(f"FILE:{tmp_path}/ck").identity == loc.identity == str(tmp_path / "ck")
    cfg = _local_steps(f"file:{tmp_path}/ck", steps=(1,))
    assert cfg.disk_directory == f"{tmp_path}/ck" and os.path.isdir(tmp_path / "ck" / "j" / step_dirname(1))
    rc, out, _ = _cli("ls", f"file:{tmp_path}/ck")
    assert rc == 0 and out.startswith(f"job j at {tmp_path}/ck/j;"), out
    assert os.listdir(cwd) == []

    # The agent's readers of the same location agree (a disk qualification target, a default job name).
    from trainguard.agent.qualify.local import _local_dir
    from trainguard.agent.run_torchrun import Rendezvous, default_job_name

    assert _local_dir(f"file:{tmp_path}/ck") == f"{tmp_path}/ck" and _local_dir("s3://b/p") is None
    solo = Rendezvous(coordinator=None, listen="127.0.0.1:0", min_nodes=1, max_nodes=1, job="", multi_node=False)
    name = default_job_name("train.py", solo, 0.0, "file:/data/ck")
    monkeypatch.chdir(tmp_path)
    assert default_job_name("train.py", solo, 0.0, "file:/data/ck") == name  # hashed ./file:/data/ck before


# ---------------------------------------------------------------------- small CLI findings
def test_ckpt_commands_refuse_a_job_the_root_does_not_hold(tmp_path):
    root = str(tmp_path / "ck")
    _local_steps(root, job="train", steps=(1,))
    _local_steps(root, job="eval", steps=(1,))
    for action in ("ls", "verify", "gc", "export"):
        extra = {"gc": ["--keep", "1"], "export": [str(tmp_path / "out")]}.get(action, [])
        rc, out, err = _cli(action, root, "--job", "nosuchjob", *extra)
        # ls printed an empty table with exit code 0; gc said "nothing to remove"
        assert rc == 2 and err.strip() == (f"trainguard: error: {root} holds no job 'nosuchjob' (jobs there: "
                                           "eval, train); check --job"), (action, out, err)
    assert _cli("ls", root, "--job", "train")[0] == 0


def test_export_refuses_a_non_empty_output_folder_without_force(tmp_path):
    root, out = str(tmp_path / "ck"), tmp_path / "out"
    _local_steps(root, steps=(1, 2))
    assert _cli("export", root, str(out), "--step", "1")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, _, err = _cli("export", root, str(out), "--step", "2")
    assert rc == 2 and err.strip() == (f"trainguard: error: {out} is not empty; choose a new folder, or pass --force "
                                       "to write the export into it"), err  # overwrote step 1's export, rc 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    rc, stdout, _ = _cli("export", root, str(out), "--step", "2", "--force")
    assert rc == 0 and stdout.startswith("exported step 2 of job j")
    (tmp_path / "empty").mkdir()
    assert _cli("export", root, str(tmp_path / "empty"))[0] == 0  # an empty folder needs no --force


def test_an_unknown_url_scheme_is_refused_at_config_time_naming_the_key(tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"^checkpoint.directory = 'bogus://x/y': fsspec knows no "
                                                    r"protocol 'bogus'; use a local path"):
        CheckpointConfig(directory="bogus://x/y")  # was accepted; every save then failed
    with pytest.raises(CheckpointConfigError, match=r"^checkpoint.remote.url = 'simplecache::bogus://b': .*'bogus'"):
        CheckpointConfig(directory=str(tmp_path), remote={"url": "simplecache::bogus://b"})
    # Known protocols pass, even when their package is not installed where the config is built.
    for url in ("s3://bucket/p", "GS://bucket/p", "ftp://host/p", "simplecache::s3://bucket/p"):
        assert CheckpointConfig(directory=url).remote_url == url.replace("GS:", "gs:")  # one spelling per URL
