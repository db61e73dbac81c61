"""Cordon hooks against a fake Kubernetes API server (a real HTTP server on 127.0.0.1 that applies and records
the PATCH) and a fake command (a script recording its argv); then a real `trainguard coordinator` that cordons
a node fires both, and shows it in /metrics and grpc.health.v1."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainguard.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from trainguard.recovery.cordon import (TAINT_KEY, CommandCordon, CordonConfigError, CordonDispatcher, CordonFailed,
                                        CordonTarget, KubeAccess, KubernetesCordon)

KUBE_TOKEN = "kube-sa-token-123"


class FakeKubeApi:
    """An API server with a few Node objects: GET returns them, a merge PATCH is applied (refused with 409 on a
    stale resourceVersion, 401 without the token); every request is recorded."""

    def __init__(self, nodes: dict[str, dict], conflicts: int = 0) -> None:
        self.nodes = nodes
        self.requests: list[dict] = []
        self.conflicts = conflicts  # how many PATCHes to refuse with 409 first (someone else wrote the node)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _reply(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _node(self) -> str | None:
                m = re.fullmatch(r"/api/v1/nodes/([^/]+)", self.path)
                return m.group(1) if m else None

            def _common(self, method: str) -> tuple[str | None, bytes]:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                api.requests.append({"method": method, "path": self.path, "auth": self.headers.get("Authorization"),
                                     "content_type": self.headers.get("Content-Type"),
                                     "body": json.loads(body) if body else None})
                if self.headers.get("Authorization") != f"Bearer {KUBE_TOKEN}":
                    self._reply(401, {"kind": "Status", "message": "Unauthorized"})
                    return None, body
                name = self._node()
                if name not in api.nodes:
                    self._reply(404, {"kind": "Status", "message": f"nodes {name!r} not found"})
                    return None, body
                return name, body

            def do_GET(self):  # noqa: N802
                name, _ = self._common("GET")
                if name:
                    self._reply(200, api.nodes[name])

            def do_PATCH(self):  # noqa: N802
                name, body = self._common("PATCH")
                if not name:
                    return
                patch = json.loads(body)
                node = api.nodes[name]
                if api.conflicts > 0:
                    api.conflicts -= 1
                    node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                    self._reply(409, {"kind": "Status", "message": "the object has been modified"})
                    return
                if patch.get("metadata", {}).get("resourceVersion") not in (None, node["metadata"]["resourceVersion"]):
                    self._reply(409, {"kind": "Status", "message": "the object has been modified"})
                    return
                node = copy.deepcopy(node)
                node["spec"].update(patch.get("spec", {}))
                node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                api.nodes[name] = node
                self._reply(200, node)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def patches(self) -> list[dict]:
        return [r for r in self.requests if r["method"] == "PATCH"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _node(name: str, taints: list[dict] | None = None) -> dict:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "resourceVersion": "100"},
            "spec": {"taints": taints or []}}


@pytest.fixture
def kube():
    api = FakeKubeApi({"gpu-node-1": _node("gpu-node-1", [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])})
    yield api
    api.close()


TARGET = CordonTarget(node="n1", host="gpu-node-1", job="llm", reason="node fault: AER fatal")


def test_kubernetes_hook_cordons_and_taints_keeping_other_taints(kube) -> None:
    hook = KubernetesCordon(KubeAccess(kube.url, KUBE_TOKEN))
    hook.cordon(TARGET)
    (patch,) = kube.patches()
    assert patch["path"] == "/api/v1/nodes/gpu-node-1" and patch["content_type"] == "application/merge-patch+json"
    assert patch["auth"] == f"Bearer {KUBE_TOKEN}"
    assert patch["body"]["metadata"]["resourceVersion"] == "100"
    node = kube.nodes["gpu-node-1"]
    assert node["spec"]["unschedulable"] is True
    assert {(t["key"], t.get("value"), t["effect"]) for t in node["spec"]["taints"]} == {
        ("nvidia.com/gpu", None, "NoSchedule"), (TAINT_KEY, "llm", "NoSchedule")}
    hook.cordon(TARGET)  # already cordoned and tainted: read, nothing written
    assert len(kube.patches()) == 1


def test_kubernetes_hook_retries_a_conflict_and_reports_refusals(kube) -> None:
    kube.conflicts = 1
    KubernetesCordon(KubeAccess(kube.url, KUBE_TOKEN)).cordon(TARGET)
    assert [r["method"] for r in kube.requests] == ["GET", "PATCH", "GET", "PATCH"]
    assert kube.nodes["gpu-node-1"]["spec"]["unschedulable"] is True
    with pytest.raises(CordonFailed, match="HTTP 404"):
        KubernetesCordon(KubeAccess(kube.url, KUBE_TOKEN)).cordon(CordonTarget("n9", "no-such-node", "llm", "x"))
    with pytest.raises(CordonFailed, match="HTTP 401"):
        KubernetesCordon(KubeAccess(kube.url, "wrong")).cordon(TARGET)


def test_in_cluster_access_reads_the_service_account(tmp_path) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_text("x")
    acc = KubeAccess.resolve(None, None, None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1",
                                                "KUBERNETES_SERVICE_PORT": "443"}, sa_dir=str(tmp_path))
    assert acc == KubeAccess("https://10.0.0.1:443", "sa-token", str(tmp_path / "ca.crt"))
    with pytest.raises(CordonConfigError, match="--kube-api"):
        KubeAccess.resolve(None, None, None, {})


def _fake_command(tmp_path: Path, code: int = 0, name: str = "fake_scontrol") -> tuple[Path, Path]:
    record = tmp_path / f"{name}.argv.jsonl"
    script = tmp_path / f"{name}.py"
    script.write_text("import json, sys\n"
                      f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                      f"sys.stderr.write('scontrol: denied')\nsys.exit({code})\n")
    return script, record


def test_command_hook_runs_without_a_shell_and_records_argv(tmp_path) -> None:
    script, record = _fake_command(tmp_path)
    hook = CommandCordon(f"{sys.executable} {script} update nodename={{host}} state=drain 'reason={{reason}}'")
    hook.cordon(CordonTarget("n1", "gpu07; rm -rf /", "llm", "AER fatal\non bus 3"))
    argv = json.loads(record.read_text().splitlines()[0])
    assert argv == ["update", "nodename=gpu07; rm -rf /", "state=drain", "reason=AER fatal on bus 3"]
    failing, _ = _fake_command(tmp_path, code=3, name="failing")
    with pytest.raises(CordonFailed, match="exited 3: scontrol: denied"):
        CommandCordon(f"{sys.executable} {failing} {{host}}").cordon(TARGET)
    with pytest.raises(CordonConfigError, match="unknown field {hostname}"):
        CommandCordon("scontrol update nodename={hostname}")
    # Found by a user's review: a brace left open raised a ValueError traceback at start-up, and a field with a
    # conversion or a nested spec it cannot take passed the check, to fail only at the first cordon.
    for bad in ("scontrol update nodename={host", "drain {node!z}", "drain {node:{x}}", "drain }"):
        with pytest.raises(CordonConfigError, match=r"--cordon-command: cannot use .*write a field as \{node\}"):
            CommandCordon(bad)
    assert CommandCordon("echo {{literal}} {node}").argv(TARGET) == ["echo", "{literal}", TARGET.node]


def test_dispatcher_runs_each_node_once_and_survives_a_failing_hook(tmp_path) -> None:
    script, record = _fake_command(tmp_path)
    ok = CommandCordon(f"{sys.executable} {script} {{node}}")
    bad = CommandCordon("/nonexistent/scontrol {host}")
    d = CordonDispatcher([bad, ok]).start()
    d.submit(TARGET)
    d.submit(TARGET)  # the same node again: ignored
    d.submit(CordonTarget("n2", "h2", "llm", "x"))
    d.stop()
    assert [json.loads(x) for x in record.read_text().splitlines()] == [["n1"], ["n2"]]
    assert [(h, n, o == "ok") for h, n, o in d.results] == [
        ("command", "n1", False), ("command", "n1", True), ("command", "n2", False), ("command", "n2", True)]


def test_dispatcher_names_no_lost_record_placeholder_to_the_scheduler(tmp_path, caplog) -> None:
    """A slot holder whose node record was lost is cordoned as ``?lost-record-<digest>``: handed to the hooks, a
    command ran `scontrol`/`kubectl` on a host named after the placeholder, which exists nowhere (an error counted
    on every restart)."""
    script, record = _fake_command(tmp_path)
    d = CordonDispatcher([CommandCordon(f"{sys.executable} {script} {{node}} {{host}}")]).start()
    lost = "?lost-record-0123456789abcdef"
    with caplog.at_level("WARNING", logger="trainguard.recovery.cordon"):
        d.submit(CordonTarget(lost, lost, "llm", "lost"))
        d.submit(TARGET)
        d.stop()
    assert [json.loads(x) for x in record.read_text().splitlines()] == [["n1", TARGET.host]]
    assert [n for _, n, _ in d.results] == ["n1"]
    assert f"trainguard uncordon '{lost}'" in caplog.text


def _wait(pred, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_coordinator_cordon_fires_both_hooks_metrics_and_health(tmp_path, kube, tg_env) -> None:
    script, record = _fake_command(tmp_path)
    (tmp_path / "kube-token").write_text(KUBE_TOKEN)
    port_file = tmp_path / "port"
    err = open(tmp_path / "coord.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "llm", "--listen", "127.0.0.1:0",
         "--store", "memory://", "--nnodes", "2", "--port-file", str(port_file),
         "--cordon-command", f"{sys.executable} {script} update nodename={{host}} state=drain reason={{reason}}",
         "--cordon-kubernetes", "--kube-api", kube.url, "--kube-token-file", str(tmp_path / "kube-token"),
         "--metrics-listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0", "--log-format", "json"],
        env=tg_env, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        _wait(lambda: port_file.exists() or proc.poll() is not None, what="the coordinator's port")
        assert proc.poll() is None, (tmp_path / "coord.log").read_text()
        started = [json.loads(x) for x in (tmp_path / "coord.log").read_text().splitlines() if x.startswith("{")]
        msg = next(r["msg"] for r in started if "serving on" in r["msg"])
        metrics_url = re.search(r"metrics on (\S+)", msg).group(1)
        health_port = int(re.search(r"grpc.health.v1 on port (\d+)", msg).group(1))
        assert "cordon hook command" in msg and "cordon hook kubernetes" in msg
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
                service="trainguard.v1.Coordinator"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            info = common_pb2.NodeInfo(node_id="n1", topology=common_pb2.Topology(host="gpu-node-1", device_count=1))
            lease = stub.RegisterNode(coordinator_pb2.RegisterNodeRequest(job="llm", node=info, free_port=23456),
                                      timeout=5).lease_id
            ev = common_pb2.HealthEvent(node_id="n1", source="pcie", kind="aer.fatal", message="AER fatal",
                                        severity=common_pb2.SEVERITY_CRITICAL)
            stub.ReportEvent(coordinator_pb2.ReportEventRequest(
                job="llm", node_id="n1", lease_id=lease, generation=-1, event=ev, failed_rank=-1,
                proposed_level=coordinator_pb2.RECOVERY_LEVEL_NODE), timeout=5)
        _wait(lambda: record.exists() and kube.patches(), what="both cordon hooks")
        argv = json.loads(record.read_text().splitlines()[0])
        assert argv[:3] == ["update", "nodename=gpu-node-1", "state=drain"] and argv[3].startswith("reason=")
        assert kube.nodes["gpu-node-1"]["spec"]["unschedulable"] is True

        def scrape() -> str:
            with urllib.request.urlopen(metrics_url, timeout=5) as r:
                return r.read().decode()

        _wait(lambda: 'trainguard_cordon_hook_runs_total{hook="kubernetes",result="ok"} 1.0' in scrape(),
              what="the hook counters")
        text = scrape()
        assert 'trainguard_job_nodes{state="cordoned"} 1.0' in text
        assert 'trainguard_cordon_hook_runs_total{hook="command",result="ok"} 1.0' in text
        assert 'trainguard_job_phase{phase="forming"} 1.0' in text and "trainguard_job_generation 0.0" in text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        err.close()
    assert proc.returncode == 0, (tmp_path / "coord.log").read_text()[-2000:]
