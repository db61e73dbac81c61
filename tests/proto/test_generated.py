"""The committed generated modules must equal what grpcio-tools makes from the .proto files today."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.proto.generate import API_DIR, generate


def test_generated_modules_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for f in fresh:
        committed = API_DIR / f.name
        assert committed.exists(), f"{f.name} is generated but not committed; run `make proto`"
        assert committed.read_bytes() == f.read_bytes(), f"{f.name} is stale; run `make proto` and commit"
    generated_names = {f.name for f in fresh}
    stale = [p.name for p in API_DIR.glob("*_pb2*.py*") if p.name not in generated_names]
    assert not stale, f"generated files without a .proto: {stale}"


def test_generated_runtime_pin_matches_pyproject() -> None:
    import re

    import grpc

    text = (API_DIR / "agent_pb2_grpc.py").read_text()
    pinned = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text).group(1)
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"grpcio>={pinned}"' in pyproject, f"pyproject must require grpcio >= {pinned}"
    assert tuple(map(int, grpc.__version__.split(".")[:3])) >= tuple(map(int, pinned.split(".")))
