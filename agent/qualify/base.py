"""The check contract: a named check reads the node once and says pass, fail or skip, within a deadline.

Checks register by name (:func:`register_check`); ``[qualify] checks`` picks them. A check gets the
:class:`QualifyContext` (where to read, what the node runs) and an absolute deadline (``time.monotonic()``) it
should respect on its own; the runner (:mod:`~trainguard.agent.qualify.runner`) also stops waiting for it then.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.agent.qualify.config import QualifySection
from trainguard.agent.qualify.verdict import CheckStatus


@dataclass(frozen=True)
class QualifyContext:
    """What a check needs to know about the node besides ``[qualify]``.

    Attributes:
        node_id: the node checked (for the verdict).
        config: the validated ``[qualify]`` settings.
        detector_names: the node's configured detectors (the ``detectors`` check runs them once).
        detector_settings: detector name -> its fields (as ``create_detectors`` takes them).
        detector_root: overrides every detector's root (the daemon's ``detectors.root``); None keeps each one's.
        checkpoint_dir: the job's local checkpoint directory, where the disk test writes unless ``disk_dir`` says
            otherwise; None when unknown or remote.
        peer_source: asks the coordinator for qualified peers (:mod:`~.peers`); None outside registration.
    """

    node_id: str
    config: QualifySection
    detector_names: tuple[str, ...] = ()
    detector_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    detector_root: str | None = None
    checkpoint_dir: str | None = None
    peer_source: Callable[[int], Any] | None = None

    @property
    def sys_root(self) -> str:
        """Prefix of the /sys files of the pcie and rdma checks: ``qualify.root``, else the detectors' root."""
        if self.config.root:
            return self.config.root
        if self.detector_root:
            return self.detector_root
        roots = {str(f.get("root")) for f in self.detector_settings.values() if f.get("root")}
        return roots.pop() if len(roots) == 1 else "/"

    def under(self, root: str, path: str) -> str:
        """``path`` (absolute) under ``root``."""
        return os.path.join(root, path.lstrip("/"))


@dataclass(frozen=True)
class Outcome:
    """What a check returns (the runner adds its name and duration); ``measured_s`` is a time the check measured
    that the coordinator keeps (the peer exchange's), 0 when none."""

    status: CheckStatus
    detail: str
    measured_s: float = 0.0


class Check(Protocol):
    """One pre-flight check."""

    name: str

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Checks the node once.

        Args:
            ctx: the node and the settings.
            deadline: ``time.monotonic()`` by which the check should be done.

        Returns:
            Pass, fail (with the reason) or skip (with why there was nothing to check).
        """


_REGISTRY: dict[str, Callable[[], Check]] = {}


def register_check(name: str) -> Callable[[Callable[[], Check]], Callable[[], Check]]:
    """Class decorator: makes a check available to ``[qualify] checks`` under ``name``."""

    def add(factory: Callable[[], Check]) -> Callable[[], Check]:
        _REGISTRY[name] = factory
        return factory

    return add


def make_check(name: str) -> Check:
    """A new check by name (the built-in ones are imported on first use).

    Raises:
        KeyError: no check of that name (config validation refuses unknown names first).
    """
    # imported for their registrations: links (pcie, nic, rdma), local (detectors, disk), peers (peers)
    for module in ("links", "local", "peers"):
        importlib.import_module(f"trainguard.agent.qualify.{module}")

    return _REGISTRY[name]()


def passed(detail: str, measured_s: float = 0.0) -> Outcome:
    """A passing outcome."""
    return Outcome(CheckStatus.PASS, detail, measured_s)


def failed(detail: str, measured_s: float = 0.0) -> Outcome:
    """A failing outcome."""
    return Outcome(CheckStatus.FAIL, detail, measured_s)


def skipped(detail: str) -> Outcome:
    """Nothing to check here (no such hardware, or not configured)."""
    return Outcome(CheckStatus.SKIP, detail)


__all__ = ["Check", "Outcome", "QualifyContext", "failed", "make_check", "passed", "register_check", "skipped"]
