"""Fixtures shared by the agent tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def restore_root_logger():
    """Puts the root logger's handlers and level back after each test: the daemon and ``configure_logging``
    replace them process-wide, which would otherwise leak journald/JSON handlers into later tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
