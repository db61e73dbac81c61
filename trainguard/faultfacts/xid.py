"""The NVIDIA Xid table (``xid.json``): what each code means and what trainguard does about it.

Schema: ``{"default": {...}, "codes": {"79": {"name", "severity", "action", "nvidia_action", "description"}}}``
(``source``/``comment`` optional); ``nvidia_action`` is the resolution bucket of NVIDIA's Xid catalog
(RESTART_APP, RESET_GPU, RESTART_BM, IGNORE, CONTACT_SUPPORT...) and ``action`` trainguard's reaction to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainguard.detectors.events import Action, Severity
from trainguard.faultfacts import FactFileError, check_fields, read_fact_file


@dataclass(frozen=True)
class XidEntry:
    """What an Xid code means and what to do.

    Attributes:
        code: the Xid number.
        name: short name.
        severity: event severity.
        action: our recommended action.
        nvidia_action: NVIDIA's resolution bucket.
        description: one line.
    """

    code: int
    name: str
    severity: Severity
    action: Action
    nvidia_action: str
    description: str


def load_xid_catalog(path: str | None = None) -> tuple[dict[int, XidEntry], XidEntry]:
    """Loads the Xid table.

    Args:
        path: an operator's file of the same schema; the shipped ``xid.json`` when None.

    Returns:
        ``(code -> entry, default entry for unknown codes)``.

    Raises:
        FactFileError: unreadable file or an invalid entry.
    """
    label, data = read_fact_file(path, "xid.json")
    check_fields(label, "top level", data, {"default", "codes"}, {"comment", "source"})
    keys = {"name", "severity", "action", "nvidia_action", "description"}

    def entry(code: int, raw: Any) -> XidEntry:
        e = check_fields(label, f"xid {code}", raw, keys)
        try:
            severity, action = Severity.parse(str(e["severity"])), Action.parse(str(e["action"]))
        except ValueError as exc:
            raise FactFileError(f"{label}: xid {code}: {exc}") from exc
        return XidEntry(code, str(e["name"]), severity, action, str(e["nvidia_action"]), str(e["description"]))

    if not isinstance(data["codes"], dict):
        raise FactFileError(f"{label}: codes must be an object of Xid code -> entry")
    codes: dict[int, XidEntry] = {}
    for key, raw in data["codes"].items():
        if not key.isdigit():
            raise FactFileError(f"{label}: Xid code {key!r} must be a decimal number")
        codes[int(key)] = entry(int(key), raw)
    return codes, entry(0, data["default"])


__all__ = ["XidEntry", "load_xid_catalog"]
