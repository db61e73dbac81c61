"""Regenerates the Python modules for ``proto/trainguard/v1/*.proto`` with grpcio-tools.

Run ``python -m trainguard.proto.generate`` after editing a ``.proto`` file; the generated modules are
committed, and ``tests/proto/test_generated.py`` fails when they are stale.

The proto folder is mounted as ``trainguard/proto`` on protoc's include path, so generated imports read
``from trainguard.proto.trainguard.v1 import common_pb2`` and resolve inside the installed namespace.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
API_DIR = PROTO_ROOT / "trainguard" / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Generates ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every API proto into ``out_dir``.

    Args:
        out_dir: folder that receives the generated files, flat.

    Returns:
        The generated files, sorted.

    Raises:
        RuntimeError: protoc failed (its messages are on stderr).
    """
    from grpc_tools import protoc  # dev dependency, imported only here
    import grpc_tools

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    protos = sorted(API_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-Itrainguard/proto={PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [f"trainguard/proto/{p.relative_to(PROTO_ROOT).as_posix()}" for p in protos]
        # protoc resolves virtual paths against -I mappings, so run from a neutral directory.
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            rc = protoc.main(args)
        finally:
            os.chdir(cwd)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        produced = Path(tmp) / "trainguard" / "proto" / "trainguard" / "v1"
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted(produced.iterdir()):
            if f.suffix in (".py", ".pyi"):
                shutil.copyfile(f, out_dir / f.name)
                written.append(out_dir / f.name)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: regenerate in place (default) or into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=API_DIR, help="output folder (default: in place)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
