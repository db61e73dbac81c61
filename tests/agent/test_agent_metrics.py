"""/metrics: naming conventions, bounded labels, and a real Prometheus server scraping and answering a query."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tg_testutil
from trainguard.agent.metrics import MAX_EVENT_KINDS, AgentMetrics, MetricsServer


@pytest.fixture
def served():
    metrics = AgentMetrics("node-a")
    server = MetricsServer(metrics, "127.0.0.1:0")
    yield metrics, server
    server.close()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def test_names_follow_prometheus_conventions(served):
    metrics, server = served
    metrics.set_detector_states({"roce": "ok", "gpu": "no_hardware"})
    metrics.count_event("roce", "net.link_down", "critical")
    metrics.count_worker_restart()
    metrics.observe_checkpoint("disk", 3 << 20, 0.2, 1.5, step=40)
    metrics.observe_request("GetHealth", "OK", 0.001)
    families = {f.name: f for f in text_string_to_metric_families(scrape(server.url))}
    for name, family in families.items():
        assert name.startswith("trainguard_"), name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
        if family.type in ("histogram", "gauge") and ("seconds" in name or "bytes" in name):
            assert name.endswith(("_seconds", "_bytes")), name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("trainguard_detector_state", (("detector", "roce"), ("state", "ok")))] == 1
    assert samples[("trainguard_detector_state", (("detector", "roce"), ("state", "failed")))] == 0
    assert samples[("trainguard_health_events_total",
                    (("kind", "net.link_down"), ("severity", "critical"), ("source", "roce")))] == 1
    assert samples[("trainguard_worker_restarts_total", ())] == 1
    assert samples[("trainguard_checkpoint_last_step", ())] == 40
    assert samples[("trainguard_checkpoint_size_bytes_sum", (("tier", "disk"),))] == 3 << 20


def test_event_kind_label_is_bounded(served):
    metrics, server = served
    for i in range(MAX_EVENT_KINDS + 50):
        metrics.count_event("buggy", f"kind.{i}", "info")
    families = {f.name: f for f in text_string_to_metric_families(scrape(server.url))}
    kinds = {s.labels["kind"] for s in families["trainguard_health_events"].samples if s.name.endswith("_total")}
    assert len(kinds) == MAX_EVENT_KINDS + 1 and "other" in kinds


def free_port() -> int:
    return tg_testutil.free_port()


def test_real_prometheus_scrapes_and_answers_a_query(served, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("the Prometheus server is not installed (Debian package prometheus: apt-get install prometheus)")
    metrics, server = served
    for _ in range(3):
        metrics.count_worker_restart()
    metrics.set_predictor(0.25, 0.5)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: trainguard\n    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"),
    )
    try:
        query = urllib.parse.urlencode({"query": "trainguard_worker_restarts_total"})
        deadline = time.monotonic() + 60
        result = []
        while time.monotonic() < deadline and not result:
            time.sleep(0.5)
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=2) as resp:
                    body = json.load(resp)
            except OSError:
                continue  # not listening yet
            assert body["status"] == "success"
            result = body["data"]["result"]
        assert result, "Prometheus never returned trainguard_worker_restarts_total"
        assert result[0]["metric"]["job"] == "trainguard"
        assert float(result[0]["value"][1]) == 3.0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5) as resp:
            (target,) = json.load(resp)["data"]["activeTargets"]
        assert target["health"] == "up", target
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_failslow_gauges_show_the_coordinators_findings_for_this_node(served):
    from trainguard.agent.metrics import failslow_families
    from trainguard.proto import common_pb2

    metrics, server = served
    st = common_pb2.FailSlowStatus(job_step_s=0.3, job_slowdown=4.5)
    st.slow.add(rank=3, node_id="node-a", ratio=2.5, basis="wait")
    st.slow.add(rank=7, node_id="node-b", ratio=3.5, basis="wait")
    st.slow.add(rank=-1, node_id="node-a", ratio=80.0, basis="link")
    metrics.set_failslow(st.slow, st.job_slowdown, st.job_step_s, "node-a")
    text = scrape(server.url)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("trainguard_failslow_slow_ranks", (("scope", "job"),))] == 2
    assert samples[("trainguard_failslow_slow_ranks", (("scope", "node"),))] == 1
    assert samples[("trainguard_failslow_worst_ratio", (("scope", "job"),))] == 3.5
    assert samples[("trainguard_failslow_worst_ratio", (("scope", "node"),))] == 2.5
    assert samples[("trainguard_failslow_node_slow", (("basis", "link"),))] == 1
    assert samples[("trainguard_failslow_node_slow", (("basis", "wait"),))] == 1
    assert samples[("trainguard_failslow_node_slow", (("basis", "compute"),))] == 0
    assert samples[("trainguard_failslow_job_slowdown", ())] == 4.5
    # Cleared findings go back to zero (the gauges never keep a stale straggler).
    metrics.set_failslow([], 1.0, 0.1, "node-a")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(scrape(server.url)) for s in f.samples}
    assert samples[("trainguard_failslow_slow_ranks", (("scope", "job"),))] == 0
    assert samples[("trainguard_failslow_node_slow", (("basis", "link"),))] == 0
    # The scrape-time families of `trainguard run` carry the same values.
    fams = {f.name: f for f in failslow_families(st, "node-b")}
    assert {tuple(s.labels.items()): s.value for s in fams["trainguard_failslow_slow_ranks"].samples} == \
        {(("scope", "job"),): 2, (("scope", "node"),): 1}
    assert fams["trainguard_failslow_job_step_seconds"].samples[0].value == 0.3


def test_the_predictor_threshold_is_nan_until_the_first_score(served):
    """It read 0 until the first score, so an alert rule "score >= threshold" fired on 0 >= 0 at every start."""
    import math

    metrics, server = served
    value = {s.name: s.value for f in text_string_to_metric_families(scrape(server.url)) for s in f.samples}
    assert math.isnan(value["trainguard_predictor_threshold"])
    metrics.set_predictor(0.1, 0.7)
    value = {s.name: s.value for f in text_string_to_metric_families(scrape(server.url)) for s in f.samples}
    assert value["trainguard_predictor_threshold"] == 0.7 and value["trainguard_predictor_score"] == 0.1


def _reset_connection(port: int, payload: bytes) -> None:
    """Connects, sends ``payload``, and aborts with a TCP reset (SO_LINGER 0), as port scanners, load balancers'
    TCP checks and a scraper giving up on its timeout do."""
    import struct

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if payload:
            s.sendall(payload)
        time.sleep(0.05)  # the server's handler is reading by now
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_clients_resetting_the_metrics_connection_leave_the_json_log_one_object_per_line(tmp_path, tg_env):
    """A client that resets its connection (a TCP probe, an aborted scrape, a request line too long) made the HTTP
    server print a 15-line traceback to stderr, around the log format: `--log-format json` was no longer one JSON
    object per line, and journald got one entry per traceback line. Real daemon, real sockets."""
    import os
    import re
    import signal
    import sys

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f"""
[agent]
node_id = "metrics-n1"
[log]
format = "json"
[grpc]
listen = ""
[metrics]
listen = "127.0.0.1:0"
[detectors]
enabled = ["disk"]
root = "{tmp_path / 'fake'}"
[predictor]
enabled = false
[memory_tier]
root = "{tmp_path / 'shm'}"
""")
    err = tmp_path / "agent.log"
    env = {k: v for k, v in tg_env.items() if not k.startswith(("TRAINGUARD_", "NOTIFY_", "WATCHDOG_"))}
    with open(err, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "agent", "--config", str(config), "--socket",
                                 str(tmp_path / "run" / "agent.sock"), "--state-dir", str(tmp_path / "state")],
                                env=env, stdout=subprocess.DEVNULL, stderr=fh)
    try:
        deadline = time.monotonic() + 60
        while not re.search(r"metrics on http://127\.0\.0\.1:(\d+)", err.read_text()) or "agent ready" not in \
                err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)", err.read_text()).group(1))
        for payload in (b"", b"GET /metrics HTTP/1.1\r\n", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"):
            _reset_connection(port, payload)
        # Still serving, and a scrape after the resets is whole.
        assert "trainguard_agent_info" in scrape(f"http://127.0.0.1:{port}/metrics")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    assert lines
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON log line: {line!r}\n" + "\n".join(lines[:40]) + os.linesep)


def test_a_taken_metrics_port_names_the_setting_that_picks_another(tmp_path) -> None:
    """A second agent with the same config failed on "metrics.listen: cannot listen on ... (Address already in
    use)", without saying it may be another agent nor where the setting lives (metrics.listen has no flag)."""
    import socket

    import pytest

    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.config import AgentConfigError
    from trainguard.agent.sdnotify import SystemdNotifier

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = f"127.0.0.1:{holder.getsockname()[1]}"
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path}"\n[metrics]\nlisten = "{taken}"\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    daemon = AgentDaemon(config_loader(str(config), "", str(tmp_path / "a.sock"), str(tmp_path / "st")),
                         SystemdNotifier(None))
    try:
        with pytest.raises(AgentConfigError) as err:
            daemon.start()
        with pytest.raises(AgentConfigError) as flag_err:  # the launcher's and coordinator's flag
            MetricsServer(AgentMetrics("node-a"), taken, setting="--metrics-listen")
    finally:
        daemon.release_locks()
        holder.close()
    message = str(err.value)
    assert message.startswith(f"metrics.listen: cannot listen on {taken} (Address already in use)"), message
    assert "another agent" in message and "$TRAINGUARD_AGENT_METRICS_LISTEN" in message, message
    assert str(flag_err.value).startswith(f"--metrics-listen: cannot listen on {taken}"), str(flag_err.value)
    assert str(flag_err.value).endswith("pick a free port with --metrics-listen"), str(flag_err.value)
