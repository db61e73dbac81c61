"""`trainguard coordinator` as a command: flags whose files it cannot write are one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys


def test_port_file_that_cannot_be_written_is_one_line_and_the_server_stops(tmp_path):
    # The write came after the server started: a PermissionError traceback (exit 1), and whoever waited for the
    # port file (a launcher script, a test) waited forever.
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "pf", "--listen",
                        "127.0.0.1:0", "--store", "memory://", "--port-file", "/proc/tg-no-such/port"],
                       capture_output=True, text=True, timeout=90, cwd=tmp_path)
    lines = [line for line in r.stderr.strip().splitlines() if "trainguard: error:" in line or "Traceback" in line]
    assert r.returncode == 2, r.stderr
    assert lines == [lines[0]] and lines[0].startswith("trainguard: error: --port-file /proc/tg-no-such/port: "
                                                        "cannot write it"), r.stderr
