"""``trainguard run --detector-config``, ``--drain-grace-s`` and ``--predictor-interval-s``: parsing, merging with
``--hang-floor-s``, and one-line errors for every bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from tg_testutil import run_cli
from trainguard.agent.config import AgentConfigError
from trainguard.agent.run_detectors import run_detector_settings
from trainguard.detectors.base import create_detectors
from trainguard.detectors.settings import DetectorSettings
from trainguard.errors import UsageError

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "detectors.toml"
    path.write_text(text)
    return str(path)


def test_roots_intervals_and_hang_floor_merge(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    path = write(tmp_path, f'''
root = "{fake}"
interval_s = 2

[pcie]
aer_scope = "all"
correctable_per_s = 3

[roce]
root = "/"
interval_s = 0.5
''')
    settings = run_detector_settings(("process", "pcie", "roce"), path, hang_floor_s=45.0)
    assert settings == {
        # The process detector reads /proc/<pid> of the workers, real processes: the fake root is not for it.
        "process": {"interval_s": 2.0, "hang_floor_s": 45.0},
        "pcie": {"aer_scope": "all", "correctable_per_s": 3, "root": str(fake), "interval_s": 2.0},
        "roce": {"root": "/", "interval_s": 0.5},
    }
    # The settings build real detectors, each reading where its table says.
    dets = {d.name: d for d in create_detectors(["process", "pcie", "roce"], settings)}
    try:
        assert dets["pcie"].config.root == str(fake) and dets["pcie"].config.aer_scope == "all"
        assert dets["pcie"].config.correctable_per_s == 3.0 and dets["pcie"].config.interval_s == 2.0
        assert dets["roce"].config.root == "/" and dets["roce"].config.interval_s == 0.5
        assert dets["process"].config.hang_floor_s == 45.0 and dets["process"].config.root == "/"
    finally:
        for d in dets.values():
            d.close()


def test_file_hang_floor_wins_and_defaults_without_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, f'root = "{tmp_path}"\n[process]\nhang_floor_s = 12\nroot = "{tmp_path}"\n')
    assert run_detector_settings(("process",), path, hang_floor_s=60.0) == {
        "process": {"hang_floor_s": 12, "root": str(tmp_path)}}  # its own table may still move it
    assert run_detector_settings(("process", "pcie"), None, hang_floor_s=60.0) == {"process": {"hang_floor_s": 60.0}}
    assert run_detector_settings(("pcie",), None, hang_floor_s=60.0) == {}
    config = DetectorSettings.load(write(tmp_path, ""), enabled=())
    assert (config.root, config.interval_s, config.tables) == ("/", 0.0, {})


BAD = [
    # (file text, enabled detectors, words the one-line message must hold)
    ('root = "/"\n[pcie\naer_scope = "all"\n', ("pcie",), ["not valid TOML", "line 2"]),
    ("hang_floor_s = 30\n", ("process",), ["unknown top-level key 'hang_floor_s'", "[hang_floor_s]"]),
    ("root = 1\n", ("pcie",), ["root: expected a string", "1"]),
    ('interval_s = "fast"\n', ("pcie",), ["interval_s: expected a number", "'fast'"]),
    ("interval_s = 0.001\n", ("pcie",), ["interval_s: 0.001 is outside [0.05, 3600]", "use 0"]),
    ('root = "/no/such/tree"\n', ("pcie",), ["root: '/no/such/tree' is not a directory", "create the fake tree"]),
    ('[pcie]\nroot = ""\n', ("pcie",), ["[pcie] root: must not be empty", '"/"']),
    ("[roce]\ninterval_s = 1\n", ("process", "pcie"),
     ["[roce] configures detector 'roce'", "--detectors (process,pcie) does not enable",
      "add it to --detectors or remove the table"]),
    ("[gpux]\n", ("pcie",), ["[gpux] is not a detector", "pcie"]),
    ("[pcie]\naer_scoep = 'all'\n", ("pcie",), ["[pcie]", "unknown field 'aer_scoep'", "aer_scope"]),
    ("[pcie]\ncorrectable_per_s = 'many'\n", ("pcie",), ["[pcie]", "correctable_per_s='many' must be of type float"]),
    ("[pcie]\naer_scope = 'some'\n", ("pcie",), ["[pcie]", "aer_scope='some' must be 'paths' or 'all'"]),
    ("[process]\nhang_floor_s = -1\n", ("process",), ["[process]", "hang_floor_s=-1", "> 0"]),
    ("interval_s = 0.5\n[process]\nroot = 7\n", ("process",), ["[process] root: expected a string"]),
]


@pytest.mark.parametrize("text,enabled,words", BAD, ids=[w[0] for _, _, w in BAD])
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path: Path, text: str, enabled: tuple, words: list) -> None:
    path = write(tmp_path, text)
    with pytest.raises(AgentConfigError) as info:
        run_detector_settings(enabled, path, hang_floor_s=60.0)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    for word in words:
        assert word in msg, msg


def test_unreadable_inputs(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match="detector config file not found; pass an existing --detector-config"):
        run_detector_settings(("pcie",), str(tmp_path / "missing.toml"), None)
    with pytest.raises(AgentConfigError, match="is a directory; --detector-config takes a TOML file"):
        run_detector_settings(("pcie",), str(tmp_path), None)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'root = "/caf\xe9"\n')
    with pytest.raises(AgentConfigError, match="not UTF-8 text"):
        run_detector_settings(("pcie",), str(bad), None)
    with pytest.raises(UsageError, match="--detectors pcie,gpux: unknown detector 'gpux'"):
        run_detector_settings(("pcie", "gpux"), None, None)


@pytest.mark.parametrize("flags,words", [
    (["--detectors", "pcie", "--detector-config", "{cfg}"], ["[roce] configures detector 'roce'"]),
    (["--drain-grace-s", "-1"], ["--drain-grace-s must be >= 0 seconds, got -1.0"]),
    (["--predictor-interval-s", "0"], ["--predictor-interval-s must be > 0 seconds, got 0.0"]),
])
def test_cli_prints_one_line_and_exits_2(tmp_path: Path, tg_env: dict, flags: list, words: list) -> None:
    cfg = write(tmp_path, "[roce]\n")
    r = run_cli(["run", *[f.format(cfg=cfg) for f in flags], str(SCRIPTS / "crash.py"), "0", "0"], tg_env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: "), r.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_the_launchers_host_detector_watches_its_own_cgroups_limit(tmp_path: Path) -> None:
    """``trainguard run`` shares the job's container: its host detector counts that cgroup's memory limit, which
    the OOM killer enforces; node memory alone read 90% free in a pod about to be killed. A file's own setting
    (``""``: the node only) wins."""
    assert run_detector_settings(("host", "pcie"), None, None) == {"host": {"memory_cgroup": "self"}}
    path = write(tmp_path, '[host]\nmemory_cgroup = ""\n')
    assert run_detector_settings(("host",), path, None) == {"host": {"memory_cgroup": ""}}
    (det,) = create_detectors(["host"], run_detector_settings(("host",), None, None))
    s = det.sample()  # this machine's own cgroup (v1 or v2, or none): read without an error
    assert not s.errors and 0 <= s.metrics["mem_available_pct"] <= 100
