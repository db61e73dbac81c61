"""Outside text (kernel log lines, device and process names) printed by trainguard: control and bidi characters
escaped, ordinary text of any script unchanged."""

from __future__ import annotations

import subprocess
import sys

from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.detectors.kmsg import parse_record
from trainguard.detectors.runner import DetectorStatus
from trainguard.detectors.base import DetectorState
from trainguard.detectors.text import printable


def _unprintable(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c != "\n"]


def test_printable_escapes_controls_and_bidi_and_keeps_everything_else():
    plain = "GPU 0000:3b:00.0 réseau 网络 \\x41 'q' \"q\""
    assert printable(plain) is plain  # no copy in the common case
    assert printable("py\u202eexe.sh") == "py\\u202eexe.sh"  # RIGHT-TO-LEFT OVERRIDE
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"  # ESC: clears the terminal
    assert printable("line\nforged: ok\r\t") == "line\\nforged: ok\\r\\t"
    assert printable("x\x9b31m\x85\u2028\u2066\u200b\ufeff\xa0") == "x\\x9b31m\\x85\\u2028\\u2066\\u200b\\ufeff\\xa0"
    assert printable("\U000e0001") == "\\U000e0001"  # a tag character (Cf), outside the BMP
    assert printable(printable("a\x1bb")) == "a\\x1bb"  # escaping twice changes nothing more


def test_events_and_statuses_carry_one_printable_line():
    """The coordinator logs events other nodes send; the agent's status shows details read from the node."""
    ev = HealthEvent(source="kmsg", kind="proc.oom_kill", severity=Severity.ERROR, action=Action.WATCH,
                     message="killed pid 4 (py\u202eexe.sh)\nfake: all healthy", subject="eth\x1b0")
    assert ev.message == "killed pid 4 (py\\u202eexe.sh)\\nfake: all healthy"
    assert ev.subject == "eth\x1b0"  # an identifier: kept as the device is named
    remote = HealthEvent.from_proto(ev.to_proto())
    assert remote.message == ev.message
    raw = ev.to_proto()
    raw.message, raw.kind = "\x1b[2Jok", "x\u202e"
    assert (HealthEvent.from_proto(raw).message, HealthEvent.from_proto(raw).kind) == ("\\x1b[2Jok", "x\\u202e")
    assert DetectorStatus("pcie", DetectorState.ERROR, "cannot read /sys/x\x1b[2J").detail == "cannot read /sys/x\\x1b[2J"


def test_kmsg_escapes_are_the_bytes_of_utf8_text():
    """The kernel writes every byte outside printable ASCII as \\xNN; each was read as its own character: 'café'
    as 'cafÃ©', and U+202E as three characters, one of them the C1 control U+0080."""
    assert parse_record("6,1,1,-;caf\\xc3\\xa9 \\x5c \\x09").message == "café \\ \t"
    assert parse_record("6,1,1,-;py\\xe2\\x80\\xaeexe").message == "py\u202eexe"
    assert parse_record("6,1,1,-;bad \\xff end").message == "bad \ufffd end"


def test_detect_table_prints_no_control_or_bidi_character(tmp_path):
    """A process name with U+202E and a kernel line with ESC sequences came out raw in ``trainguard detect``."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kmsg").write_text(
        "3,1,1,-;Out of memory: Killed process 4242 (py\\xe2\\x80\\xaeexe.sh) total-vm:1kB\n"
        "3,2,1,-;INFO: task \\x1b[2Jx:77 blocked for more than 120 seconds.\n"
        "3,3,1,-;NETDEV WATCHDOG: eth\\x1b[8m0 (mlx5_core): transmit queue 3 timed out\n")
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[detectors]\nenabled = ["kmsg"]\n[detectors.kmsg]\nreplay = true\n')
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "detect", "--config", str(cfg), "--root",
                           str(tmp_path), "--window", "0"], capture_output=True, text=True, timeout=90, check=False)
    assert "py\\u202eexe.sh" in done.stdout and "\\x1b[2Jx" in done.stdout, done.stdout + done.stderr
    assert "[eth\\x1b[8m0]" in done.stdout  # the subject, kept raw in the event, escaped where printed
    assert _unprintable(done.stdout + done.stderr) == []
