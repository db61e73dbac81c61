"""Log formats: journald priority prefixes without timestamps, JSON, and auto-detection of journald."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from trainguard.agent import logging_setup as ls


def test_journal_prefix_on_every_line_and_no_timestamp():
    out = io.StringIO()
    assert ls.configure_logging("journal", "debug", out) == "journal"
    log = logging.getLogger("trainguard.agent.x")
    log.warning("disk %s", "full")
    log.debug("detail")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    assert lines[0] == "<4>trainguard.agent.x: disk full"
    assert lines[1] == "<7>trainguard.agent.x: detail"
    assert lines[2] == "<3>trainguard.agent.x: failed"
    assert len(lines) > 4 and all(line.startswith("<3>") for line in lines[2:])
    assert "ValueError: boom" in lines[-1]
    assert not any(ch.isdigit() for ch in lines[0].split(":")[0][3:])  # no time anywhere in the prefix


def test_configure_replaces_existing_handlers():
    logging.basicConfig(stream=io.StringIO(), force=True)
    out = io.StringIO()
    ls.configure_logging("journal", "info", out)
    ls.configure_logging("json", "info", out)  # a reload must not stack handlers
    logging.getLogger("t").info("once", extra={"rank": 3})
    (line,) = out.getvalue().splitlines()
    obj = json.loads(line)
    assert obj["msg"] == "once" and obj["level"] == "info" and obj["rank"] == 3 and obj["logger"] == "t"


def test_auto_detects_journal_stream(tmp_path, monkeypatch):
    path = tmp_path / "stream"
    with open(path, "w") as fh:
        st = os.fstat(fh.fileno())
        monkeypatch.setenv(ls.JOURNAL_STREAM_ENV, f"{st.st_dev}:{st.st_ino}")
        assert ls.resolve_format("auto", fh) == "journal"
        monkeypatch.setenv(ls.JOURNAL_STREAM_ENV, f"{st.st_dev}:{st.st_ino + 1}")
        assert ls.resolve_format("auto", fh) == "text"


def test_text_format_has_utc_timestamp():
    out = io.StringIO()
    ls.configure_logging("text", "info", out)
    logging.getLogger("t").error("x")
    assert out.getvalue().rstrip().endswith("ERROR t: x")
    assert out.getvalue()[10] == "T" and "Z " in out.getvalue()


def test_levels_map_to_syslog():
    assert [ls.syslog_priority(n) for n in (10, 20, 30, 40, 50, 25)] == [7, 6, 4, 3, 2, 4]
    with pytest.raises(ValueError):
        ls.configure_logging("text", "loud", io.StringIO())
