"""``trainguard qualify``: text and JSON output, exit code 0 / 1 / 2, on a fake node tree."""

from __future__ import annotations

import json

from trainguard.cli import main
from trainguard.testing.sysfs import GPU, FakeNodeHardware


def write_config(tmp_path, root) -> str:
    path = tmp_path / "agent.toml"
    path.write_text(f'[detectors]\nenabled = ["pcie"]\nroot = "{root}"\n\n'
                    f'[qualify]\nchecks = ["detectors", "pcie", "disk", "peers"]\ndisk_dir = "{tmp_path}"\n'
                    'disk_mib = 1\ndisk_min_mib_s = 0.001\n')
    return str(path)


def test_qualify_cli_text_json_and_exit_codes(tmp_path, capsys) -> None:
    hw = FakeNodeHardware(tmp_path / "root")
    config = write_config(tmp_path, tmp_path / "root")
    assert main(["qualify", "--config", config, "--node-id", "gpu-7"]) == 0
    out = capsys.readouterr().out
    assert "PASS  pcie" in out and "PASS  detectors" in out and "SKIP  peers" in out
    assert out.strip().splitlines()[-1].startswith("node gpu-7 qualified in ")
    hw.narrow_link(8)
    assert main(["qualify", "--config", config, "--json", "--checks", "pcie,disk"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and doc["reason"] == f"pcie: {GPU} link trained at x8, below its x16"
    assert [c["name"] for c in doc["checks"]] == ["pcie", "disk"] and doc["duration_s"] > 0
    assert main(["qualify", "--config", config, "--checks", "pcie,gpu-burn"]) == 2
    assert "--checks 'pcie,gpu-burn': qualify.checks: unknown check 'gpu-burn'" in capsys.readouterr().err


def test_run_qualify_config_errors_name_the_run_flag(tmp_path) -> None:
    import argparse

    import pytest

    from trainguard.agent.config import AgentConfigError
    from trainguard.agent.qualify.cli import qualify_for_run

    with pytest.raises(AgentConfigError, match=r"^--qualify-config .*no such file"):
        qualify_for_run(argparse.Namespace(qualify_config=str(tmp_path / "missing.toml"), qualify=False))
    bad = tmp_path / "bad.toml"
    bad.write_text("[qualify]\nbudget_s = -1\n")
    with pytest.raises(AgentConfigError, match="budget_s"):
        qualify_for_run(argparse.Namespace(qualify_config=str(bad), qualify=False))
    assert qualify_for_run(argparse.Namespace(qualify_config=None, qualify=False)) is None


def test_checks_naming_no_check_is_refused_not_passed(tmp_path, capsys) -> None:
    # `--checks "$CHECKS"` with the variable empty ran no check and said "qualified" (exit 0).
    config = write_config(tmp_path, tmp_path / "root")
    for empty in ("", " , "):
        assert main(["qualify", "--config", config, "--checks", empty]) == 2
        err = capsys.readouterr().err
        assert "names no check" in err and "qualified" not in err, err
