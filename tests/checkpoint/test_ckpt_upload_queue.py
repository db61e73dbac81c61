"""The remote upload queues during an outage: the catch-up kept for a rank is its latest save's, also when the job
went back to a lower step meanwhile. The back-off is a minute, ended by the test (a short one ended on its own
whenever the box stalled the test thread for longer, and the order of the log then changed)."""

from __future__ import annotations

from tg_testutil import until

from trainguard.checkpoint.uploads import UNREACHABLE, InlineUploads, UploadQueue


def _entry(log: list[str], step: int) -> dict:
    """An upload of ``step`` that finds the remote unreachable and logs what runs."""
    return dict(run=lambda ongoing: (log.append(f"run {step}"), UNREACHABLE)[1],
                drop=lambda newer: log.append(f"drop {step} for {newer}"),
                defer=lambda seconds, first: log.append(f"defer {step}"),
                catch_up=lambda ongoing: log.append(f"catch-up {step}"),
                remote="r", retry_s=60.0)


def _end_outage(uploads: UploadQueue | InlineUploads) -> None:
    """The remote's back-off is over: due now."""
    lock = uploads._cond if isinstance(uploads, UploadQueue) else uploads._lock
    with lock:
        for outage in uploads._down.values():
            outage.retry_at = 0.0
        if isinstance(uploads, UploadQueue):
            uploads._cond.notify_all()


def test_the_catch_up_after_an_outage_is_the_latest_save_when_the_job_went_back() -> None:
    # The parked catch-up was the highest step: after the job went back (step 5 saved after step 10, whose disk
    # copy the going back removed) the catch-up of 10 uploaded nothing and step 5 never reached the remote.
    log: list[str] = []
    q = UploadQueue()
    key = ("job", 0, "r")
    q.put(key, 10, **_entry(log, 10))  # finds the remote unreachable: 10 parked
    assert until(lambda: log == ["run 10"])
    q.put(key, 5, **_entry(log, 5))  # the job went back: deferred, and the catch-up is now 5's
    assert until(lambda: len(log) >= 2), log
    _end_outage(q)
    assert until(lambda: len(log) >= 3), log
    assert log == ["run 10", "defer 5", "catch-up 5"]


def test_inline_uploads_catch_up_the_latest_save_too() -> None:
    log: list[str] = []
    up = InlineUploads()
    key = ("job", 0, "r")
    up.put(key, 10, **_entry(log, 10))
    up.put(key, 5, **_entry(log, 5))
    _end_outage(up)
    up.finish()
    assert log == ["run 10", "defer 5", "catch-up 5"]


def test_a_higher_step_saved_later_still_supersedes_the_parked_one() -> None:
    log: list[str] = []
    q = UploadQueue()
    key = ("job", 0, "r")
    q.put(key, 5, **_entry(log, 5))
    assert until(lambda: log == ["run 5"])
    q.put(key, 10, **_entry(log, 10))
    assert until(lambda: len(log) >= 2), log
    _end_outage(q)
    assert until(lambda: len(log) >= 3), log
    assert log == ["run 5", "defer 10", "catch-up 10"]
