"""Whether a port can be listened on, asked as the gRPC servers listen: a port whose earlier server closed its
connections first (TIME_WAIT on the server's side) is free; one another socket listens on is not. Real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from trainguard.ports import can_listen


def _server_side_time_wait() -> int:
    """A port whose listener accepted a connection and closed it first, then stopped: TIME_WAIT on its side."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = srv.accept()
    accepted.close()  # the server closes first: its end of the connection waits in TIME_WAIT
    time.sleep(0.1)
    client.close()
    srv.close()
    time.sleep(0.1)
    return port


def test_a_port_in_time_wait_after_its_server_stopped_can_be_listened_on() -> None:
    # Taken for a port in use, the node on a c10d endpoint's host joined a coordinator nobody ran (relaunched
    # within a minute of a coordinator stopped while nodes were connected).
    port = _server_side_time_wait()
    try:
        states = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        pytest.skip("no ss here to see the TIME_WAIT entry")
    if "TIME-WAIT" not in states:
        pytest.skip("the kernel kept no TIME_WAIT entry for the closed connection")
    from trainguard.agent.run_torchrun import port_free

    assert can_listen("127.0.0.1", port)
    assert port_free(f"127.0.0.1:{port}")  # what the launcher asks before embedding the coordinator


def test_a_port_another_socket_listens_on_cannot() -> None:
    with socket.socket() as other:  # without SO_REUSEADDR, as most programs
        other.bind(("127.0.0.1", 0))
        other.listen()
        assert not can_listen("127.0.0.1", other.getsockname()[1])
    with socket.socket() as other:  # with it, as gRPC
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        assert not can_listen("127.0.0.1", other.getsockname()[1])
        assert not can_listen("0.0.0.0", other.getsockname()[1])


def test_port_zero_an_unresolvable_host_and_a_foreign_address_are_left_to_the_server() -> None:
    assert can_listen("127.0.0.1", 0)
    assert can_listen("no-such-host.invalid", 29400)
    assert can_listen("192.0.2.1", 29400)  # TEST-NET-1, on no host: "not local" is the server's to say


def test_a_coordinator_on_a_taken_port_says_so_without_grpcs_own_log_line(tmp_path) -> None:
    # The trainguard line was preceded by gRPC's "E1204 ... add_port.cc:83] Failed to add port to server".
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "jt", "--listen",
                              f"127.0.0.1:{port}", "--nnodes", "1", "--store", f"sqlite://{tmp_path}/c.db"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "add_port" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"trainguard: error: cannot start the coordinator: cannot listen on 127.0.0.1:{port}: address in use "
        "(another coordinator, or another program); pick another --listen address"), out.stderr
