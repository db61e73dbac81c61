"""Maps the repository's top-level folders into the single ``trainguard`` import namespace.

``agent/`` becomes ``trainguard.agent``, ``proto/`` becomes ``trainguard.proto`` and so on; every folder below
them that holds an ``__init__.py`` is found here, so adding a subpackage needs no edit of the build files.
"""

from __future__ import annotations

import os

from setuptools import setup

# Folder -> import name. `trainguard/` is the namespace's own public face (hook, CLI).
ROOTS = {
    "trainguard": "trainguard",
    "agent": "trainguard.agent",
    "detectors": "trainguard.detectors",
    "predictor": "trainguard.predictor",
    "checkpoint": "trainguard.checkpoint",
    "recovery": "trainguard.recovery",
    "proto": "trainguard.proto",
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
    package_data={"": ["*.proto", "*.toml", "*.json", "*.csv", "py.typed"]},
    include_package_data=True,
)
