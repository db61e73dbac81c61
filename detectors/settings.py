"""The one loader of detector settings: which detectors run, where they read the hardware, and each one's fields.

Every composition reads the same table shape through :class:`DetectorSettings`:

- the daemon's ``[detectors]`` section (``trainguard agent``, :mod:`trainguard.agent.config`);
- ``trainguard run --detector-config FILE`` (the file's top level; ``enabled`` comes from ``--detectors``);
- ``trainguard detect --config FILE`` (its ``[detectors]`` table).

The shape::

    enabled = ["host", "pcie", "process"]   # detector names in run order; "all" = the default set
    root = "/srv/drill/node3"               # prefix of the /sys, /proc and /dev files read (default "/")
    interval_s = 1.0                        # period of every polled detector, s; 0 = each its own (default 0)

    [pcie]                                  # one table per enabled detector: its config class's fields
    aer_scope = "all"

    [roce]
    root = "/"                              # a table's own root and interval_s win over the top-level ones

The top-level ``root`` applies to every detector except those that watch the workers (``process``): they read
``/proc/<pid>`` of processes the agent itself started, which exist only in the real ``/proc``. Each table is
checked by its detector's own config class. Every problem is a :class:`DetectorConfigError` of one line naming
the source, the key and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.config_loader import (build, config_field, local_path_problem, read_toml, select_table, suggest,
                                      type_name)
from trainguard.detectors.base import (
    DEFAULT_DETECTORS,
    Detector,
    create_detectors,
    detector_class,
    detector_names,
    make_config,
)
from trainguard.detectors.errors import DetectorConfigError

#: Detector whose ``hang_floor_s`` ``trainguard run --hang-floor-s`` sets.
HANG_DETECTOR = "process"
#: Shortest and longest ``interval_s`` other than 0, seconds.
INTERVAL_RANGE_S = (0.05, 3600.0)


@dataclass
class _TopLevel:
    """The keys of the settings table that are not detector tables (their types; ranges are checked below)."""

    enabled: list[str] | None = config_field(default=None, expected="an array of detector names")
    root: str = "/"
    interval_s: float = 0.0


@dataclass
class DetectorSettings:
    """Validated detector settings.

    Attributes:
        enabled: detector names in run order (``"all"`` already expanded). Default: every default detector.
        root: path prefix of the /sys, /proc and /dev files the detectors read; ``"/"`` for the real system. Not
            applied to detectors that watch the workers. Default ``"/"``.
        interval_s: sampling period of every polled detector, seconds; 0 keeps each detector's own. Default 0.
        tables: detector name -> its fields as written (each checked by its config class).
        source: where the settings came from (file or flag), first in every error message.
        prefix: how the tables are named in that file (``"detectors."``: ``[detectors.pcie]``). Default ``""``.
    """

    enabled: tuple[str, ...] = DEFAULT_DETECTORS
    root: str = "/"
    interval_s: float = 0.0
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<detector settings>"
    prefix: str = ""

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, source: str = "<detector settings>", prefix: str = "",
                   enabled: Sequence[str] | None = None, enabled_flag: str = "enabled") -> DetectorSettings:
        """Builds and checks the settings from a parsed table.

        Args:
            table: ``{"enabled": [...], "root": ..., "interval_s": ..., "<detector>": {...}}``.
            source: file or flag name for error messages.
            prefix: how keys are named in errors (``"detectors."`` for a ``[detectors]`` section).
            enabled: the detector names when a flag gives them (then ``table`` must not hold ``enabled``).
            enabled_flag: how the user set ``enabled`` (e.g. ``--detectors``), named in errors.

        Returns:
            The settings, every detector table validated.

        Raises:
            DetectorConfigError: an unknown key, a value of the wrong type or out of range, an unknown detector,
                a table for a detector that is not enabled, or a bad detector field.
        """
        tables = {k: dict(v) for k, v in table.items() if isinstance(v, Mapping)}
        scalars = {k: v for k, v in table.items() if k not in tables}
        own = ("root", "interval_s") if enabled is not None else ("root", "interval_s", "enabled")
        for key, value in scalars.items():
            # Not the shared loader's message: here every other key must be a detector's table, and says so.
            if key == "enabled" and enabled is not None:
                # Was "unknown top-level key 'enabled' ... e.g. [enabled]": a table named enabled, where the flag
                # that lists the detectors is what the user needs.
                raise DetectorConfigError(
                    f"{source}: '{prefix}enabled' is not read here: {enabled_flag} names the detectors to run; "
                    "remove the key and give the list there")
            if key not in own:
                top = "the top level" if not prefix else f"[{prefix.rstrip('.')}]"
                raise DetectorConfigError(
                    f"{source}: unknown top-level key '{prefix}{key}' ({type_name(value)});{suggest(key, own)} "
                    f"{top} holds only {', '.join(repr(k) for k in own)}, every other key must be a [detector] "
                    f"table, e.g. [{prefix}{key}]")
        top_level = build(_TopLevel, scalars, source=source, table=prefix.rstrip("."), error=DetectorConfigError)
        kwargs: dict[str, Any] = {}
        if "root" in scalars:
            kwargs["root"] = _check_root(top_level.root, f"{prefix}root", source)
        if "interval_s" in scalars:
            kwargs["interval_s"] = _check_interval(top_level.interval_s, f"{prefix}interval_s", source)
        names = enabled if enabled is not None else top_level.enabled
        resolved = _expand(DEFAULT_DETECTORS if names is None else names, f"{prefix}enabled", source)
        for name, sub in tables.items():
            where = f"[{prefix}{name}]"
            if name not in resolved:
                if name not in detector_names():
                    raise DetectorConfigError(
                        f"{source}: {where} is not a detector;{suggest(name, detector_names())} detectors: "
                        f"{', '.join(detector_names())}; rename or remove the table")
                raise DetectorConfigError(
                    f"{source}: {where} configures detector '{name}', which {enabled_flag} "
                    f"({','.join(resolved) or 'none'}) does not enable; add it to {enabled_flag} or remove the table")
            if "root" in sub:
                _check_root(sub["root"], f"{where} root", source)
        settings = cls(enabled=resolved, tables=tables, source=source, prefix=prefix, **kwargs)
        settings.settings()  # every table checked by its detector's own config class, now
        return settings

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, table: str | None = None, enabled: Sequence[str] | None = None,
             flag: str = "--detector-config", enabled_flag: str = "enabled") -> DetectorSettings:
        """Reads the settings from a TOML file.

        Args:
            path: the file.
            table: the table holding the settings (``"detectors"``); None for the whole file.
            enabled: detector names given by a flag (see :meth:`from_table`).
            flag: the option that named the file, for error messages.
            enabled_flag: how ``enabled`` was given, for error messages.

        Raises:
            DetectorConfigError: the file is missing, unreadable, not UTF-8 TOML, or holds bad settings.
        """
        source = os.fspath(path)
        data = read_toml(source, error=DetectorConfigError, what="detector config file", flag=flag)
        if table is not None:
            section = select_table(data, table, source, error=DetectorConfigError) or {}
            return cls.from_table(section, source=source, prefix=f"{table}.", enabled=enabled,
                                  enabled_flag=enabled_flag)
        return cls.from_table(data, source=source, enabled=enabled, enabled_flag=enabled_flag)

    # ------------------------------------------------------------------ use
    def settings(self, hang_floor_s: float | None = None, root: str | None = None) -> dict[str, dict[str, Any]]:
        """Per-detector fields for :func:`~trainguard.detectors.base.create_detectors`, each validated.

        Each enabled detector gets its table, with the top-level ``root`` (not for a detector watching the
        workers) and ``interval_s`` filled in where the table does not set its own, and ``hang_floor_s`` for the
        process detector unless its table sets it.

        Args:
            hang_floor_s: ``--hang-floor-s``, seconds; None keeps the detector's default.
            root: overrides every detector's root (``trainguard detect --root``); None keeps the settings'.

        Returns:
            Detector name -> fields, for every enabled detector with at least one field set.

        Raises:
            DetectorConfigError: a detector's fields are invalid (the message names the table).
        """
        out: dict[str, dict[str, Any]] = {}
        for name in self.enabled:
            fields = dict(self.tables.get(name, {}))
            if root is not None:
                fields["root"] = root
            elif self.root != "/" and not getattr(detector_class(name), "accepts_worker_view", False):
                fields.setdefault("root", self.root)
            if self.interval_s:
                fields.setdefault("interval_s", self.interval_s)
            if name == HANG_DETECTOR and hang_floor_s is not None:
                fields.setdefault("hang_floor_s", hang_floor_s)
            try:
                make_config(name, fields)
            except DetectorConfigError as exc:
                where = f"[{self.prefix}{name}]" if name in self.tables else f"detector '{name}'"
                raise DetectorConfigError(f"{self.source}: {where}: {exc}") from exc
            if fields:
                out[name] = fields
        return out

    def create(self, worker_view: Any = None, hang_floor_s: float | None = None,
               root: str | None = None) -> list[Detector]:
        """Builds the enabled detectors, in order (see :meth:`settings` for the arguments)."""
        return create_detectors(self.enabled, self.settings(hang_floor_s, root), worker_view=worker_view)


def _expand(names: Sequence[str], key: str, source: str) -> tuple[str, ...]:
    out: list[str] = []
    for name in names:
        for n in DEFAULT_DETECTORS if name == "all" else (name,):
            try:
                detector_class(n)
            except DetectorConfigError as exc:
                raise DetectorConfigError(f"{source}: {key}: {exc}") from exc
            if n not in out:
                out.append(n)
    return tuple(out)


def _check_interval(value: float, key: str, source: str) -> float:
    lo, hi = INTERVAL_RANGE_S
    if value != 0 and not lo <= value <= hi:
        raise DetectorConfigError(f"{source}: {key}: {value} is outside [{lo:g}, {hi:g}] seconds; use 0 to keep "
                                  "each detector's own period")
    return float(value)


def _check_root(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str):  # a detector table's own root, which the shared loader has not seen
        raise DetectorConfigError(f"{source}: {key}: expected a string, got {type_name(value)} {value!r}")
    if not value:
        raise DetectorConfigError(f"{source}: {key}: must not be empty; use \"/\" for the real system")
    problem = local_path_problem(value)  # a URL was called "a relative path"
    if problem is not None:
        # Checked and read against the folder each command starts in: `trainguard detect --config` run from a
        # shell read another tree than the daemon (/ under systemd) given the same file, each without a word.
        raise DetectorConfigError(f"{source}: {key}: {value!r} {problem} (only `trainguard detect --root` "
                                  "resolves a relative path, against the folder it is typed in)")
    if not os.path.isdir(value):
        raise DetectorConfigError(f"{source}: {key}: {value!r} is not a directory; create the fake tree first or "
                                  "fix the path")
    return value


__all__ = ["DetectorSettings", "HANG_DETECTOR", "INTERVAL_RANGE_S"]
