"""`trainguard status` flags that do not fit together are refused before anything is dialled."""

from __future__ import annotations

from trainguard.cli import main


def test_socket_and_target_together_are_refused(tmp_path, capsys) -> None:
    """Black-box review: with both, --socket was dropped without a word and the live socket's agent went unasked
    ("no node agent answers at 127.0.0.1:1")."""
    assert main(["status", "--socket", str(tmp_path / "agent.sock"), "--target", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--socket and --target name two agents" in err and "not both" in err, err
