"""The one parser of a checkpoint location: paths and URLs, and layout questions through StepStore."""

from __future__ import annotations

import os

import pytest

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointConfigError, CheckpointError
from trainguard.checkpoint.location import CheckpointLocation, canonical_url, job_step_committed, step_committed
from trainguard.checkpoint.storage import FsspecStore, LocalStore


def test_paths_and_file_urls_are_local_other_urls_remote(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    plain, url, remote = (CheckpointLocation.parse(t) for t in ("ck", f"file://{tmp_path}/ck", "S3://b/p/"))
    assert plain.is_local and url.is_local and not remote.is_local and remote.scheme == "s3"
    assert plain.for_workers() == str(tmp_path / "ck") and url.for_workers() == url.text
    assert plain.identity == url.identity == os.path.realpath(tmp_path / "ck")
    assert remote.identity == "s3://b/p" and remote.disk_directory("/cache") == "/cache"
    with pytest.raises(CheckpointError, match="not on the local filesystem"):
        remote.local_path  # noqa: B018
    with pytest.raises(CheckpointConfigError, match="--checkpoint-dir is empty"):
        CheckpointLocation.parse(" ", "--checkpoint-dir")


@pytest.mark.parametrize("same", ["s3://bucket/x/", "s3://bucket//x", "S3://bucket/x", "s3://bucket/x//",
                                  "s3://bucket//x///"])
def test_one_remote_location_has_one_identity_cache_and_url_however_spelled(same: str) -> None:
    # A relaunch with a trailing slash or a doubled one (a variable joined as "$BUCKET/$RUN") hashed to another
    # disk cache and opened another folder in the bucket (bucket//x/job is another S3 key): no checkpoint found.
    want = CheckpointConfig(directory="s3://bucket/x")
    got = CheckpointConfig(directory=same)
    assert (got.location, got.disk_directory, got.remote_url) == (want.location, want.disk_directory,
                                                                   "s3://bucket/x")
    assert CheckpointLocation.parse(same).url == "s3://bucket/x"


def test_canonical_url_keeps_what_may_mean_something() -> None:
    assert canonical_url("file:///data//ck/") == "file:///data/ck" and canonical_url("/data//ck/") == "/data//ck/"
    assert canonical_url("SimpleCache::s3://b//x/") == "simplecache::s3://b/x"  # the last link names the path
    assert canonical_url("zip://a//b::s3://c//d/") == "zip://a//b::s3://c//d"  # several links: only the trailing /
    assert canonical_url("https://h/p?a=b//c") == "https://h/p?a=b//c" and canonical_url("s3://b") == "s3://b"


def test_a_step_written_through_one_spelling_is_found_through_another(tmp_path) -> None:
    # memory:// keeps "//" in a path as S3 does: a doubled slash opened another folder, found empty.
    CheckpointLocation.parse(f"memory://{tmp_path}//ck/").open_store("j").commit_rank(3, 0, 1, "d")
    assert job_step_committed(f"memory://{tmp_path}/ck", "j", 3, 1)


@pytest.mark.parametrize("spelling", ["{d}/", "file://{d}", "{d}/../ck", "{link}"])
def test_a_remote_tier_on_the_disk_tiers_own_folder_is_refused(tmp_path, spelling: str) -> None:
    # Found testing as a user: the upload opened the disk copy's file for writing, emptying it before reading it;
    # every step was committed with a 0-byte data file and restore found none loadable.
    d = tmp_path / "ck"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    url = spelling.format(d=d, link=tmp_path / "link")
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.remote.url = .* is the disk tier's own folder"):
        CheckpointConfig(directory=str(d), remote={"url": url})
    assert CheckpointConfig(directory=str(d), remote={"url": str(tmp_path / "nfs")}).remote_url  # elsewhere: fine


def test_a_local_location_is_checked_for_writes(tmp_path) -> None:
    assert CheckpointLocation.parse(f"file://{tmp_path}/new").check_writable() is None
    assert (tmp_path / "new").is_dir()
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        assert "not writable" in CheckpointLocation.parse(str(tmp_path / "ro")).check_writable()
    assert CheckpointLocation.parse("memory://x").check_writable() is None  # each worker checks remote ones


@pytest.mark.parametrize("kind", ["path", "file", "memory"])
def test_step_completeness_through_the_store(tmp_path, kind: str) -> None:
    text = {"path": str(tmp_path / "ck"), "file": f"file://{tmp_path}/ck", "memory": f"memory://{tmp_path}/ck"}[kind]
    store = CheckpointLocation.parse(text).open_store("j")
    assert isinstance(store, FsspecStore if kind == "memory" else LocalStore)
    assert not job_step_committed(text, "j", 3, 2)  # nothing there yet
    store.commit_rank(3, 1, 2, "d")
    assert not step_committed(store, 3, 2)
    store.commit_rank(3, 0, 2, "d")
    assert step_committed(store, 3, 2) and job_step_committed(text, "j", 3, 2)
    assert not step_committed(store, 3, 0)
    # a drain waiting for the job-wide checkpoint asked for at step 2: the hook took it at step 3, the first step
    # reaching 2 in a loop whose steps jump; the exact step never comes, and the drain waited out its grace
    assert not job_step_committed(text, "j", 2, 2) and job_step_committed(text, "j", 2, 2, or_later=True)
    assert not job_step_committed(text, "j", 4, 2, or_later=True)


def test_an_unreachable_location_is_not_complete() -> None:
    assert not job_step_committed("nosuchproto://x", "j", 1, 1)


@pytest.mark.parametrize("url", ["file://localhost/data/ck", "file://data/ck", "local://host/ck", "file://"])
def test_a_file_url_with_a_host_part_is_refused_naming_the_key(tmp_path, monkeypatch, url: str) -> None:
    # fsspec reads file://localhost/data/ck as ./localhost/data/ck: checkpoints landed under the working directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointConfigError, match="--checkpoint-dir = .*absolute path after '//'"):
        CheckpointLocation.parse(url, "--checkpoint-dir")
    with pytest.raises(CheckpointConfigError, match="checkpoint.directory = "):
        CheckpointConfig(directory=url)
    with pytest.raises(CheckpointConfigError, match="checkpoint.remote.url = "):
        CheckpointConfig(directory=str(tmp_path / "ck"), remote={"url": url})
    assert os.listdir(tmp_path) == []
    assert CheckpointLocation.parse(f"file://{tmp_path}/ck").local_path == f"{tmp_path}/ck"


def test_local_directory_keys_take_file_urls_and_refuse_other_urls(tmp_path, monkeypatch) -> None:
    # The shared-memory root, its fallback and the remote location's local cache were used verbatim: a file://
    # URL there became a folder ./file:/... on the disk of the working directory (no tmpfs at all).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", "file:///dev/shm/tg-x")
    cfg = CheckpointConfig(directory=str(tmp_path / "ck"), local_cache="file:/tmp/c",
                           memory={"fallback_directory": f"file://{tmp_path}/fb"})
    assert cfg.memory.directory == "/dev/shm/tg-x" and cfg.local_cache == "/tmp/c"
    assert cfg.memory.fallback_directory == f"{tmp_path}/fb"
    for kw, key in (({"local_cache": "s3://b/c"}, "checkpoint.local_cache"),
                    ({"memory": {"directory": "memory://x"}}, "checkpoint.memory.directory"),
                    ({"memory": {"directory": "file://host/x"}}, "checkpoint.memory.directory")):
        with pytest.raises(CheckpointConfigError, match=key):
            CheckpointConfig(directory=str(tmp_path / "ck"), **kw)
    assert not (tmp_path / "file:").exists()


@pytest.mark.parametrize("given", ["~/ck", "file:~/ck", "local:~/ck"])
def test_a_checkpoint_directory_under_home_that_no_shell_expanded(tmp_path, monkeypatch, given) -> None:
    """Found by the checkpoint review: ``TRAINGUARD_CHECKPOINT_DIR=~/ck`` (a unit file's or a pod's environment, a
    TOML value, ``--checkpoint-dir=~/ck``) wrote the steps into a folder named ``~`` under the worker's working
    directory, while the job's name hashed ``$HOME/ck``: a relaunch from another folder resumed nothing. Found
    by the review of new code: ``file:~/ck`` still did."""
    import subprocess
    import sys

    from trainguard.checkpoint.storage import step_dirname
    from trainguard.cli import main

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    script = ("import torch, trainguard\n"
              "s = trainguard.init(save_every=1)\n"
              "state = {'w': torch.ones(4)}\n"
              "start = s.restore(state)\n"
              "s.step_done(start, state)\n"
              "s.finish(); s.close(); print(start)\n")
    # the in-memory tier of its own: under the machine's /dev/shm a job "j" of an earlier run was found instead
    env = dict(os.environ, HOME=str(home), TRAINGUARD_CHECKPOINT_DIR=given, TRAINGUARD_JOB="j",
               TRAINGUARD_CHECKPOINT_SHM_DIR=str(tmp_path / "shm"))
    env.pop("TRAINGUARD_AGENT_SOCKET", None)
    for cwd, expect in ((work, "0"), (tmp_path, "1")):  # the relaunch from another folder resumes
        done = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-1] == expect
    assert (home / "ck" / "j" / step_dirname(1)).is_dir()
    assert not (work / "~").exists() and not (tmp_path / "~").exists()
    monkeypatch.setenv("HOME", str(home))
    assert main(["ckpt", "verify", given]) == 0


def test_an_environment_variable_in_a_local_directory_that_no_shell_expanded(tmp_path, monkeypatch) -> None:
    """``directory = "$SCRATCH/ck"`` in a TOML file (or a unit file's environment) wrote the steps into a folder
    literally named ``$SCRATCH`` under the working directory; an unset variable now says so."""
    from trainguard.checkpoint import CheckpointConfig
    from trainguard.checkpoint.errors import CheckpointConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TG_TEST_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.delenv("TG_TEST_UNSET", raising=False)
    for given in ("$TG_TEST_SCRATCH/ck", "${TG_TEST_SCRATCH}/ck", "file:$TG_TEST_SCRATCH/ck"):
        cfg = CheckpointConfig(directory=given, memory={"directory": "${TG_TEST_SCRATCH}/shm"})
        assert cfg.disk_directory == str(tmp_path / "scratch" / "ck")
        assert cfg.memory.directory == str(tmp_path / "scratch" / "shm")
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.directory = '\$TG_TEST_UNSET/ck': the environment "
                                                    r"variable \$TG_TEST_UNSET is not set"):
        CheckpointConfig(directory="$TG_TEST_UNSET/ck")
    assert CheckpointConfig(directory="s3://b/$TG_TEST_UNSET/ck").remote_url == "s3://b/$TG_TEST_UNSET/ck"
