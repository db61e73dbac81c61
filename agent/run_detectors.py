"""The detector settings of ``trainguard run``: the ``--detector-config`` TOML file and ``--hang-floor-s``.

The file sets where the detectors read the hardware and each detector's own fields::

    # trainguard run --detectors process,pcie,roce --detector-config node.toml ...
    root = "/srv/drill/node3"     # prefix of the /sys, /proc and /dev files the detectors read (default "/")
    interval_s = 1.0              # sampling period of every polled detector, seconds (default 0: each its own)

    [pcie]                        # one table per detector, named as in --detectors; its config class's fields
    aer_scope = "all"

    [roce]
    root = "/"                    # a table's own root wins over the top-level one: real netlink and veths here
    interfaces = ["veth*"]

    [process]
    hang_floor_s = 20.0

The top-level ``root`` applies to every detector except those that watch the workers (``process``): they read
``/proc/<pid>`` of the processes this agent itself started, which exist only in the real ``/proc`` (with a fake
root every worker would look gone and hangs would go unseen); their own table may still set ``root``.

Top-level keys other than ``root`` and ``interval_s`` must be tables named after a detector that ``--detectors``
enables; each table's fields are checked by that detector's own config class (``trainguard detect --help`` lists
the detectors; each detector module documents its fields). ``--hang-floor-s`` sets ``process.hang_floor_s`` unless
the file sets it.

The types and the ``interval_s`` range follow the daemon's ``[detectors]`` section (:mod:`trainguard.agent.config`),
whose checks are reused here. Every problem raises :class:`~trainguard.agent.config.AgentConfigError` with one
line naming the file, the key and what to do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.config import AgentConfigError, _check_type, _type_name
from trainguard.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

#: Detector whose ``hang_floor_s`` the ``--hang-floor-s`` flag sets.
HANG_DETECTOR = "process"
#: The keys the top level may hold besides detector tables, and their types.
_TOP_LEVEL: dict[str, type] = {"root": str, "interval_s": float}


@dataclass
class RunDetectorConfig:
    """The parsed ``--detector-config`` file.

    Attributes:
        root: path prefix of the /sys, /proc and /dev files the detectors read; a fake tree in tests and drills.
            Not applied to the detectors that watch the workers (``process``). A detector table may set its own
            ``root``. Default ``"/"``.
        interval_s: sampling period of every polled detector, in seconds; 0 keeps each detector's own default.
            A detector table may set its own ``interval_s``. Default 0.
        tables: detector name -> the fields of its table, as written (checked by :meth:`settings`).
        source: the file it was read from, for error messages.
    """

    root: str = "/"
    interval_s: float = 0.0
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<detector config>"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<detector config>") -> "RunDetectorConfig":
        """Builds the configuration from a parsed TOML document, checking keys, types and ranges.

        Detector tables are only split off here; :meth:`settings` validates them against the detectors.

        Args:
            data: the parsed document.
            source: file name used in error messages.

        Returns:
            The configuration.

        Raises:
            AgentConfigError: a top-level key that is neither ``root``, ``interval_s`` nor a table; a value of
                the wrong type; ``root`` empty or not a directory; ``interval_s`` out of range.
        """
        kwargs: dict[str, Any] = {}
        tables: dict[str, dict[str, Any]] = {}
        for key, value in data.items():
            if isinstance(value, Mapping):
                tables[key] = dict(value)
            elif key in _TOP_LEVEL:
                kwargs[key] = _check_type(value, _TOP_LEVEL[key], key, source)
            else:
                raise AgentConfigError(
                    f"{source}: unknown top-level key '{key}' ({_type_name(value)}); the top level holds only "
                    f"'root' and 'interval_s', every other key must be a [detector] table, e.g. [{key}]")
        config = cls(**kwargs, tables=tables, source=source)
        config._check_values()
        return config

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RunDetectorConfig":
        """Reads and checks a ``--detector-config`` file.

        Args:
            path: the TOML file.

        Returns:
            The configuration (detector tables not yet checked against ``--detectors``: see :meth:`settings`).

        Raises:
            AgentConfigError: the file is missing, unreadable, not TOML, or holds a bad key or value.
        """
        source = os.fspath(path)
        try:
            with open(source, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            raise AgentConfigError(
                f"{source}: detector config file not found; pass an existing --detector-config PATH") from None
        except IsADirectoryError:
            raise AgentConfigError(f"{source}: is a directory; --detector-config takes a TOML file") from None
        except OSError as exc:
            raise AgentConfigError(
                f"{source}: cannot read detector config ({exc.strerror}); check its permissions") from exc
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise AgentConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                   "save the file as UTF-8") from exc
        except tomllib.TOMLDecodeError as exc:
            raise AgentConfigError(f"{source}: not valid TOML: {exc}; fix the file") from exc
        return cls.from_mapping(data, source=source)

    def _check_values(self) -> None:
        if self.interval_s != 0 and not 0.05 <= self.interval_s <= 3600:
            raise AgentConfigError(f"{self.source}: interval_s: {self.interval_s} is outside [0.05, 3600] seconds; "
                                   "use 0 to keep each detector's own period")
        _check_root(self.root, "root", self.source)
        for name, table in self.tables.items():
            if "root" in table:
                _check_root(table["root"], f"[{name}] root", self.source)

    def settings(self, enabled: Sequence[str], hang_floor_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Per-detector fields for :func:`~trainguard.detectors.base.create_detectors`, each one validated.

        Each enabled detector gets its table, with the top-level ``root`` (but not for a detector watching the
        workers) and ``interval_s`` filled in where the table does not set its own, and ``hang_floor_s`` for the
        process detector unless its table sets it.

        Args:
            enabled: detector names ``--detectors`` enables, in order.
            hang_floor_s: ``--hang-floor-s``, in seconds; None leaves the detector's default.

        Returns:
            Detector name -> fields, for every enabled detector with at least one field set.

        Raises:
            AgentConfigError: a table names an unknown detector or one that is not enabled, or holds an unknown
                field or a bad value.
        """
        from trainguard.detectors.base import detector_class, detector_names, make_config
        from trainguard.detectors.errors import DetectorConfigError

        for name in self.tables:
            if name not in enabled:
                if name not in detector_names():
                    raise AgentConfigError(
                        f"{self.source}: [{name}] is not a detector (detectors: {', '.join(detector_names())}); "
                        "rename or remove the table")
                raise AgentConfigError(
                    f"{self.source}: [{name}] configures detector '{name}', which --detectors "
                    f"({','.join(enabled) or 'none'}) does not enable; add it to --detectors or remove the table")
        out: dict[str, dict[str, Any]] = {}
        for name in enabled:
            fields = dict(self.tables.get(name, {}))
            if self.root != "/" and not getattr(detector_class(name), "accepts_worker_view", False):
                fields.setdefault("root", self.root)
            if self.interval_s:
                fields.setdefault("interval_s", self.interval_s)
            if name == HANG_DETECTOR and hang_floor_s is not None:
                fields.setdefault("hang_floor_s", hang_floor_s)
            try:
                make_config(name, fields)
            except DetectorConfigError as exc:
                where = f"[{name}]" if name in self.tables else f"detector '{name}'"
                raise AgentConfigError(f"{self.source}: {where}: {exc}") from exc
            if fields:
                out[name] = fields
        return out


def run_detector_settings(enabled: Sequence[str], config_path: str | None,
                          hang_floor_s: float | None) -> dict[str, dict[str, Any]]:
    """The ``detector_config`` of a ``trainguard run`` node: its ``--detector-config`` file and flags, validated.

    Args:
        enabled: detector names from ``--detectors``.
        config_path: the ``--detector-config`` file, or None for defaults.
        hang_floor_s: ``--hang-floor-s``, in seconds.

    Returns:
        Detector name -> fields.

    Raises:
        AgentConfigError: the file is unusable (see :meth:`RunDetectorConfig.load`) or does not fit ``enabled``.
        UsageError: ``enabled`` names an unknown detector.
    """
    from trainguard.detectors.base import detector_class
    from trainguard.detectors.errors import DetectorConfigError

    for name in enabled:
        try:
            detector_class(name)  # an unknown name fails here, before any process starts
        except DetectorConfigError as exc:
            raise UsageError(f"--detectors {','.join(enabled)}: {exc}") from exc
    if config_path is None:
        config = RunDetectorConfig(source="--detectors")
    else:
        config = RunDetectorConfig.load(config_path)
    return config.settings(enabled, hang_floor_s)


def _check_root(value: Any, key: str, source: str) -> None:
    if not isinstance(value, str):
        raise AgentConfigError(f"{source}: {key}: expected a string, got {_type_name(value)} {value!r}")
    if not value:
        raise AgentConfigError(f"{source}: {key}: must not be empty; use \"/\" for the real system")
    if not os.path.isdir(value):
        raise AgentConfigError(f"{source}: {key}: {value!r} is not a directory; create the fake tree first or "
                               "fix the path")
