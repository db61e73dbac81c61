"""A worker restarted after an upgrade talks to the node agent's checkpoint service of the older trainguard its
launcher started with: that service reads a persist request's manifest only as the decoded object, so every
persist failed once workers sent the manifest's own JSON text. The service announces what it reads beyond that
in its welcome, and a worker sends an older one the object. Real unix sockets; the older service is a stand-in
that answers the first protocol's welcome and records what it gets."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manifest import Manifest, plan_layout
from trainguard.checkpoint.persist import _manifest_from
from trainguard.checkpoint.service import ServiceChannel


class StandInService:
    """Accepts one worker, answers its hello with ``welcome``, and keeps every request after it."""

    def __init__(self, path: Path, welcome: dict) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.welcome = welcome
        self.requests: list[dict] = []
        self.got = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                msg = json.loads(line)
                if msg["op"] == "hello":
                    conn.sendall((json.dumps(self.welcome) + "\n").encode())
                else:
                    self.requests.append(msg)
                    self.got.set()

    def close(self) -> None:
        self.listener.close()


def _manifest() -> Manifest:
    entries, total = plan_layout([("w", "float32", (3, 2)), ("s", "int64", ())], 4096)
    return Manifest(job="j", step=7, rank=0, world_size=1, tensors=entries, data_bytes=total, chunks=[],
                    tree={"t": "dict", "k": ["w", "s"], "v": [{"t": "tensor", "i": 0}, {"t": "tensor", "i": 1}]})


def _sent_manifest(tmp_path: Path, welcome: dict):
    path = tmp_path / "svc.sock"
    service = StandInService(path, welcome)
    config = CheckpointConfig(directory=str(tmp_path))
    chan = ServiceChannel.connect_or_spawn(str(path), config, "j", 0, lambda msg: None)
    try:
        chan.submit({"op": "persist", "id": 1, "step": 7, "manifest": _manifest().to_json().decode()})
        assert service.got.wait(10), "the request never arrived"
        assert chan.alive(), "the channel's reader died on the welcome"  # its outcomes would never arrive
        return service.requests[0]["manifest"]
    finally:
        chan.close()
        service.close()


def test_an_older_service_gets_the_manifest_it_reads(tmp_path: Path) -> None:
    sent = _sent_manifest(tmp_path, {"op": "welcome", "pid": 1})  # the first protocol's welcome
    assert isinstance(sent, dict), type(sent)
    assert _manifest_from(sent) == _manifest()  # what the older service's reader builds from it


def test_a_welcome_with_features_of_another_shape_is_taken_for_an_older_service(tmp_path: Path) -> None:
    # not a list (a later service's object, a number): the reader thread must not die on it
    assert isinstance(_sent_manifest(tmp_path, {"op": "welcome", "pid": 1, "features": 7}), dict)


def test_a_service_that_reads_the_text_gets_the_text(tmp_path: Path) -> None:
    sent = _sent_manifest(tmp_path, {"op": "welcome", "pid": 1, "features": ["manifest_text"]})
    assert sent == _manifest().to_json().decode()


def test_this_versions_service_announces_that_it_reads_the_text(tmp_path: Path) -> None:
    config = CheckpointConfig(directory=str(tmp_path))
    chan = ServiceChannel.connect_or_spawn(None, config, "j", 0, lambda msg: None)  # a private service
    try:
        assert chan._speaks("manifest_text"), chan.features  # else every save would pay the decode again
    finally:
        chan.close()
