"""The MASTER_PORT a node offers stays held until the generation's store has it: nothing else on the host gets
it in between (the store bound it ~2 s after the coordinator named it, and a port found free then closed could
be taken meanwhile: the job failed with EADDRINUSE)."""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tg_testutil import EXAMPLE, REPO

from trainguard.agent.errors import AgentError
from trainguard.agent.port_offer import MasterPortOffer


def _plain_bind(port: int) -> bool:
    """Whether a bind without SO_REUSEADDR (what a process given that port by chance would hold) succeeds."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
            return False


def test_the_offered_port_is_held_until_a_later_generation_and_stores_still_bind_it() -> None:
    import torch.distributed as dist

    offer = MasterPortOffer("127.0.0.1")
    try:
        port = offer.port()
        assert offer.port() == port  # every heartbeat offers the same port until a generation takes it
        assert not _plain_bind(port)
        for _ in range(300):  # the kernel gives a held port to no bind(0)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] != port
        # The generation's store (torch's TCPStore, either backend) binds the held port as if it were free.
        for libuv in (True, False):
            store = dist.TCPStore("0.0.0.0", port, world_size=None, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=10), use_libuv=libuv)
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                                   use_libuv=libuv)
            client.set("k", "v")
            assert store.get("k") == b"v"
            del client, store
        offer.seen(3, port)  # generation 3's table names it: held for that generation, a new one offered
        second = offer.port()
        assert second != port and not _plain_bind(port) and not _plain_bind(second)
        offer.seen(3, 0)  # the same generation again (a repeated START): nothing changes
        assert not _plain_bind(port)
        offer.seen(4, 1)  # a later generation on another node's port: generation 3's port goes
        assert _plain_bind(port) and not _plain_bind(second) and offer.port() == second
    finally:
        offer.close()
    assert _plain_bind(second)


def test_an_address_not_of_this_host_is_a_configuration_error() -> None:
    with pytest.raises(AgentError, match="--local-addr"):
        MasterPortOffer("192.0.2.1").port()


def test_a_process_binding_the_master_port_after_the_generation_formed_does_not_fail_the_job(
        tmp_path: Path, tg_env: dict) -> None:
    """Plays the rest of the host: the moment the coordinator names the generation's MASTER_PORT, something
    binds it. Before, the bind got the port (free until the store's bind, after torch's import; a process that
    kept it failed the job: "restart budget exhausted after 0 restarts"); now the bind is refused and the job
    succeeds."""
    env = dict(tg_env, TRAINGUARD_CHECKPOINT_SHM_DIR=str(tmp_path / "shm"))
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--no-standby", "--job", f"port-offer-{tmp_path.name}", str(EXAMPLE), "--steps", "3",
           "--save-every", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    grabbed: list[bool] = []
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"generation 1 formed: .* master [\d.]+:(\d+)", line)
            if m and not grabbed:
                grabbed.append(_plain_bind(int(m.group(1))))
        assert proc.wait(timeout=120) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert grabbed == [False], "".join(lines)[-3000:]
