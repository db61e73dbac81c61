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
