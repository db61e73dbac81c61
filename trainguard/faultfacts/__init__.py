"""Fault facts: what trainguard knows about faults, as data files read by detectors, predictor and drill.

Facts, not logic, so they live in data files shipped in the wheel, each with a validating loader and a test over
every shipped file (``tests/trainguard/test_faultfacts.py``):

``xid.json`` (:mod:`trainguard.faultfacts.xid`)
    NVIDIA Xid codes: name, severity, NVIDIA's resolution bucket and trainguard's action. Read by the ``nvidia``
    and ``kmsg`` detectors (an operator may pass a replacement file of the same schema); the predictor's rules
    tier acts on the codes the table says end training (a test keeps ``predictor/rules.json`` in step).
``throttle.json`` (:mod:`trainguard.faultfacts.throttle`)
    The NVML clock throttle reasons that mean trouble rather than policy. Read by the ``nvidia`` detector and the
    predictor's detector feed.
``taxonomy.json`` (:mod:`trainguard.faultfacts.taxonomy`)
    How the faults of public traces (StepFun's fault trace, Llama 3's interruption table) map onto fault classes.
    Read by the drill's ETTR model and trace loader; the predictor's trace generator keys its precursors by the
    same StepFun descriptions.

This package imports only the detector event types (severity, action) besides the standard library.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from trainguard.errors import ConfigError


class FactFileError(ConfigError):
    """A shipped or operator-supplied fault-facts file is unreadable or invalid (the message names the file and
    the entry)."""


def read_fact_file(path: str | None, default_name: str, package: str = __name__) -> tuple[str, Any]:
    """Reads a JSON fact (or rule) file: ``path`` when given, else ``default_name`` shipped in ``package``.

    Returns:
        ``(label for messages, parsed JSON)``.

    Raises:
        FactFileError: the file cannot be read or is not JSON.
    """
    try:
        if path:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            label = path
        else:
            text = resources.files(package).joinpath(default_name).read_text(encoding="utf-8")
            label = f"{package}/{default_name}"
    except OSError as exc:
        raise FactFileError(f"fact file {path or default_name} cannot be read: {exc}; check the path") from exc
    try:
        return label, json.loads(text)
    except json.JSONDecodeError as exc:
        raise FactFileError(f"fact file {label} is not valid JSON: {exc}; fix the syntax") from exc


def check_fields(label: str, where: str, obj: Any, required: set[str], optional: frozenset[str] | set[str] = frozenset()
                 ) -> dict[str, Any]:
    """``obj`` as a dict holding every ``required`` key and no key outside ``required | optional``.

    Raises:
        FactFileError: not an object, or a missing or unknown field (named).
    """
    if not isinstance(obj, dict):
        raise FactFileError(f"{label}: {where} must be an object")
    missing = required - set(obj)
    unknown = set(obj) - required - set(optional)
    if missing or unknown:
        raise FactFileError(f"{label}: {where} has missing fields {sorted(missing)} / unknown fields {sorted(unknown)}")
    return obj


def shipped_fact_files() -> list[str]:
    """Names of every ``*.json`` file shipped in this package."""
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


__all__ = ["FactFileError", "check_fields", "read_fact_file", "shipped_fact_files"]
