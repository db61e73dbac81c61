"""The shipped systemd unit passes ``systemd-analyze verify`` with no output at all (it exits 0 on warnings)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "trainguard-agent.service"


def test_unit_verifies_without_a_single_warning(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    text = UNIT.read_text()
    # verify checks that ExecStart's binary exists; point it at the trainguard of this environment, nothing else.
    trainguard = Path(sys.executable).with_name("trainguard")
    assert trainguard.exists(), "the trainguard console script is not installed in this environment"
    assert text.count("/usr/bin/trainguard ") == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("/usr/bin/trainguard ", f"{trainguard} "))
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and output == "", f"systemd-analyze verify printed:\n{output}"


def test_unit_has_what_operators_rely_on():
    text = UNIT.read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert settings["Type"] == "notify"
    assert settings["Restart"] == "on-failure"
    assert settings["WatchdogSec"]
    assert settings["RuntimeDirectory"] == "trainguard"
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert "AF_NETLINK" in settings["RestrictAddressFamilies"]
    assert settings["ProtectKernelTunables"] == "yes"  # /sys read-only, still readable
    # These would hide /dev/kmsg or the accelerators from the detectors and the workers.
    for forbidden in ("PrivateDevices", "ProtectKernelLogs", "ProtectClock", "DevicePolicy", "PrivateNetwork"):
        assert forbidden not in settings
    assert "--socket ${RUNTIME_DIRECTORY}/agent.sock" in settings["ExecStart"]
