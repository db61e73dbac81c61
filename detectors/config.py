"""The ``[detectors]`` table of the agent's TOML config: which detectors run, and each one's settings.

Example::

    [detectors]
    enabled = ["host", "disk", "kmsg", "nvidia", "pcie", "roce", "process"]   # default: all built-ins

    [detectors.disk]
    paths = ["/var/lib/trainguard/ckpt", "/var/log/trainguard"]

    [detectors.roce]
    interfaces = ["ens1f*"]
    flap_threshold = 3

Every field is the one of that detector's config dataclass (see each module); unknown names are refused.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.base import (
    DEFAULT_DETECTORS,
    Detector,
    DetectorConfig,
    create_detectors,
    detector_class,
    make_config,
)
from trainguard.detectors.errors import DetectorConfigError


@dataclass
class DetectorsConfig:
    """Which detectors run and how.

    Attributes:
        enabled: detector names, in run order. Default: every built-in (:data:`DEFAULT_DETECTORS`).
        settings: name -> validated config of that detector (defaults for those not listed).
    """

    enabled: tuple[str, ...] = DEFAULT_DETECTORS
    settings: dict[str, DetectorConfig] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], root: str | None = None) -> "DetectorsConfig":
        """Builds the config from the ``[detectors]`` table.

        Args:
            table: ``{"enabled": [...], "<name>": {...fields}}``.
            root: overrides every detector's ``root``.

        Returns:
            The validated config.

        Raises:
            DetectorConfigError: unknown detector or field, wrong type, or a table for a detector not enabled.
        """
        table = dict(table)
        enabled = table.pop("enabled", list(DEFAULT_DETECTORS))
        if not isinstance(enabled, (list, tuple)) or not all(isinstance(n, str) for n in enabled):
            raise DetectorConfigError("[detectors] enabled must be a list of detector names")
        for name in enabled:
            detector_class(name)
        settings: dict[str, DetectorConfig] = {}
        for name, sub in table.items():
            if name not in enabled:
                raise DetectorConfigError(
                    f"[detectors.{name}] configures a detector that is not in 'enabled' ({list(enabled)}); "
                    "enable it or remove the table")
            if not isinstance(sub, Mapping):
                raise DetectorConfigError(f"[detectors.{name}] must be a table of fields")
            settings[name] = make_config(name, sub, root)
        for name in enabled:
            if name not in settings:
                settings[name] = make_config(name, None, root)
        return cls(tuple(enabled), settings)

    @classmethod
    def from_toml(cls, path: str, root: str | None = None) -> "DetectorsConfig":
        """Reads the ``[detectors]`` table of a TOML file (the whole file may hold other tables).

        Args:
            path: TOML file.
            root: overrides every detector's ``root``.

        Returns:
            The validated config (all defaults when the file has no ``[detectors]`` table).

        Raises:
            DetectorConfigError: unreadable or invalid file.
        """
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise DetectorConfigError(f"cannot read config {path}: {exc.strerror}; check the path") from exc
        except tomllib.TOMLDecodeError as exc:
            raise DetectorConfigError(f"config {path} is not valid TOML: {exc}") from exc
        return cls.from_dict(data.get("detectors", {}), root)

    def create(self, worker_view: Any = None) -> list[Detector]:
        """Builds the enabled detectors.

        Args:
            worker_view: the agent's :class:`~trainguard.detectors.process.WorkerView`, for ``process``.

        Returns:
            The detectors, in :attr:`enabled` order.
        """
        return create_detectors(self.enabled, self.settings, worker_view=worker_view)
