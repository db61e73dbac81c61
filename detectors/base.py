"""The detector contract: a named plugin whose ``sample()`` returns metrics and typed health events.

A detector reads raw signals (files under a configurable root, NVML, netlink, worker snapshots) and returns a
:class:`Sample`. The :class:`~trainguard.detectors.runner.DetectorRunner` calls ``sample()`` on each detector's
interval; a detector that also implements :class:`ListeningDetector` gets its own thread for event-driven input
(netlink link state).

Metric names inside a sample are local to the detector (``"cpu_percent"``); the runner prefixes them with the
detector name (``"host.cpu_percent"``). Node-wide aggregates have plain names; per-device values carry the device
in brackets (``"aer_correctable[0000:3b:00.0]"``) so a consumer that wants a fixed feature set (the predictor)
can keep only the names without ``[``.

Conditions are edge-triggered: :meth:`Detector.condition` emits one event when a condition becomes true and one
``<kind>.cleared`` event when it ends, so a persisting problem does not flood the agent.

Detectors register by name with :func:`register_detector`; :func:`create_detectors` builds them from config.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import os
import threading
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, HealthEvent, Severity

#: Modules holding the built-in detectors; imported on first use of the registry.
BUILTIN_MODULES: tuple[str, ...] = (
    "trainguard.detectors.host",
    "trainguard.detectors.disk",
    "trainguard.detectors.thermal",
    "trainguard.detectors.edac",
    "trainguard.detectors.kmsg",
    "trainguard.detectors.nvidia",
    "trainguard.detectors.ascend",
    "trainguard.detectors.pcie",
    "trainguard.detectors.roce",
    "trainguard.detectors.process",
)

#: Detectors the agent runs when its config does not name any.
DEFAULT_DETECTORS: tuple[str, ...] = (
    "host", "disk", "thermal", "edac", "kmsg", "nvidia", "nvlink", "ascend", "pcie", "roce", "process",
)

#: Kind of the event a detector yields when it cannot read its inputs.
DETECTOR_ERROR_KIND = "detector.error"


class DetectorState(enum.IntEnum):
    """Health of one detector (values equal ``trainguard.v1.DetectorState``).

    OK: inputs read, nothing wrong. DEGRADED: a warning-level condition is active. FAILED: an error or critical
    condition is active. NO_HARDWARE: nothing to watch on this node. ERROR: the detector could not read its inputs.
    """

    OK = 1
    DEGRADED = 2
    FAILED = 3
    NO_HARDWARE = 4
    ERROR = 5

    @property
    def label(self) -> str:
        """Lower-case name with dashes, e.g. ``"no-hardware"``."""
        return self.name.lower().replace("_", "-")


#: Which state an active condition of a given severity puts its detector in.
_STATE_FOR_SEVERITY = {
    Severity.INFO: DetectorState.OK,
    Severity.WARNING: DetectorState.DEGRADED,
    Severity.ERROR: DetectorState.FAILED,
    Severity.CRITICAL: DetectorState.FAILED,
}
def state_for(severity: Severity) -> DetectorState:
    """The state an event of ``severity`` puts its detector in (warning: degraded; error, critical: failed)."""
    return _STATE_FOR_SEVERITY[severity]


#: Precedence when several conditions set a state: a read error hides nothing, a failure beats a warning.
_STATE_RANK = {
    DetectorState.OK: 0,
    DetectorState.NO_HARDWARE: 1,
    DetectorState.DEGRADED: 2,
    DetectorState.ERROR: 3,
    DetectorState.FAILED: 4,
}


#: Longest sampling period a detector may be given, in seconds (a day): a longer one is a typo, and one past the
#: platform's time_t (1e12, inf) ended the runner's sampling thread with an OverflowError.
MAX_INTERVAL_S = 86400.0


@dataclass
class DetectorConfig:
    """Fields every detector's config has.

    Attributes:
        root: directory that stands for ``/`` when reading sysfs/procfs/dev files; tests point it at a fake tree.
            Default ``"/"``.
        interval_s: seconds between two ``sample()`` calls by the runner, in (0, :data:`MAX_INTERVAL_S`].
            Default 5.0.
    """

    root: str = "/"
    interval_s: float = 5.0

    def validate(self) -> None:
        """Checks field values; subclasses extend it.

        Raises:
            DetectorConfigError: a field is out of range.
        """
        if not isinstance(self.root, str) or not self.root:
            raise DetectorConfigError(f"detector root {self.root!r} must be a non-empty path; use '/' on a real node")
        if not 0 < self.interval_s <= MAX_INTERVAL_S:  # NaN fails too
            raise DetectorConfigError(f"interval_s={self.interval_s} must be > 0 and at most {MAX_INTERVAL_S:.0f} "
                                      "seconds")
        # TOML has nan and inf, and every range check (x < 0, x <= 0) passes nan and half of them inf:
        # flap_window_s = nan never emptied the flap window (a link flapping for good after 3 downs ever), a nan
        # threshold never fired; critical_margin_c = inf put every zone "near its critical trip", hysteresis_c =
        # inf never cleared a condition.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise DetectorConfigError(f"{type(self).__name__}.{f.name}={value} must be a finite number")

    def path(self, path: str) -> str:
        """Maps an absolute system path (``/sys/class/net``) under :attr:`root`.

        Args:
            path: absolute path as on a real node.

        Returns:
            The path under the configured root.
        """
        if self.root == "/":
            return path
        return os.path.join(self.root, path.lstrip("/"))

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any]) -> _C:
        """Builds and validates a config from a TOML table or dict.

        Lists become tuples where the field is a tuple; ints become floats where the field is a float.

        Args:
            data: field name -> value.

        Returns:
            The validated config.

        Raises:
            DetectorConfigError: unknown field, wrong type or invalid value.
        """
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in names:
                raise DetectorConfigError(
                    f"{cls.__name__}: unknown field {key!r}; known fields are {sorted(names)}"
                )
            kwargs[key] = _coerce(cls.__name__, key, hints.get(key), value)
        config = cls(**kwargs)
        config.validate()
        return config


_C = TypeVar("_C", bound=DetectorConfig)


def _coerce(owner: str, key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is tuple and isinstance(value, (list, tuple)):
        # Items are checked too: paths = ["/", 7] had the disk detector statvfs() file descriptor 7, and
        # interfaces = [1] ended every sample in a TypeError, both a detector error instead of a config error.
        item = typing.get_args(hint)[0] if typing.get_args(hint) else None
        bad = [v for v in value if isinstance(item, type) and not isinstance(v, item)]
        if bad:
            raise DetectorConfigError(f"{owner}.{key}={list(value)!r}: item {bad[0]!r} must be of type "
                                      f"{item.__name__}")
        return tuple(value)
    # bool is an int in Python: flap_threshold = true read as 1.
    if hint in (float, int, str, bool) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        raise DetectorConfigError(f"{owner}.{key}={value!r} must be of type {hint.__name__}")
    if origin is tuple and not isinstance(value, tuple):
        raise DetectorConfigError(f"{owner}.{key}={value!r} must be a list")
    return value


@dataclass
class Sample:
    """What one ``sample()`` call observed.

    Attributes:
        metrics: metric name (local to the detector) -> value.
        events: events raised by this sample, oldest first.
        state: the detector's state after this sample.
        detail: one line explaining the state (empty when OK).
        errors: inputs that could not be read; the runner turns each into a ``detector.error`` event.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    events: list[HealthEvent] = field(default_factory=list)
    state: DetectorState = DetectorState.OK
    detail: str = ""
    errors: list[DetectorReadError] = field(default_factory=list)

    def worsen(self, state: DetectorState, detail: str) -> None:
        """Moves the state to ``state`` if that is worse than the current one.

        Args:
            state: candidate state.
            detail: the explanation kept with it.
        """
        if _STATE_RANK[state] > _STATE_RANK[self.state]:
            self.state = state
            self.detail = detail

    def error(self, exc: DetectorReadError) -> None:
        """Records an unreadable input; the detector keeps going with its other inputs.

        Args:
            exc: what could not be read, and why.
        """
        self.errors.append(exc)
        self.worsen(DetectorState.ERROR, str(exc))


class Detector(ABC):
    """One source of health signals.

    Subclasses set :attr:`name` and :attr:`config_class`, implement :meth:`sample`, and may override
    :meth:`close`. ``sample()`` must not block for long (the runner calls every detector from one thread) and
    should report unreadable inputs through :meth:`Sample.error` rather than raise; anything it raises anyway is
    caught by the runner and becomes a ``detector.error`` event (the :meth:`condition` and :meth:`one_off`
    events raised before it are still delivered, see :meth:`recording_events`).
    """

    #: Registry name, also the ``source`` of the detector's events and the prefix of its metrics.
    name: ClassVar[str] = ""
    #: The dataclass holding this detector's settings.
    config_class: ClassVar[type[DetectorConfig]] = DetectorConfig
    #: Default seconds between samples when the config does not override ``interval_s``.
    default_interval_s: ClassVar[float] = 5.0
    # While the runner samples: (the sampling thread's id, the events condition() and one_off() raised in it so
    # far, their ids); see recording_events(). A class default, so a subclass that skips Detector.__init__ still
    # samples.
    _journal: tuple[int, list[HealthEvent], set[str]] | None = None

    def __init__(self, config: DetectorConfig | None = None) -> None:
        """Creates the detector.

        Args:
            config: its settings; the config class defaults when None.

        Raises:
            DetectorConfigError: the config is of the wrong class or invalid.
        """
        if config is None:
            config = self.config_class(interval_s=self.default_interval_s)
        if not isinstance(config, self.config_class):
            raise DetectorConfigError(
                f"detector {self.name!r} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        config.validate()
        self.config = config
        # Active conditions: key -> the event that started it (see condition()).
        self._active: dict[str, HealthEvent] = {}

    @abstractmethod
    def sample(self) -> Sample:
        """Reads the inputs once.

        Returns:
            Metrics, new events and the detector's state.
        """

    def close(self) -> None:
        """Releases files, sockets or libraries the detector holds (idempotent)."""

    def event(
        self,
        kind: str,
        severity: Severity,
        action: Action,
        message: str,
        subject: str = "",
        evidence: Mapping[str, Any] | None = None,
    ) -> HealthEvent:
        """Builds an event whose source is this detector.

        Args:
            kind: dotted kind, e.g. ``"pcie.aer_fatal"``.
            severity: how bad.
            action: recommended reaction.
            message: one human-readable line.
            subject: device or process it is about.
            evidence: raw values; converted to strings.

        Returns:
            The event.
        """
        return HealthEvent(
            source=self.name,
            kind=kind,
            severity=severity,
            action=action,
            message=message,
            subject=subject,
            evidence={k: str(v) for k, v in (evidence or {}).items()},
        )

    def one_off(self, sample: Sample, event: HealthEvent) -> HealthEvent:
        """Adds a one-off event to ``sample``: one that is raised once for what a counter or a log read showed
        (an uncorrectable memory error, an Xid, a kernel log match), not a lasting condition.

        Such an event is raised once because the detector moved its remembered state past it (the counter's last
        value, the log's read position) before the sample is returned. Should ``sample()`` raise after that, the
        sample with the event is lost while the state already moved: the event would never come again (a drain
        never asked for). Added through here, it is recorded as :meth:`condition` events are, and the runner
        delivers it for a sample that raised (see :meth:`recording_events`).

        Args:
            sample: the sample being built.
            event: the event (from :meth:`event`).

        Returns:
            ``event``.
        """
        sample.events.append(event)
        self._journal_add(event)
        return event

    def holding(self, key: str) -> bool:
        """Whether the condition ``key`` is active (started and not cleared): a detector widens the threshold
        that ends it by a hysteresis, so a value hovering at the threshold raises one event, not one per
        crossing."""
        return key in self._active

    def condition(
        self,
        sample: Sample,
        key: str,
        active: bool,
        kind: str,
        severity: Severity,
        action: Action,
        message: str,
        subject: str = "",
        evidence: Mapping[str, Any] | None = None,
    ) -> None:
        """Edge-triggers a lasting condition: one event when it starts, one ``.cleared`` event when it ends.

        While active, the condition also sets the sample's state (warning -> degraded, error/critical -> failed).

        Args:
            sample: the sample being built.
            key: identity of the condition (kind plus subject is typical).
            active: whether the condition holds now.
            kind: event kind while active; ``<kind>.cleared`` when it ends.
            severity: severity of the start event.
            action: recommended action at start.
            message: one line describing it.
            subject: device or process.
            evidence: raw values.
        """
        was = key in self._active
        if active:
            sample.worsen(_STATE_FOR_SEVERITY[severity], message)
            if not was:
                started = self.event(kind, severity, action, message, subject, evidence)
                self._active[key] = started
                sample.events.append(started)
                self._journal_add(started)
        elif was:
            started = self._active.pop(key)
            # The end names what the start named: a consumer pairs them by kind and subject, and a subject can
            # read differently by then (a lost GPU is "gpu1" to NVML, its PCI address once it answers again).
            cleared = self.event(kind + ".cleared", Severity.INFO, Action.NONE, f"cleared: {message}",
                                 started.subject, evidence)
            sample.events.append(cleared)
            self._journal_add(cleared)

    def _journal_add(self, event: HealthEvent) -> None:
        # Only the sampling thread's own: a listener thread (RoCE link state) that starts a condition meanwhile
        # delivers that event itself.
        journal = self._journal
        # Once each: a condition's event that a detector also passes to one_off() (RoCE link events built with a
        # flap condition inside) is one event.
        if journal is not None and journal[0] == threading.get_ident() and event.event_id not in journal[2]:
            journal[1].append(event)
            journal[2].add(event.event_id)

    @contextmanager
    def recording_events(self) -> Iterator[list[HealthEvent]]:
        """Records the events :meth:`condition` (starts and ends) and :meth:`one_off` raise in the calling thread
        until the block ends.

        The runner samples inside it: a ``sample()`` that raises partway has already marked the conditions it
        started active (and dropped those it ended), and moved the counters and log positions past its one-off
        events, but its sample, with those events, is lost. They would never be sent again (a drain never asked
        for); the runner delivers these events instead. Delivered rather than rolled back: a read that fails every
        time after the event would otherwise roll it back at every sample, never sending it. Per thread, so no
        other thread's events are taken.

        Yields:
            The events, oldest first; the list stays valid after the block.
        """
        events: list[HealthEvent] = []
        self._journal = (threading.get_ident(), events, set())
        try:
            yield events
        finally:
            self._journal = None

    #: The former name of :meth:`recording_events` (it recorded condition events only).
    recording_conditions = recording_events

    def active_conditions(self) -> list[HealthEvent]:
        """The start events of the conditions active now (raised by :meth:`condition`, not yet cleared).

        Call it from the thread that calls :meth:`sample` (the runner snapshots it after each sample).

        Returns:
            One event per active condition, oldest first.
        """
        return list(self._active.values())

    def no_hardware(self, detail: str) -> Sample:
        """A sample saying there is nothing to watch here.

        Args:
            detail: what is missing, e.g. ``"no NVIDIA driver (libnvidia-ml.so not found)"``.

        Returns:
            An empty sample in state NO_HARDWARE.
        """
        return Sample(state=DetectorState.NO_HARDWARE, detail=detail)


class ListeningDetector(Detector):
    """A detector that also receives events as they happen (the runner gives it one thread).

    :meth:`listen` blocks, calling ``emit`` for each event, until :meth:`stop_listening` is called from another
    thread. It returns at once when there is nothing to listen to.
    """

    @abstractmethod
    def listen(self, emit: Callable[[HealthEvent], None]) -> None:
        """Blocks delivering events to ``emit`` until :meth:`stop_listening`.

        Args:
            emit: called from the listening thread for each event; must not block.
        """

    @abstractmethod
    def stop_listening(self) -> None:
        """Makes :meth:`listen` return soon; safe to call from any thread, more than once."""


_REGISTRY: dict[str, type[Detector]] = {}
_D = TypeVar("_D", bound=type[Detector])


def register_detector(cls: _D) -> _D:
    """Class decorator adding a detector to the registry under ``cls.name``.

    Args:
        cls: a :class:`Detector` subclass with a non-empty ``name``.

    Returns:
        ``cls`` unchanged.

    Raises:
        DetectorConfigError: the name is empty or taken by another class.
    """
    if not cls.name:
        raise DetectorConfigError(f"{cls.__name__} has no name; set the class attribute 'name'")
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise DetectorConfigError(f"detector name {cls.name!r} is used by both {other.__name__} and {cls.__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def detector_names() -> list[str]:
    """Names of every registered detector (built-ins included), sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def detector_class(name: str) -> type[Detector]:
    """Looks a detector class up by name.

    Args:
        name: registry name, e.g. ``"roce"``.

    Returns:
        The class.

    Raises:
        DetectorConfigError: no detector has that name.
    """
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise DetectorConfigError(f"unknown detector {name!r}; known detectors: {sorted(_REGISTRY)}") from None


def make_config(
    name: str, data: Mapping[str, Any] | DetectorConfig | None = None, root: str | None = None
) -> DetectorConfig:
    """Builds the typed config of detector ``name``.

    Args:
        name: detector name.
        data: a config instance, a dict of fields (from TOML), or None for defaults.
        root: overrides ``root`` when given.

    Returns:
        The validated config.

    Raises:
        DetectorConfigError: unknown detector or invalid fields.
    """
    cls = detector_class(name)
    if isinstance(data, DetectorConfig):
        config = dataclasses.replace(data, root=root) if root is not None else data
    else:
        fields = dict(data or {})
        fields.setdefault("interval_s", cls.default_interval_s)
        if root is not None:
            fields["root"] = root
        config = cls.config_class.from_dict(fields)
    config.validate()
    return config


def create_detectors(
    names: Sequence[str] | None = None,
    config: Mapping[str, Mapping[str, Any] | DetectorConfig] | None = None,
    *,
    root: str | None = None,
    worker_view: Any = None,
) -> list[Detector]:
    """Builds detectors by name, as the agent's config lists them.

    Args:
        names: detector names; :data:`DEFAULT_DETECTORS` when None.
        config: per-detector settings (name -> dict of fields or config instance); missing names get defaults.
        root: overrides every detector's ``root`` (tests, ``trainguard detect --root``).
        worker_view: a :class:`~trainguard.detectors.process.WorkerView` given to detectors that watch workers.

    Returns:
        The detectors, in the order of ``names``.

    Raises:
        DetectorConfigError: unknown or duplicate name, config for a detector not listed, or invalid fields.
    """
    names = list(DEFAULT_DETECTORS if names is None else names)
    config = dict(config or {})
    if len(set(names)) != len(names):
        raise DetectorConfigError(f"detector list {names} names a detector twice; list each once")
    extra = set(config) - set(names)
    if extra:
        raise DetectorConfigError(f"config given for detectors {sorted(extra)} that are not enabled in {names}")
    detectors: list[Detector] = []
    for name in names:
        cls = detector_class(name)
        cfg = make_config(name, config.get(name), root)
        if getattr(cls, "accepts_worker_view", False):
            detectors.append(cls(cfg, worker_view=worker_view))  # type: ignore[call-arg]
        else:
            detectors.append(cls(cfg))
    return detectors
