"""Every Python file of the repository passes pyflakes: no unused import, undefined name or unused variable
lands (the generated protobuf modules apart). Run in the test suite because CI runs nothing else."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Folders of our own Python (the import namespace's roots, the benchmarks, the tests).
FOLDERS = ("agent", "bench", "checkpoint", "deploy", "detectors", "examples", "predictor", "proto", "recovery",
           "tests", "trainguard")


def _sources() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            generated = path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
            if not generated and ".venv" not in path.parts:
                out.append(path)
    return out


def test_every_source_file_passes_pyflakes() -> None:
    api = pytest.importorskip("pyflakes.api", reason="pip install -e '.[dev]' installs pyflakes")
    from pyflakes.reporter import Reporter

    files = _sources()
    assert len(files) > 100  # the walk found the repository
    out = io.StringIO()
    found = sum(api.checkPath(str(path), Reporter(out, out)) for path in files)
    assert found == 0, f"pyflakes found {found} problem(s):\n{out.getvalue()}"
