"""NVML clock throttle reasons that mean trouble (``throttle.json``), read by the ``nvidia`` detector and the
predictor's detector feed.

Schema: ``{"bad_reasons": {"<NVML name>": {"bit": <int, a single bit>, "description": "..."}}}`` (``source``
optional).
"""

from __future__ import annotations

from trainguard.faultfacts import FactFileError, check_fields, read_fact_file


def load_bad_throttle_reasons(path: str | None = None) -> dict[str, int]:
    """The throttle reasons that mean trouble: NVML name -> bit of the ``nvmlClocksEventReason`` mask.

    Args:
        path: a file of the same schema; the shipped ``throttle.json`` when None.

    Raises:
        FactFileError: unreadable file, or a bit that is not a single positive power of two.
    """
    label, data = read_fact_file(path, "throttle.json")
    check_fields(label, "top level", data, {"bad_reasons"}, {"source", "comment"})
    if not isinstance(data["bad_reasons"], dict) or not data["bad_reasons"]:
        raise FactFileError(f"{label}: bad_reasons must be a non-empty object of NVML name -> entry")
    out: dict[str, int] = {}
    for name, raw in data["bad_reasons"].items():
        e = check_fields(label, f"reason {name}", raw, {"bit", "description"})
        bit = e["bit"]
        if not isinstance(bit, int) or isinstance(bit, bool) or bit <= 0 or bit & (bit - 1):
            raise FactFileError(f"{label}: reason {name}: bit {bit!r} must be a single bit (a power of two)")
        out[str(name)] = bit
    return out


__all__ = ["load_bad_throttle_reasons"]
