"""Node detectors: raw hardware, bus, network and process signals in, typed health events out.

The agent builds detectors from its ``[detectors]`` config (:class:`~trainguard.detectors.settings.DetectorSettings`)
and runs them in a :class:`~trainguard.detectors.runner.DetectorRunner`.
"""

from trainguard.detectors.base import Detector, DetectorConfig, DetectorState, Sample, create_detectors
from trainguard.detectors.events import Action, HealthEvent, Severity

__all__ = ["Action", "Detector", "DetectorConfig", "DetectorState", "HealthEvent", "Sample", "Severity",
           "create_detectors"]
