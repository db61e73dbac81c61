"""`trainguard ckpt ls/verify/gc/export/import` as real subprocesses, and DCP interop both ways."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings

import torch
from ckpt_helpers import assert_same, flat, small_model

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.storage import data_name, step_dirname
from trainguard.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess:
    """Runs the real CLI entry point in-process (a subprocess per call costs seconds of imports on 2 cores)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ckpt", *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _inline(tmp_path, **kw) -> CheckpointConfig:
    return CheckpointConfig(directory=str(tmp_path / "ck"), memory={"enabled": False},
                            persist={"service": "inline"}, **kw)


def test_cli_ls_verify_detects_flip_gc(tmp_path):
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        for s in range(1, 5):
            ck.save({"w": torch.full((5000,), float(s))}, s)
    root = str(tmp_path / "ck")
    out = _cli("ls", root, "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert [r["step"] for r in listing["steps"] if r["complete"]] == [2, 3, 4] and listing["record"]["step"] == 4
    ok = _cli("verify", root)
    assert ok.returncode == 0 and ok.stdout.count(": OK") == 3
    path = tmp_path / "ck" / "j" / step_dirname(3) / data_name(0)
    raw = bytearray(path.read_bytes())
    raw[17] ^= 1
    path.write_bytes(bytes(raw))
    bad = _cli("verify", root)
    assert bad.returncode == 1 and "step 3 rank 0: CORRUPT" in bad.stdout and "checksum" in bad.stdout
    gc = _cli("gc", root, "--keep", "1")
    assert gc.returncode == 0 and sorted(os.listdir(tmp_path / "ck" / "j")) == ["COMMITTED.json", step_dirname(4)]
    err = subprocess.run([sys.executable, "-m", "trainguard.cli", "ckpt", "verify", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert err.returncode == 2 and err.stderr.count("\n") == 1 and "trainguard: error:" in err.stderr


def test_export_to_dcp_loads_with_dcp_and_imports_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    m, opt = small_model(0)
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"model": m, "optim": opt, "meta": {"epoch": 2, "name": "x"}}, 9)
    out = _cli("export", str(tmp_path / "ck"), str(tmp_path / "dcp"))
    assert out.returncode == 0, out.stderr
    target = {"model": small_model(1)[0].state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    for k, v in m.state_dict().items():
        assert torch.equal(target["model"][k], v), k
    imp = _cli("import", str(tmp_path / "dcp"), str(tmp_path / "ck2"), "--job", "k")
    assert imp.returncode == 0 and "as step 9" in imp.stdout, imp.stderr
    m2, opt2 = small_model(2)
    state = {"model": m2, "optim": opt2, "meta": None}
    cfg2 = CheckpointConfig(directory=str(tmp_path / "ck2"), memory={"enabled": False}, persist={"service": "inline"})
    with Checkpointer(cfg2, job="k") as ck:
        assert ck.restore(state) == 9
    assert_same(flat(m2, opt2), flat(m, opt)) and state["meta"] == {"epoch": 2, "name": "x"}


def test_import_foreign_dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    from trainguard.checkpoint.dcp import import_dcp

    m, _ = small_model(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": m.state_dict(), "epoch": 4}, checkpoint_id=str(tmp_path / "foreign"))
    assert import_dcp(str(tmp_path / "foreign"), str(tmp_path / "ck"), "f", step=4) == 4
    m2, _ = small_model(4)
    state = {"model": m2, "epoch": 0}
    with Checkpointer(_inline(tmp_path), job="f") as ck:
        assert ck.restore(state) == 4
    assert state["epoch"] == 4
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k


def test_export_and_import_take_file_urls_and_refuse_remote_ones(tmp_path, monkeypatch):
    # A file:// URL names the local folder, as it does for the checkpoint root: the export lands there (no
    # ./file:/... folder under the working directory), a second export is refused unless --force, and import
    # reads it back. An in-process or remote URL is refused naming the argument, not reported as exported.
    monkeypatch.chdir(tmp_path)
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"w": torch.arange(10.0)}, 4)
    out_url = f"file://{tmp_path}/exp"
    first = _cli("export", str(tmp_path / "ck"), out_url)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "exp" / ".metadata").is_file() and not (tmp_path / "file:").exists()
    again = _cli("export", str(tmp_path / "ck"), out_url)
    assert again.returncode == 2 and "not empty" in again.stderr
    imp = _cli("import", out_url, str(tmp_path / "ck2"), "--job", "k")
    assert imp.returncode == 0 and "as step 4" in imp.stdout, imp.stderr
    mem = _cli("export", str(tmp_path / "ck"), "memory://exp")
    assert mem.returncode == 2 and "output 'memory://exp' is not a local folder" in mem.stderr
    assert not (tmp_path / "memory:").exists()


def test_commit_record_or_marker_of_the_wrong_shape_fails_no_commit(tmp_path):
    # COMMITTED.json and the commit markers are only read, never trusted: valid JSON of another shape used to
    # raise in every commit (each step failed, retention never ran) and make `ckpt ls` print a traceback.
    from trainguard.checkpoint.storage import marker_name

    with Checkpointer(_inline(tmp_path, disk={"keep": 1}), job="j") as ck:
        ck.save({"w": torch.zeros(100)}, 1)
        assert ck.wait()
    job_dir = tmp_path / "ck" / "j"
    (job_dir / "COMMITTED.json").write_text("[1]")
    (job_dir / step_dirname(1) / marker_name(0)).write_text('{"world_size": "x"}')
    listing = _cli("ls", str(tmp_path / "ck"))
    assert listing.returncode == 0 and "newest committed (record): none" in listing.stdout, listing.stderr
    with Checkpointer(_inline(tmp_path, disk={"keep": 1}), job="j") as ck:
        assert ck.restore({"w": torch.ones(100)}) is None  # step 1 lost its marker: not committed
        for s in (2, 3):
            ck.save({"w": torch.full((100,), float(s))}, s)
            assert ck.wait(s)
        assert [i.step for i in ck.steps()] == [3]
    assert json.loads((job_dir / "COMMITTED.json").read_text())["step"] == 3
    assert sorted(os.listdir(job_dir)) == ["COMMITTED.json", step_dirname(3)]


def test_shm_flag_takes_a_file_url_and_refuses_other_urls(tmp_path):
    # `gc --shm file:///root` printed "removed the shared-memory arena" and removed nothing (and `ls --shm`
    # listed nothing): the URL was read as a relative folder.
    from trainguard.checkpoint import arena as arena_mod

    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"w": torch.zeros(10)}, 1)
    rank_dir = arena_mod.rank_dir(str(tmp_path / "shm"), "j", 0)
    os.makedirs(rank_dir)
    (tmp_path / "shm" / "j" / "rank_00000" / "slot_0.data").write_bytes(b"x" * 64)
    gc = _cli("gc", str(tmp_path / "ck"), "--keep", "1", "--shm", f"file://{tmp_path}/shm")
    assert gc.returncode == 0, gc.stderr
    assert not os.path.exists(rank_dir)
    assert f"removed the shared-memory arena under {tmp_path}/shm" in gc.stdout
    bad = _cli("ls", str(tmp_path / "ck"), "--shm", "memory://shm")
    assert bad.returncode == 2 and "--shm 'memory://shm' is not a local folder" in bad.stderr


def test_an_export_holding_numpy_arrays_imports_back_and_import_failures_are_one_line(tmp_path):
    import numpy as np
    import torch.distributed.checkpoint as dcp

    # A numpy array in the state was exported as a DCP pickle, which `ckpt import` (weights_only) refused, so the
    # export of such a step never imported back. A foreign pickled item's refusal carried torch's terminal escapes.
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"w": torch.arange(4.0), "order": np.arange(5, dtype=np.int32), "epoch": 2}, 3)
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    assert _cli("export", root, out).returncode == 0
    imp = _cli("import", out, str(tmp_path / "back"), "--job", "j")
    assert imp.returncode == 0, imp.stderr
    live = {"w": torch.zeros(4), "order": np.zeros(5, dtype=np.int32), "epoch": 0}
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "back"), memory={"enabled": False}), job="j") as ck:
        assert ck.restore(live) == 3
    assert torch.equal(live["w"], torch.arange(4.0)) and live["epoch"] == 2
    assert isinstance(live["order"], np.ndarray) and live["order"].tolist() == [0, 1, 2, 3, 4]
    # A truncated export: DCP's CheckpointException (a BaseException) left `ckpt import` as a traceback.
    shard = next(os.path.join(out, n) for n in os.listdir(out) if n.endswith(".distcp"))
    os.truncate(shard, 100)
    torn = _cli("import", out, str(tmp_path / "back1"), "--job", "j")
    assert torn.returncode != 0 and len(torn.stderr.strip().splitlines()) == 1, torn.stderr
    assert "torn or damaged" in torn.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "when": io.StringIO("x")}, checkpoint_id=str(tmp_path / "foreign"))
    bad = _cli("import", str(tmp_path / "foreign"), str(tmp_path / "back2"), "--job", "j")
    assert bad.returncode != 0
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "when" in lines[0] and "unsafe unpickling" in lines[0], bad.stderr
    assert "\x1b" not in bad.stderr, "terminal escapes from torch's message"


def test_export_of_a_damaged_newest_step_names_the_older_ones_and_the_step(tmp_path):
    """`ckpt export DIR OUT` takes the newest committed step; damaged, it failed naming neither a way on (the older
    steps, --step) nor, for a damaged manifest, the step ("rank 0 manifest is not a valid manifest")."""
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        for s in range(1, 4):
            ck.save({"w": torch.full((5000,), float(s))}, s)
    root = str(tmp_path / "ck")
    os.truncate(os.path.join(root, "j", step_dirname(3), data_name(0)), 100)
    with open(os.path.join(root, "j", step_dirname(2), "rank_00000.manifest.json"), "w") as f:
        f.write("{bad")
    out = _cli("export", root, str(tmp_path / "out"))
    assert out.returncode != 0
    assert "step 3 is the newest committed step (the default) and it is damaged" in out.stderr
    assert "pass --step with an older committed step (2, 1;" in out.stderr
    out = _cli("export", root, "--step", "2", str(tmp_path / "out"))
    assert out.returncode != 0 and "step 2 rank 0 manifest is not a valid manifest" in out.stderr, out.stderr
    out = _cli("export", root, "--step", "1", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr


def test_a_url_missing_a_slash_is_named_as_such(tmp_path, monkeypatch):
    """`ckpt ls s3:/bucket/x` read as a relative path said only "is not a directory"."""
    monkeypatch.chdir(tmp_path)
    for args in (("ls",), ("verify",), ("export", "--job", "j")):
        out = _cli(*args, "s3:/bucket/x", *(["out"] if args[0] == "export" else []))
        assert out.returncode != 0 and "did you mean s3://bucket/x?" in out.stderr, out.stderr
    out = _cli("ls", str(tmp_path / "nothing"))
    assert out.returncode != 0 and "did you mean" not in out.stderr


def test_verify_names_a_damaged_commit_marker_rather_than_a_missing_one(tmp_path):
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"w": torch.ones(100)}, 1)
    root = str(tmp_path / "ck")
    with open(os.path.join(root, "j", step_dirname(1), "rank_00000.commit"), "w") as f:
        f.write("garbage")
    out = _cli("verify", root, "--step", "1")
    assert out.returncode != 0
    assert "commit marker of rank(s) 0 is damaged" in out.stdout and "missing" not in out.stdout, out.stdout


def test_import_refuses_a_step_outside_the_step_range_and_writes_nothing(tmp_path):
    # `ckpt import --step -5` wrote a folder `step_-00000000005` and a commit record of step -5 that no listing,
    # restore or `ckpt` command reads: exit 0 for an import nobody could use, and the job's record read as damaged.
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"w": torch.ones(8)}, 3)
    assert _cli("export", str(tmp_path / "ck"), str(tmp_path / "dcp")).returncode == 0
    for step in ("-5", str(2**53)):
        out = _cli("import", str(tmp_path / "dcp"), str(tmp_path / "ck2"), "--job", "k", "--step", step)
        assert out.returncode == 2 and f"--step {step}" in out.stderr and "0..9007199254740991" in out.stderr, out
    assert not (tmp_path / "ck2" / "k").exists()
    ok = _cli("import", str(tmp_path / "dcp"), str(tmp_path / "ck2"), "--job", "k", "--step", str(2**53 - 1))
    assert ok.returncode == 0 and f"as step {2**53 - 1}" in ok.stdout, ok.stderr
    assert _cli("verify", str(tmp_path / "ck2"), "--job", "k").returncode == 0


def test_import_of_an_empty_or_foreign_metadata_file_is_one_line(tmp_path):
    # An empty .metadata was an EOFError traceback, a cut-short one an UnpicklingError, a pickled int an
    # AttributeError: each is a torn or foreign DCP checkpoint, which import names in one line (exit 2).
    import pickle

    src = tmp_path / "dcp"
    src.mkdir()
    for content, needle in ((b"", "torn or damaged"), (b"\x80\x04\x95", "torn or damaged"),
                            (pickle.dumps(5), "holds a int, not DCP Metadata")):
        (src / ".metadata").write_bytes(content)
        out = _cli("import", str(src), str(tmp_path / "ck"), "--job", "k")
        assert out.returncode == 2 and needle in out.stderr and out.stderr.count("\n") == 1, out


def test_shm_root_without_the_jobs_arena_is_said_so_not_reported_removed(tmp_path):
    # `gc --shm /typo` printed "removed the shared-memory arena under /typo" (there was none), and `ls --shm /typo`
    # listed no memory rows without a word, as if the tier held nothing.
    with Checkpointer(_inline(tmp_path), job="j") as ck:
        ck.save({"w": torch.zeros(10)}, 1)
    typo = str(tmp_path / "no-shm")
    for args in (("--dry-run",), ()):
        gc = _cli("gc", str(tmp_path / "ck"), "--keep", "1", "--shm", typo, *args)
        assert gc.returncode == 0 and f"no shared-memory arena of job j under {typo}" in gc.stdout, gc
        assert "remove the shared-memory arena" not in gc.stdout and "removed the shared" not in gc.stdout, gc
    ls = _cli("ls", str(tmp_path / "ck"), "--shm", typo)
    assert ls.returncode == 0 and f"no shared-memory arena of job j under {typo}" in ls.stderr, ls
    # ls reads commit markers only, and says so: "committed" was taken for a step whose bytes were checked.
    assert "committed  " in ls.stdout and "`trainguard ckpt verify` checks the data" in ls.stdout, ls
