"""`trainguard run`'s extras: the embedded coordinator's --cordon-command follows cordons and uncordons; the
--metrics-listen/--health-listen ports are checked before either binds."""

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


class _Agent:
    class config:  # noqa: N801 (what start_run_extras reads of NodeAgent.config)
        node_id = "n1"
        job = "j"

    stopping = False


def test_metrics_and_health_on_one_port_and_a_taken_health_port_are_named(capfd) -> None:
    # The second bind failed with gRPC's C++ log line and "--health-listen ...: cannot listen there (in use or not
    # local)", naming neither --metrics-listen nor the cause.
    import argparse
    import socket

    import pytest

    from trainguard.agent.run_deploy import start_run_extras
    from trainguard.errors import UsageError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            other = free.getsockname()[1]
        args = argparse.Namespace(metrics_listen=f"127.0.0.1:{other}", health_listen=f"0.0.0.0:{other}")
        with pytest.raises(UsageError, match=rf"--metrics-listen 127.0.0.1:{other} and --health-listen "
                                             rf"0.0.0.0:{other} are the same port"):
            start_run_extras(args, _Agent(), None)
        args = argparse.Namespace(metrics_listen=None, health_listen=f"127.0.0.1:{port}")
        with pytest.raises(UsageError, match=rf"--health-listen 127.0.0.1:{port}: the port is in use"):
            start_run_extras(args, _Agent(), None)
    assert "add_port" not in capfd.readouterr().err
