"""A real `trainguard run` as an operator sees it: JSON logs (--log-format json), Prometheus /metrics, gRPC
health, `trainguard status` finding the run without flags, `status --watch | head` ending without a traceback,
and nothing left behind after SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainguard.agent.job_registry import DAEMON_SOCKET

SCRIPTS = Path(__file__).parent / "scripts"


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # every log line must be one JSON object
    return out


def _wait(pred, timeout: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.skipif(os.path.exists(DAEMON_SOCKET), reason=f"a node agent daemon serves {DAEMON_SOCKET} here")
def test_metrics_health_status_json_logs_and_closed_pipe(tmp_path, tg_env) -> None:
    env = {k: v for k, v in tg_env.items() if k not in ("TRAINGUARD_AGENT_SOCKET_PATH", "TRAINGUARD_AGENT_SOCKET")}
    env["TRAINGUARD_RUN_REGISTRY"] = str(tmp_path / "runs")
    log = tmp_path / "run.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "run", "--log-format", "json", "--no-standby", "--job", "obs",
             "--metrics-listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0", str(SCRIPTS / "sleeper.py")],
            env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        msgs = _wait(lambda: [r["msg"] for r in _records(log)] if "started ranks" in log.read_text() else None,
                     what="the first generation")
        url = next(re.search(r"metrics on (\S+)", m).group(1) for m in msgs if m.startswith("metrics on"))
        port = next(int(re.search(r"port (\d+)", m).group(1)) for m in msgs if m.startswith("grpc.health.v1"))

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode()

        def running() -> str | None:
            t = scrape()
            return t if 'trainguard_run_workers{state="running"} 1.0' in t else None

        text = _wait(running, what="a running worker in /metrics")
        assert "trainguard_run_generation 1.0" in text and "trainguard_run_faults_total 0.0" in text
        assert 'trainguard_run_info{job="obs"' in text
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for service in ("", "trainguard.run"):
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

        status = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert int(doc["generation"]) == 1 and len(doc["workers"]) == 1, doc
        # Every field is there, zero values too (rank 0), and 64-bit integers are JSON numbers, not strings.
        worker = doc["workers"][0]
        assert worker["rank"] == 0 and worker["local_rank"] == 0 and worker["exit_code"] == 0, worker
        assert type(worker["step"]) is int and type(doc["generation"]) is int, doc

        piped = subprocess.run(
            ["bash", "-c", f"{sys.executable} -m trainguard.cli status --json --watch 0.2 2>{tmp_path}/err | head -n 1;"
                           " echo ${PIPESTATUS[0]}"], env=env, capture_output=True, text=True, timeout=60)
        lines = piped.stdout.splitlines()
        assert int(json.loads(lines[0])["generation"]) == 1 and lines[-1] == "141"
        assert "Traceback" not in (tmp_path / "err").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert os.listdir(tmp_path / "runs") == []  # the status record is removed on exit
    assert all(isinstance(r["msg"], str) for r in _records(log))
