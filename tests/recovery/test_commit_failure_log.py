"""A store that keeps refusing writes (a full filesystem) is logged once at ERROR, then at most once a window with
the failures left out counted, and once more when commits succeed again. Before, every failed commit was an ERROR:
one per retried registration or heartbeat write, ~5 a second with 3 nodes, more with more, burying the first."""

from __future__ import annotations

import logging

from trainguard.recovery.committer import FAIL_WINDOW_S, GroupCommitter
from trainguard.recovery.errors import StoreError
from trainguard.recovery.store import MemoryStore, Put


class FullStore(MemoryStore):
    """The real in-memory store, refusing every commit while ``full`` (as SQLite on a full filesystem does)."""

    full = False

    def commit(self, compares, puts):
        if self.full:
            raise StoreError("cannot write SQLite store /x.db (database or disk is full)")
        return super().commit(compares, puts)


def _commit(committer: GroupCommitter) -> bool:
    try:
        committer.submit([Put("k", b"v")]).result(timeout=10)
        return True
    except StoreError:
        return False


def test_a_lasting_store_failure_is_one_error_then_a_counted_warning_per_window(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="trainguard.recovery.committer")
    t = [1000.0]
    store = FullStore()
    committer = GroupCommitter(store, clock=lambda: t[0])
    try:
        assert _commit(committer)
        store.full = True
        for _ in range(20):  # retried writes, a quarter second apart
            assert not _commit(committer)
            t[0] += 0.25
        t[0] += FAIL_WINDOW_S
        assert not _commit(committer)
        store.full = False
        t[0] += 1.0
        assert _commit(committer)
        assert _commit(committer)
    finally:
        committer.close()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert [lv for lv, _ in said] == ["ERROR", "WARNING", "INFO"], said
    assert "database or disk is full" in said[0][1] and "database or disk is full" in said[1][1]
    assert "19 more failed commit(s)" in said[1][1], said[1]
    assert said[2][1] == "store commits succeed again after 21 failed commit(s) over 36 s", said[2]
    assert sum("failed" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 19
