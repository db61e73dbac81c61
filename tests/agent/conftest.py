"""Fixtures shared by the agent tests."""

from __future__ import annotations

import logging
import os

import pytest

# Before any test module loads gRPC: these tests run gRPC servers in this process and then fork workers from it
# (a LocalSupervisor's preexec_fn); with gRPC's fork support on, a forked worker sometimes died of SIGABRT before
# its exec (see trainguard/agent/__init__.py). Set here too for test modules that import grpc first.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@pytest.fixture(autouse=True)
def restore_root_logger():
    """Puts the root logger's handlers and level back after each test: the daemon and ``configure_logging``
    replace them process-wide, which would otherwise leak journald/JSON handlers into later tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def no_arena_root_left_held():
    """Fails a test that leaves a memory-tier root held in this process: the daemon's keeper holds
    ``memory_tier.root`` until its stop, and one left held (an in-process daemon never stopped, on the default
    /dev/shm/trainguard) refused the subprocess daemons of every later test on that root."""
    import gc

    from trainguard.agent import arena_keeper

    before = set(arena_keeper._HELD_ROOTS)
    yield
    left = set(arena_keeper._HELD_ROOTS) - before
    if left:
        gc.collect()  # a keeper nobody closed but nobody refers to any more let go when collected
        left = set(arena_keeper._HELD_ROOTS) - before
    assert not left, f"the test left memory_tier.root held: {sorted(left)}; stop its daemon / close its ArenaKeeper"
