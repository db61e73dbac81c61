"""The one detector-settings loader: the daemon's section, ``trainguard run --detector-config`` and
``trainguard detect --config`` read the same shape with the same checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.detectors.base import DEFAULT_DETECTORS
from trainguard.detectors.errors import DetectorConfigError
from trainguard.detectors.settings import DetectorSettings


def test_all_expands_roots_and_intervals_fill_in_and_tables_win(tmp_path: Path) -> None:
    s = DetectorSettings.from_table({"enabled": ["all", "host"], "root": str(tmp_path), "interval_s": 2,
                                     "roce": {"root": "/", "interval_s": 0.5}}, source="t")
    assert s.enabled == DEFAULT_DETECTORS  # "all" expanded, "host" not repeated
    fields = s.settings()
    assert fields["roce"] == {"root": "/", "interval_s": 0.5}
    assert fields["host"] == {"root": str(tmp_path), "interval_s": 2.0}
    assert fields["process"] == {"interval_s": 2.0}  # watches real worker pids: never a fake root
    assert s.settings(root="/")["process"]["root"] == "/"  # an explicit override (detect --root) reaches all


def test_a_daemon_section_and_a_run_file_give_the_same_settings(tmp_path: Path) -> None:
    daemon = tmp_path / "agent.toml"
    daemon.write_text(f'[detectors]\nenabled = ["pcie", "process"]\nroot = "{tmp_path}"\n[detectors.pcie]\n'
                      'aer_scope = "all"\n')
    run = tmp_path / "run.toml"
    run.write_text(f'root = "{tmp_path}"\n[pcie]\naer_scope = "all"\n')
    a = DetectorSettings.load(daemon, table="detectors")
    b = DetectorSettings.load(run, enabled=("pcie", "process"))
    assert a.settings() == b.settings() and a.enabled == b.enabled


@pytest.mark.parametrize("table,words", [
    ({"enabled": "host"}, ["enabled: expected an array"]),
    ({"enabled": ["host", "nosuch"]}, ["unknown detector 'nosuch'"]),
    ({"enabled": ["host"], "roce": {}}, ["[roce] configures detector 'roce'", "enabled (host)"]),
    ({"enabled": ["host"], "gpux": {}}, ["[gpux] is not a detector"]),
    ({"interval_s": 0.01}, ["interval_s: 0.01 is outside [0.05, 3600]"]),
    ({"interval_s": True}, ["interval_s: expected a number"]),
    ({"root": "/no/such/tree"}, ["root: '/no/such/tree' is not a directory"]),
    # Read against each command's own folder: `detect --config` and the daemon (cwd /) saw different trees.
    ({"root": "."}, ["root: '.' is a relative path; give an absolute one"]),
    ({"enabled": ["thermal"], "thermal": {"root": "."}}, ["[thermal] root: '.' is a relative path"]),
    ({"hang_floor_s": 3}, ["unknown top-level key 'hang_floor_s'"]),
    ({"enabled": ["process"], "process": {"hang_floor_s": -1}}, ["[process]", "hang_floor_s=-1"]),
    # Items of a list were not checked: the disk detector statvfs()'d file descriptor 7, the roce detector ended
    # every sample in a TypeError; a boolean passed for an integer.
    ({"enabled": ["disk"], "disk": {"paths": ["/", 7]}}, ["[disk]", "paths=['/', 7]: item 7 must be of type str"]),
    # Read against the folder the agent started in (/ under systemd): 'ckpt' watched /ckpt, or nothing.
    ({"enabled": ["disk"], "disk": {"paths": ["/", "ckpt"]}}, ["[disk]", "'ckpt' is a relative path"]),
    ({"enabled": ["roce"], "roce": {"interfaces": [1]}}, ["[roce]", "interfaces=[1]: item 1 must be"]),
    ({"enabled": ["pcie"], "pcie": {"link_classes": [3]}}, ["[pcie]", "link_classes=[3]"]),
    ({"enabled": ["roce"], "roce": {"flap_threshold": True}}, ["[roce]", "flap_threshold=True must be of type int"]),
    # nan passed every range check (x < 0, x <= 0): a flap window that never emptied, thresholds never reached.
    ({"enabled": ["roce"], "roce": {"flap_window_s": float("nan")}}, ["[roce]", "flap_window_s=nan must be a finite"]),
    # inf passed too: every zone "near its critical trip" (checkpoint now), or a condition that never cleared
    ({"enabled": ["thermal"], "thermal": {"critical_margin_c": float("inf")}}, ["[thermal]", "critical_margin_c=inf"]),
    ({"enabled": ["thermal"], "thermal": {"hysteresis_c": float("inf")}}, ["[thermal]", "hysteresis_c=inf must be"]),
    ({"enabled": ["pcie"], "pcie": {"correctable_per_s": float("nan")}}, ["[pcie]", "correctable_per_s=nan"]),
    ({"enabled": ["thermal"], "thermal": {"critical_margin_c": float("nan")}}, ["[thermal]", "critical_margin_c=nan"]),
    # An operator's rule file was read only when the detector was built: `trainguard run` had registered with the
    # coordinator by then, and the error named neither the table nor the key.
    ({"enabled": ["kmsg"], "kmsg": {"rules_file": "/no/such/kmsg.json"}}, ["[kmsg]", "kmsg.rules_file='/no/such"]),
    ({"enabled": ["kmsg"], "kmsg": {"xid_file": "/no/such/xid.json"}}, ["[kmsg]", "kmsg.xid_file='/no/such"]),
    ({"enabled": ["roce"], "roce": {"rules_file": "/no/such/c.json"}}, ["[roce]", "roce.rules_file='/no/such"]),
    ({"enabled": ["nvidia"], "nvidia": {"xid_file": "/no/such/xid.json"}}, ["[nvidia]", "nvidia.xid_file='/no/such"]),
])
def test_bad_settings_are_one_line_errors_naming_source_and_key(table: dict, words: list) -> None:
    with pytest.raises(DetectorConfigError) as info:
        DetectorSettings.from_table(table, source="cfg.toml")
    msg = str(info.value)
    assert msg.startswith("cfg.toml: ") and "\n" not in msg, msg
    for word in words:
        assert word in msg, msg


@pytest.mark.parametrize("text, table, words", [
    # was: no suggestion
    ("intervals_s = 1\n", None, ["unknown top-level key 'intervals_s'", "did you mean 'interval_s'?"]),
    ("[pcei]\n", None, ["[pcei] is not a detector; did you mean 'pcie'?"]),
    # was: "(invalid continuation byte at byte 12)", the line unnamed
    (b'root = "/caf\xe9"\n', None, ["not UTF-8 text (invalid continuation byte at byte 12, line 1)"]),
    # was: "detectors: must be a table [detectors]"
    ("detectors = 3\n", "detectors", ["detectors: expected a table [detectors], got an integer 3"]),
    # was: "enabled: expected an array of detector names, got an array ['host', 1]"
    ('[detectors]\nenabled = ["host", 1]\n', "detectors", ["detectors.enabled[1]: expected a string, got an integer"]),
    ("[detectors]\ninterval_s = nan\n", "detectors", ["detectors.interval_s: expected a finite number (nan"]),
])
def test_files_read_through_the_shared_loader(tmp_path: Path, text, table, words) -> None:
    path = tmp_path / "det.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DetectorConfigError) as info:
        DetectorSettings.load(path, table=table)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    for word in words:
        assert word in msg, msg


def test_enabled_in_a_file_whose_detectors_a_flag_names_points_at_that_flag() -> None:
    # `trainguard run --detector-config` with `enabled = [...]` said "unknown top-level key 'enabled' ... every
    # other key must be a [detector] table, e.g. [enabled]": a table named enabled, not the --detectors it needs.
    with pytest.raises(DetectorConfigError) as info:
        DetectorSettings.from_table({"enabled": ["host"]}, source="dc.toml", enabled=["host"],
                                    enabled_flag="--detectors")
    msg = str(info.value)
    assert msg.startswith("dc.toml: 'enabled' is not read here: --detectors names the detectors") and "[enabled]" \
        not in msg, msg
