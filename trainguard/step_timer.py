"""Per-step section timing for the training hook (``with session.section("forward"): ...``).

A :class:`StepTimer` sums the time of each named section over one step; :meth:`StepTimer.collect` hands the
sums out at ``step_done`` and starts the next step. It costs two ``perf_counter`` calls and a dict update per
section on CPU (``bench/bench_failslow.py`` measures it against the step time).

Where CUDA is initialised the GPU runs asynchronously to the host, so host timestamps would measure kernel
launches, not work. There a section records a pair of CUDA events on the current stream instead and
:meth:`collect` reads the pairs whose end event has completed (``Event.query()``: no device synchronisation);
a pair still in flight is read at a later step. The sums then are GPU time.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque
from typing import Any

from trainguard.errors import TrainguardError

#: Names the coordinator understands specially: ``comm`` is time waiting for peers; the rest is own work.
KNOWN_SECTIONS = ("data", "forward", "backward", "optim", "comm")
#: Section that holds the time a rank waits in collectives.
WAIT_SECTION = "comm"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,32}\Z")
_MAX_SECTIONS = 16
_MAX_PENDING_EVENTS = 256


def _cuda_module() -> Any | None:
    """``torch.cuda`` when torch is imported and CUDA is initialised in this process, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        return cuda if cuda.is_available() and cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a broken CUDA install must not break the training loop
        return None


class Section:
    """Context manager timing one named section; reusable, one instance per name."""

    __slots__ = ("_name", "_timer", "_t0", "_start_ev")

    def __init__(self, name: str, timer: "StepTimer") -> None:
        self._name = name
        self._timer = timer
        self._t0 = 0.0
        self._start_ev: Any = None

    def __enter__(self) -> "Section":
        cuda = self._timer.cuda
        if cuda is not None:
            self._start_ev = self._timer.event(cuda)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._t0
        timer = self._timer
        if self._start_ev is not None and timer.cuda is not None:
            end = timer.event(timer.cuda)
            timer.pending.append((self._name, self._start_ev, end))
            self._start_ev = None
            return
        totals = timer.totals
        totals[self._name] = totals.get(self._name, 0.0) + elapsed


class StepTimer:
    """Sums section times per step.

    Args:
        use_cuda: True/False forces CUDA events on/off; None (default) uses them when CUDA is initialised at
            the first section.
    """

    def __init__(self, use_cuda: bool | None = None) -> None:
        self._use_cuda = use_cuda
        self._sections: dict[str, Section] = {}
        self._cuda_checked = use_cuda is False
        self.cuda: Any | None = None
        self.totals: dict[str, float] = {}
        self.pending: deque[tuple[str, Any, Any]] = deque()
        self._free_events: list[Any] = []

    def section(self, name: str) -> Section:
        """The context manager for ``name`` (created once).

        Raises:
            TrainguardError: the name is not 1-32 of ``[A-Za-z0-9_.-]``, or more than 16 names are used.
        """
        sec = self._sections.get(name)
        if sec is not None:
            return sec
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise TrainguardError(f"section name {name!r} is invalid: use 1-32 of [A-Za-z0-9_.-], e.g. one of "
                                  f"{', '.join(KNOWN_SECTIONS)}")
        if len(self._sections) >= _MAX_SECTIONS:
            raise TrainguardError(f"section {name!r}: at most {_MAX_SECTIONS} section names per worker "
                                  f"(have {', '.join(sorted(self._sections))})")
        if not self._cuda_checked:
            self._cuda_checked = True
            cuda = _cuda_module()
            if cuda is None and self._use_cuda:
                raise TrainguardError("StepTimer(use_cuda=True): CUDA is not initialised in this process")
            self.cuda = cuda
        sec = Section(name, self)
        self._sections[name] = sec
        return sec

    def event(self, cuda: Any) -> Any:
        """A recorded CUDA timing event on the current stream (reused from completed pairs when possible)."""
        ev = self._free_events.pop() if self._free_events else cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def collect(self) -> dict[str, float]:
        """The section sums of the step just completed, seconds; resets them for the next step.

        With CUDA events, pairs whose end has not completed yet stay pending and count in a later step.
        """
        if self.pending:
            self._drain_events()
        out, self.totals = self.totals, {}
        return out

    def _drain_events(self) -> None:
        totals = self.totals
        while self.pending:
            name, start, end = self.pending[0]
            if not end.query():
                break  # events complete in stream order: later ones are in flight too
            self.pending.popleft()
            totals[name] = totals.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._free_events += (start, end)
        while len(self.pending) > _MAX_PENDING_EVENTS:  # a stream that never completes: keep memory bounded
            self.pending.popleft()
