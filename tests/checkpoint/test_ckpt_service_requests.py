"""The persist process's socket against requests no worker sends (fuzzing review): valid JSON that is not an
object, a line that never ends, and the old ``release_job`` op, which deleted any folder a request named."""

from __future__ import annotations

import json
import logging
import socket
import threading
from pathlib import Path

import pytest

from trainguard.checkpoint import service
from trainguard.checkpoint.service import PersistServer


@pytest.fixture
def server(tmp_path: Path):
    srv = PersistServer(str(tmp_path / "ckpt.sock"))
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    for _ in range(200):
        if (tmp_path / "ckpt.sock").exists():
            break
        threading.Event().wait(0.01)
    yield srv, str(tmp_path / "ckpt.sock")
    srv.stopping.set()
    thread.join(10)


def _talk(path: str, payload: bytes) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_json_that_is_no_object_is_answered_and_the_connection_goes_on(server, caplog) -> None:
    _, path = server
    with caplog.at_level(logging.WARNING):
        replies = _talk(path, b'[]\n42\n"x"\n{"op": "ping"}\n')
    assert [r["op"] for r in replies] == ["error", "error", "error", "pong"]
    assert replies[0]["error"] == "a request is a JSON object, not list"
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_release_job_deletes_nothing(server, tmp_path: Path) -> None:
    _, path = server
    victim = tmp_path / "victim" / "jobx"
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("mine")
    request = {"op": "release_job", "shm_dir": str(tmp_path / "victim"), "job": "jobx"}
    replies = _talk(path, (json.dumps(request) + "\n").encode())
    assert replies == [{"op": "error", "error": "unknown op 'release_job'"}]
    assert (victim / "keep.txt").read_text() == "mine"


def test_a_line_past_the_bound_drops_that_client_and_the_service_serves_on(server, monkeypatch, caplog) -> None:
    monkeypatch.setattr(service, "MAX_REQUEST_BYTES", 1 << 20)
    _, path = server
    with caplog.at_level(logging.WARNING):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
            with pytest.raises(OSError):  # the service closes its end: the send or the read after it fails
                for _ in range(64):
                    sock.sendall(b"a" * (64 << 10))
                if not sock.recv(1):
                    raise ConnectionResetError("closed")
    assert any("over 1 MiB without a newline" in r.getMessage() for r in caplog.records)
    assert _talk(path, b'{"op": "ping"}\n')[0]["op"] == "pong"


def test_many_requests_in_one_chunk_and_one_request_over_many(server) -> None:
    _, path = server
    assert [r["op"] for r in _talk(path, b'{"op": "ping"}\n' * 50)] == ["pong"] * 50
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        for byte in b'{"op": "ping"}\n{"op": "pi':
            sock.sendall(bytes([byte]))
        sock.sendall(b'ng"}\n')
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    assert [json.loads(line)["op"] for line in data.splitlines()] == ["pong", "pong"]


def test_json_nested_too_deep_drops_that_client_without_a_traceback(server, caplog) -> None:
    _, path = server
    with caplog.at_level(logging.WARNING):
        assert _talk(path, b"[" * 200_000 + b"\n") == []
    assert any("client connection dropped" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.exc_info]
    assert _talk(path, b'{"op": "ping"}\n')[0]["op"] == "pong"
