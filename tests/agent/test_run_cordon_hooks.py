"""`trainguard run --cordon-command`: the embedded coordinator's scheduler hook follows cordons and uncordons."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from trainguard.agent.run_deploy import cordon_hooks_for
from trainguard.recovery.cordon import CordonTarget


class _Watch:
    """The two listener lists of :class:`~trainguard.recovery.observe.CoordinatorWatch` (its own thread fires
    them on a cordon and on a return to service)."""

    def __init__(self) -> None:
        self.cordon: list = []
        self.back: list = []

    def add_cordon_listener(self, fn) -> None:
        self.cordon.append(fn)

    def add_uncordon_listener(self, fn) -> None:
        self.back.append(fn)


class _Coordinator:
    def __init__(self) -> None:
        self.watch = _Watch()


def _lines(path: Path, n: int) -> list[str]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.02)
    return path.read_text().split() if path.exists() else []


def test_a_node_cordoned_again_after_an_uncordon_runs_the_hook_again(tmp_path: Path) -> None:
    out = tmp_path / "marks"
    script = f"import sys; open({str(out)!r}, 'a').write('drain:' + sys.argv[1] + '\\n')"
    template = shlex.join([sys.executable, "-c", script]) + " {node}"
    coord = _Coordinator()
    dispatcher = cordon_hooks_for(coord, template)
    try:
        target = CordonTarget(node="n1", host="h1", job="j", reason="gpu lost")
        for fn in coord.watch.cordon:
            fn(target)
        assert _lines(out, 1) == ["drain:n1"]
        for fn in coord.watch.back:  # `trainguard uncordon n1` (the operator resumed it in the scheduler too)
            fn("n1")
        for fn in coord.watch.cordon:  # it fails again: the scheduler must hear of it again
            fn(target)
        assert _lines(out, 2) == ["drain:n1", "drain:n1"]
    finally:
        dispatcher.stop()
