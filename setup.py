"""Maps the repository's top-level folders into the single ``trainguard`` import namespace.

``agent/`` becomes ``trainguard.agent``, ``proto/`` becomes ``trainguard.proto`` and so on; every folder below
them that holds an ``__init__.py`` is found here, so adding a subpackage needs no edit of the build files.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

# The StepFun fault trace (Apache-2.0) is used in place and never committed; a wheel built where it lies carries
# it, with its LICENSE, as trainguard/drill/data/stepfun (see trainguard/drill/trace.py for the lookup order).
TRACE_ENV = "TRAINGUARD_FAULT_TRACE_DIR"
TRACE_FILES = ("fault_trace.json", "LICENSE", "SOURCE.txt", "README.md")


class BuildWithTrace(build_py):
    """build_py that adds the fault trace from ``$TRAINGUARD_FAULT_TRACE_DIR`` or ../shared/data when present."""

    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        src = os.environ.get(TRACE_ENV) or os.path.join(here, "..", "shared", "data", "stepfun-fault-trace")
        dst = os.path.join(self.build_lib, "trainguard", "drill", "data", "stepfun")
        shutil.rmtree(dst, ignore_errors=True)  # never a stale copy from an earlier build in build/
        if not os.path.isfile(os.path.join(src, "fault_trace.json")):
            print(f"trainguard: no fault trace at {src}; the wheel will not carry it (set {TRACE_ENV})")
            return
        os.makedirs(dst)
        for name in TRACE_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))

# Folder -> import name. `trainguard/` is the namespace's own public face (hook, CLI).
ROOTS = {
    "trainguard": "trainguard",
    "agent": "trainguard.agent",
    "detectors": "trainguard.detectors",
    "predictor": "trainguard.predictor",
    "checkpoint": "trainguard.checkpoint",
    "recovery": "trainguard.recovery",
    "proto": "trainguard.proto",
    "examples": "trainguard.examples",
    "deploy": "trainguard.deploy",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    here = os.path.dirname(os.path.abspath(__file__))
    for folder, name in ROOTS.items():
        package_dir[name] = folder
        for dirpath, dirnames, filenames in os.walk(os.path.join(here, folder)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            if "__init__.py" not in filenames:
                dirnames[:] = []
                continue
            rel = os.path.relpath(dirpath, os.path.join(here, folder))
            packages.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"": ["*.proto", "*.toml", "*.json", "*.csv", "*.service", "py.typed"]},
    include_package_data=True,
    cmdclass={"build_py": BuildWithTrace},
)
