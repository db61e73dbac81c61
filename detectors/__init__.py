"""Node detectors: raw hardware, bus, network and process signals in, typed health events out."""

from trainguard.detectors.events import Action, HealthEvent, Severity

__all__ = ["Action", "HealthEvent", "Severity"]
