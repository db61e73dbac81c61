"""Shared fixtures: prove that no process outlives its test, and that no test writes the box-wide memory tier."""

from __future__ import annotations

import os
import shutil
import time
import uuid

import psutil
import pytest

from tg_testutil import marked_processes

#: The box-wide default memory-tier root (``memory_tier.root``, ``$TRAINGUARD_CHECKPOINT_SHM_DIR``): every daemon,
#: job and test run on the box shares it, so no test may create anything there. ``$TG_TEST_BOX_SHM_ROOT`` puts the
#: guard on another folder: the guard's own test litters one, and the suite's other workers run meanwhile.
BOX_SHM_ROOT = os.environ.get("TG_TEST_BOX_SHM_ROOT", "/dev/shm/trainguard")

# Before any test module loads: the workers' arena root of every in-process agent and every subprocess launcher
# (they read it from the environment), so a test that names no root of its own uses this session's, not the box's
# (tests left empty job folders there: `j`, `link`, `sleeper-<hash>`). A root named explicitly still wins.
SESSION_SHM_ROOT = f"/dev/shm/trainguard-test-session-{uuid.uuid4().hex[:10]}"
# A root this file set in a parent process (the pytest-xdist controller, or a suite that runs pytest again) is not
# kept: a session removes only its own root at its end, so the workers used the controller's, which no session
# removed (each parallel run left one in /dev/shm for good). One named by the user is kept.
if os.environ.get("TRAINGUARD_CHECKPOINT_SHM_DIR", "") in ("", os.environ.get("TG_TEST_SESSION_SHM_ROOT")):
    os.environ["TRAINGUARD_CHECKPOINT_SHM_DIR"] = SESSION_SHM_ROOT
    os.environ["TG_TEST_SESSION_SHM_ROOT"] = SESSION_SHM_ROOT


@pytest.fixture
def tg_env(tmp_path):
    """Environment for CLI subprocesses, tagged with a marker; fails the test if a tagged process survives."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, TG_TEST_MARKER=marker, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
    yield env
    deadline = time.monotonic() + 5.0
    left = marked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"orphan processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def _tree(root: str, depth: int = 4) -> set[str]:
    """Every path under ``root`` (itself included) down to ``depth`` levels; empty when it does not exist."""
    if not os.path.lexists(root):
        return set()
    out = {root}
    if depth and os.path.isdir(root) and not os.path.islink(root):
        try:
            names = os.listdir(root)
        except OSError:
            return out
        for n in names:
            out |= _tree(os.path.join(root, n), depth - 1)
    return out


@pytest.fixture(scope="session", autouse=True)
def session_shm_root():
    """Removes this session's arena root (:data:`SESSION_SHM_ROOT`) at the end of the run."""
    yield SESSION_SHM_ROOT
    shutil.rmtree(SESSION_SHM_ROOT, ignore_errors=True)


@pytest.fixture(autouse=True)
def nothing_made_under_the_box_wide_shm_root():
    """Fails a test that creates anything under :data:`BOX_SHM_ROOT`, naming the paths: it is every daemon's and
    job's on the box, and what tests left there (empty job folders) piled up for good. Give the test a root of
    its own (``[memory_tier] root``, ``$TRAINGUARD_CHECKPOINT_SHM_DIR``, ``shm_root``). Only new paths count: a
    path there before the test is not its doing.

    On with ``TRAINGUARD_TEST_SHM_GUARD=1`` (``.ci/run`` sets it) or ``$CI``: it sees what *any*
    process makes there during a test, and on a developer's machine a running node daemon or ``make demo`` writes
    there by right, which would fail whichever test ran meanwhile."""
    if not (os.environ.get("CI") or os.environ.get("TRAINGUARD_TEST_SHM_GUARD") == "1"):
        yield
        return
    before = _tree(BOX_SHM_ROOT)
    yield
    made = sorted(_tree(BOX_SHM_ROOT) - before)
    assert not made, f"the test created {made} under the box-wide memory-tier root {BOX_SHM_ROOT}; give it a root " \
                     "of its own"
