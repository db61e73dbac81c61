"""The wheel carries everything trainguard needs without a checkout; the CLI answers --version and -m."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tg_testutil import REPO

from trainguard._version import __version__


def test_version_and_python_m(tmp_path: Path) -> None:
    for cmd in ([sys.executable, "-m", "trainguard", "--version"], [sys.executable, "-m", "trainguard.cli", "--version"]):
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"trainguard {__version__}", r.stderr
    r = subprocess.run([sys.executable, "-m", "trainguard", "--help"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=60)
    assert r.returncode == 0 and "run" in r.stdout and "demo" in r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from this checkout, with a stand-in trace folder named through the environment."""
    tmp = tmp_path_factory.mktemp("wheel")
    trace = tmp / "trace"
    trace.mkdir()
    (trace / "fault_trace.json").write_text("[]")
    (trace / "LICENSE").write_text("Apache License Version 2.0 (test copy)\n")
    env = dict(os.environ, TRAINGUARD_FAULT_TRACE_DIR=str(trace))
    out = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(REPO)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("trainguard-*.whl")
    return whl


def test_wheel_carries_package_data_and_the_trace_with_its_license(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("trainguard/__main__.py", "trainguard/py.typed", "trainguard/examples/train.py",
                 "trainguard/deploy/agent.toml", "trainguard/deploy/trainguard-agent.service",
                 "trainguard/drill/data/stepfun/fault_trace.json", "trainguard/drill/data/stepfun/LICENSE",
                 "trainguard/faultfacts/xid.json", "trainguard/faultfacts/taxonomy.json",
                 "trainguard/faultfacts/throttle.json",
                 "trainguard/detectors/rules/kmsg.json", "trainguard/predictor/rules.json",
                 "trainguard/testing/sysfs.py",
                 f"trainguard-{__version__}.dist-info/licenses/LICENSE"):
        assert name in names, name


def test_wheel_metadata_ranges(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(f"trainguard-{__version__}.dist-info/METADATA"))
    requires = meta.get_all("Requires-Dist")
    torch = next(r for r in requires if r.startswith("torch"))
    assert torch.replace(" ", "") == "torch>=2.4", torch  # open upward: no cap at this machine's build
    assert any(r.replace(" ", "") == "protobuf>=7.35.1" for r in requires), requires
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["License-Expression"] == "Apache-2.0"


def test_trace_lookup_order(tmp_path: Path, monkeypatch) -> None:
    from trainguard.drill import trace

    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(trace, "PACKAGED_TRACE_DIR", packaged)
    monkeypatch.delenv(trace.TRACE_DIR_ENV, raising=False)
    assert trace.trace_dir() == trace.DEFAULT_TRACE_DIR  # nothing packaged: the workspace's folder
    (packaged / "fault_trace.json").write_text("[]")
    assert trace.trace_dir() == packaged
    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path / "mine"))
    assert trace.trace_dir() == tmp_path / "mine"  # the environment names the user's own copy
    assert trace.trace_dir(tmp_path / "arg") == tmp_path / "arg"
    with pytest.raises(trace.TraceError, match="TRAINGUARD_FAULT_TRACE_DIR"):
        trace.load_stepfun()


def test_demo_script_comes_from_the_package() -> None:
    import trainguard.examples
    from trainguard.agent.demo import EXAMPLE

    assert EXAMPLE.is_file() and EXAMPLE.parent == Path(trainguard.examples.__file__).resolve().parent
