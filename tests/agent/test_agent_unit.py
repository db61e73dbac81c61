"""The shipped systemd unit passes ``systemd-analyze verify`` with no output at all (it exits 0 on warnings)."""

from __future__ import annotations

import os
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
    assert text.count("ExecStart=trainguard ") == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("ExecStart=trainguard ", f"ExecStart={trainguard} "))
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and output == "", f"systemd-analyze verify printed:\n{output}"


def test_the_unit_as_shipped_finds_a_trainguard_that_pip_installed_as_root(tmp_path):
    """The unit copied verbatim (README: install it, `systemctl enable --now`) must start the trainguard that
    `pip install` put in /usr/local/bin; it named /usr/bin/trainguard, where pip as root on Debian, Ubuntu or
    Fedora writes nothing, and failed with status 203/EXEC. /usr/local/bin is replaced in a private mount
    namespace only."""
    if shutil.which("systemd-analyze") is None or shutil.which("unshare") is None:
        pytest.skip("systemd-analyze or unshare is not installed")
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace needs root")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "trainguard").symlink_to(Path(sys.executable).with_name("trainguard"))
    copy = tmp_path / UNIT.name
    shutil.copyfile(UNIT, copy)
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind "$0" /usr/local/bin && '
                           'exec systemd-analyze verify "$1"', str(bindir), str(copy)],
                          capture_output=True, text=True, timeout=60)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and output == "", f"systemd-analyze verify printed:\n{output}"


def test_unit_has_what_operators_rely_on():
    text = UNIT.read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert settings["Type"] == "notify"
    assert settings["Restart"] == "on-failure"
    assert settings["WatchdogSec"]
    assert settings["RuntimeDirectory"] == "trainguard"
    assert settings["RuntimeDirectoryPreserve"] == "restart"  # the launchers' locks outlive a restart
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert "AF_NETLINK" in settings["RestrictAddressFamilies"]
    assert settings["ProtectKernelTunables"] == "yes"  # /sys read-only, still readable
    # These would hide /dev/kmsg or the accelerators from the detectors and the workers.
    for forbidden in ("PrivateDevices", "ProtectKernelLogs", "ProtectClock", "DevicePolicy", "PrivateNetwork"):
        assert forbidden not in settings
    assert "--socket ${RUNTIME_DIRECTORY}/agent.sock" in settings["ExecStart"]


ARENA_SWEEP = """
import sys
from trainguard.agent.arena_keeper import ArenaKeeper
keeper = ArenaKeeper(sys.argv[1], 0.0)
keeper.adopt_existing()
print(keeper.sweep())
"""


def test_the_units_capabilities_let_the_daemon_remove_an_arena_its_jobs_user_owns(tmp_path):
    """Launchers run as the users of the unit's group, so their arenas are theirs: the daemon, root limited to the
    unit's CapabilityBoundingSet, must still remove one whose job is over (it used to log it removed and leave it
    in /dev/shm: no CAP_DAC_OVERRIDE to unlink in the user's folders)."""
    import os
    import pwd

    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to run under the unit's capability bounding set")
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", UNIT.read_text(), re.M).group(1).split()
    nobody = pwd.getpwnam("nobody")
    root = tmp_path / "shm"
    rank = root / "job-a" / "rank_00000"
    rank.mkdir(parents=True)
    (rank / "data").write_bytes(b"snapshot")
    (rank / "owner.lock").write_bytes(b"")
    for path in (root / "job-a", rank, rank / "data", rank / "owner.lock"):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
        os.chmod(path, 0o755 if path.is_dir() else 0o600)  # what a launcher's umask 022 leaves
    bounding = ",".join(["-all", *(c.lower().replace("cap_", "+") for c in caps)])
    proc = subprocess.run(["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", sys.executable, "-c",
                           ARENA_SWEEP, str(root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['job-a']" and not (root / "job-a").exists(), proc.stdout + proc.stderr
