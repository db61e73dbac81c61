"""``trainguard detect`` as a real command, on a fake tree and on this machine; and the [detectors] config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainguard.detectors.base import DEFAULT_DETECTORS, create_detectors, detector_names
from trainguard.detectors.settings import DetectorSettings
from trainguard.testing.sysfs import write_file, write_thermal_zone
from trainguard.detectors.errors import DetectorConfigError
from trainguard.detectors.roce import RoceConfig

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRAINGUARD, *args], capture_output=True, text=True, timeout=90, check=False)


def test_detect_json_on_a_fake_tree(tmp_path) -> None:
    write_thermal_zone(tmp_path, 0, 99000, {"hot": 95000})
    write_file(tmp_path, "sys/devices/system/edac/mc/mc0/ce_count", "0\n")
    write_file(tmp_path, "sys/devices/system/edac/mc/mc0/ue_count", "garbage\n")  # malformed: an error state
    done = run("detect", "--json", "--window", "0", "--root", str(tmp_path), "--only", "thermal,edac,pcie")
    assert done.returncode == 1, done.stderr  # a failed detector makes the probe fail
    out = json.loads(done.stdout)
    states = {d["name"]: d["state"] for d in out["detectors"]}
    assert states == {"thermal": "failed", "edac": "error", "pcie": "no-hardware"}
    kinds = sorted(e["kind"] for e in out["events"])
    assert kinds == ["detector.error", "hw.temp_hot"]
    hot = next(e for e in out["events"] if e["kind"] == "hw.temp_hot")
    assert hot["severity"] == "error" and hot["action"] == "watch"


def test_detect_table_on_this_machine_names_missing_hardware() -> None:
    done = run("detect", "--window", "0")
    assert done.returncode in (0, 1), done.stderr
    assert done.stdout.startswith("DETECTOR")
    for name in DEFAULT_DETECTORS:
        assert f"\n{name}" in done.stdout
    if not os.path.exists("/sys/class/infiniband"):
        assert "No hardware to watch on this node" in done.stdout
        assert "roce" in done.stdout.split("No hardware to watch on this node")[1]


def test_detect_rejects_bad_names_and_config(tmp_path) -> None:
    done = run("detect", "--only", "bogus")
    assert done.returncode == 2 and "unknown detector 'bogus'" in done.stderr
    # A mistyped --root said "no hardware" for every detector and exited 0.
    done = run("detect", "--window", "0", "--root", str(tmp_path / "no-such-tree"), "--only", "edac")
    assert done.returncode == 2 and "--root" in done.stderr and "is not a directory" in done.stderr, done
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[detectors]\nenabled = ["disk"]\n[detectors.disk]\npaths = "/"\n')
    done = run("detect", "--config", str(cfg))
    assert done.returncode == 2 and "must be a list" in done.stderr


def test_detectors_config_from_toml(tmp_path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nport = 1\n[detectors]\nenabled = ["roce", "process"]\n'
                   '[detectors.roce]\ninterfaces = ["ens1f*"]\nflap_threshold = 5\ninterval_s = 2\n')
    c = DetectorSettings.load(str(cfg), table="detectors")
    assert c.enabled == ("roce", "process")
    dets = c.create(worker_view=None)
    assert [d.name for d in dets] == ["roce", "process"]
    roce = dets[0].config
    assert isinstance(roce, RoceConfig) and roce.interfaces == ("ens1f*",) and roce.interval_s == 2.0
    with pytest.raises(DetectorConfigError, match=r"\[roce\] configures detector 'roce', which enabled \(host\)"):
        DetectorSettings.from_table({"enabled": ["host"], "roce": {}})
    with pytest.raises(DetectorConfigError, match="twice"):
        create_detectors(["host", "host"])
    assert set(DEFAULT_DETECTORS) <= set(detector_names())


@pytest.mark.parametrize("argv, says", [
    (("--only", " , "), "names no detector"),
    (("--only", ""), "names no detector"),
    (("--only", "host", "--window", "1e10"), "--window 10000000000.0 must be >= 0 and at most 3600"),  # a traceback
])
def test_detect_refuses_to_run_no_detector(argv, says, capsys) -> None:
    # `trainguard detect --only "$LIST"` with an empty list ran nothing and exited 0: a probe that always passed.
    from trainguard.cli import main

    assert main(["detect", "--window", "0", *argv]) == 2
    assert says in capsys.readouterr().err


def test_detect_refuses_a_config_enabling_no_detector(tmp_path, capsys) -> None:
    from trainguard.cli import main

    cfg = tmp_path / "agent.toml"
    cfg.write_text("[detectors]\nenabled = []\n")
    assert main(["detect", "--window", "0", "--config", str(cfg)]) == 2
    assert "detectors.enabled is empty" in capsys.readouterr().err
