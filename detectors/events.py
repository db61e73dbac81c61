"""Typed health events: the one currency between detectors, predictor, agent and coordinator.

A detector turns raw signals into :class:`HealthEvent` values. The enums mirror ``trainguard.v1.Severity`` and
``trainguard.v1.Action`` number for number, so conversion to and from the wire is a cast.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.text import printable, transmittable


class Severity(enum.IntEnum):
    """How bad an event is; larger is worse (values equal ``trainguard.v1.Severity``)."""

    INFO = 1
    WARNING = 2
    ERROR = 3
    CRITICAL = 4

    @classmethod
    def parse(cls, text: str) -> "Severity":
        """Parses a name such as ``"warning"`` (case-insensitive).

        Raises:
            ValueError: not a severity name.
        """
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r}; expected one of {[m.name.lower() for m in cls]}") from None


class Action(enum.IntEnum):
    """Recommended reaction, ordered by cost (values equal ``trainguard.v1.Action``)."""

    NONE = 1
    WATCH = 2
    CHECKPOINT_NOW = 3
    RESTART_PROCESS = 4
    DRAIN_NODE = 5
    RESTART_JOB = 6

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parses a name such as ``"drain-node"`` or ``"DRAIN_NODE"``.

        Raises:
            ValueError: not an action name.
        """
        try:
            return cls[text.strip().upper().replace("-", "_")]
        except KeyError:
            names = [m.name.lower().replace("_", "-") for m in cls]
            raise ValueError(f"unknown action {text!r}; expected one of {names}") from None


_counter = itertools.count(1)


def _new_event_id() -> str:
    return f"{os.getpid():x}-{int(time.time() * 1000):x}-{next(_counter):x}"


@dataclass(frozen=True)
class HealthEvent:
    """One typed observation of trouble (or of its end) on a node.

    Attributes:
        source: detector name, e.g. ``"roce"``.
        kind: dotted kind, e.g. ``"net.link_down"``.
        severity: how bad it is.
        action: the cheapest reaction the detector believes is enough.
        message: one human-readable line.
        subject: what it is about (interface, PCI address, ``rank:3``...), empty if the whole node.
        evidence: raw values that led to the event, as strings.
        time: Unix time in seconds when it was observed.
        node_id: set by the agent when the event leaves the node.
        event_id: unique per process; used to de-duplicate.
    """

    source: str
    kind: str
    severity: Severity
    action: Action
    message: str
    subject: str = ""
    evidence: dict[str, str] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    node_id: str = ""
    event_id: str = field(default_factory=_new_event_id)

    def __post_init__(self) -> None:
        # The message quotes the outside world (a kernel log line, a process or device name): escaped here, once,
        # it stays one line wherever it is printed (logs, status, the coordinator's view of a remote node's
        # events). Source and kind are printable names (escaping leaves them as they are) unless a remote peer
        # sent garbage. The subject is an identifier (an interface name may hold ESC) and kept as sent; printers
        # escape it; only its lone surrogates (a name whose bytes are no UTF-8) are escaped here, as no message
        # could carry them.
        for name in ("source", "kind", "message"):
            object.__setattr__(self, name, printable(getattr(self, name)))
        object.__setattr__(self, "subject", transmittable(self.subject))

    def with_node(self, node_id: str) -> "HealthEvent":
        """Returns a copy stamped with ``node_id``."""
        return HealthEvent(**{**self.__dict__, "node_id": node_id})

    def to_proto(self) -> Any:
        """Converts to a ``trainguard.v1.HealthEvent`` message."""
        from trainguard.proto import common_pb2

        msg = common_pb2.HealthEvent(
            event_id=self.event_id,
            node_id=self.node_id,
            source=self.source,
            kind=self.kind,
            severity=int(self.severity),
            action=int(self.action),
            subject=self.subject,
            message=self.message,
            evidence={transmittable(str(k)): transmittable(str(v)) for k, v in self.evidence.items()},
        )
        msg.time.FromNanoseconds(int(self.time * 1e9))
        return msg

    @classmethod
    def from_proto(cls, msg: Any) -> "HealthEvent":
        """Builds an event from a ``trainguard.v1.HealthEvent`` message.

        Raises:
            ValueError: severity or action is unspecified or out of range.
        """
        try:
            severity = Severity(msg.severity)
            action = Action(msg.action)
        except ValueError as exc:
            raise ValueError(f"health event {msg.kind!r} has an invalid severity or action: {exc}") from exc
        return cls(
            source=msg.source,
            kind=msg.kind,
            severity=severity,
            action=action,
            message=msg.message,
            subject=msg.subject,
            evidence=dict(msg.evidence),
            time=msg.time.ToNanoseconds() / 1e9,
            node_id=msg.node_id,
            event_id=msg.event_id,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as lower-case names)."""
        d = dict(self.__dict__)
        d["severity"] = self.severity.name.lower()
        d["action"] = self.action.name.lower().replace("_", "-")
        return d
