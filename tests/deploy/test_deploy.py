"""The shipped deployment files: Kubernetes manifests validated offline against the API schemas (and a broken
copy refused, naming the field); every trainguard command line in them parsed by trainguard's own parser; the
agent's ConfigMap loaded by the agent's config loader; probes, /dev/shm and the security flags where they must
be. The Slurm batch script runs for real under a fake ``srun`` that starts it once per node of the list."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(K8S.glob("*.yaml"))
SBATCH = ROOT / "deploy" / "slurm" / "trainguard.sbatch"
SCRIPTS = ROOT / "tests" / "agent" / "scripts"

try:
    import kubernetes_validate  # noqa: F401

    NO_VALIDATOR = ""
except ImportError:  # pragma: no cover - the dev extra installs it
    NO_VALIDATOR = "kubernetes-validate is not installed (pip install -e '.[dev]')"


def _docs(path: Path) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_specs() -> dict[str, dict]:
    specs = {}
    for path in MANIFESTS:
        for d in _docs(path):
            tmpl = d.get("spec", {}).get("template")
            if tmpl:
                specs[f"{d['kind']}/{d['metadata']['name']}"] = tmpl["spec"]
    return specs


@pytest.mark.skipif(bool(NO_VALIDATOR), reason=NO_VALIDATOR)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(bool(NO_VALIDATOR), reason=NO_VALIDATOR)
def test_a_typo_in_a_manifest_is_refused_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "coordinator.yaml"
    text = (K8S / "coordinator.yaml").read_text()
    assert text.count("failureThreshold: 30") == 1
    bad.write_text(text.replace("failureThreshold: 30", "failureTreshold: 30"))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(bad)],
                         capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode != 0 and "startupProbe" in said and "failureTreshold" in said, said


def _expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: {"JOB_COMPLETION_INDEX": "0"}.get(m.group(1), "x"), arg)


def test_every_trainguard_command_line_parses_and_is_secured() -> None:
    pytest.importorskip("yaml")
    from trainguard.cli import build_parser

    seen = {}
    for name, spec in _pod_specs().items():
        for c in spec["containers"]:
            if c["command"][0] != "trainguard":
                continue
            args = build_parser().parse_args([_expand(a) for a in c["command"][1:]])  # exits 2 on a bad flag
            seen[args.command] = args
            assert args.log_format in (None, "json")
    assert set(seen) == {"agent", "coordinator", "run"}
    co, run = seen["coordinator"], seen["run"]
    assert co.tls_client_ca and co.token_file and co.cordon_kubernetes and co.health_listen and co.metrics_listen
    assert co.store.startswith("etcd://") and "ca=" in co.store and "cert=" in co.store
    assert run.coordinator_ca and run.coordinator_cert and run.token_file and run.health_listen
    assert run.coordinator.startswith("trainguard-coordinator:")


def test_long_running_pods_have_grpc_probes_and_a_memory_dev_shm() -> None:
    pytest.importorskip("yaml")
    specs = _pod_specs()
    for name in ("DaemonSet/trainguard-agent", "Deployment/trainguard-coordinator", "Job/llm-pretrain"):
        (c,) = specs[name]["containers"]
        assert "grpc" in c["livenessProbe"] and "grpc" in c["startupProbe"], name
        port = c["livenessProbe"]["grpc"]["port"]
        assert port in [p["containerPort"] for p in c["ports"]], name
    for name in ("DaemonSet/trainguard-agent", "Job/llm-pretrain"):
        spec = specs[name]
        (c,) = spec["containers"]
        vol = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert next(v for v in spec["volumes"] if v["name"] == vol)["emptyDir"]["medium"] == "Memory"


def test_the_agent_configmap_loads(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    from trainguard.agent.config import AgentConfig

    cm = next(d for d in _docs(K8S / "agent-daemonset.yaml") if d["kind"] == "ConfigMap")
    path = tmp_path / "agent.toml"
    path.write_text(cm["data"]["agent.toml"])
    cfg = AgentConfig.load(path, env={})
    assert cfg.detectors.root == "/host" and cfg.log.format == "json"


FAKE_SRUN = """#!/bin/bash
# srun --ntasks-per-node=1 stand-in: run the command once per node of the job's node list, as Slurm would.
while [[ $1 == --* ]]; do shift; done
IFS=, read -ra nodes <<< "$SLURM_JOB_NODELIST"
pids=()
for i in "${!nodes[@]}"; do
  SLURM_NODEID=$i SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_NUM_NODES=${#nodes[@]} \\
    SLURM_STEP_NUM_TASKS=${#nodes[@]} "$@" > "$SRUN_LOG_DIR/node$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def test_the_sbatch_script_runs_one_job_across_its_nodes(tmp_path: Path, tg_env) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(stat.S_IRWXU)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    env = {**tg_env, "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "SLURM_JOB_ID": "9001", "SLURM_JOB_NAME": "llm", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
           "SLURM_NNODES": "2", "SRUN_LOG_DIR": str(tmp_path), "TRAIN_SCRIPT": str(SCRIPTS / "dump_env.py"),
           "CKPT_DIR": str(tmp_path / "ckpt"), "METRICS_LISTEN": "127.0.0.1:0",
           "TRAINGUARD_COORDINATOR_PORT": str(port), "TRAINGUARD_RUN_REGISTRY": str(tmp_path / "runs")}
    done = subprocess.run(["bash", str(SBATCH), str(out)], env=env, capture_output=True, text=True, timeout=170)
    logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-1500:] for i in (0, 1)
                     if (tmp_path / f"node{i}.log").exists())
    assert done.returncode == 0, done.stderr + logs
    envs = [json.loads((out / f"env{r}.json").read_text()) for r in (0, 1)]
    for rank, e in enumerate(envs):  # one job of two nodes: the same command line, only SLURM_NODEID differed
        assert e["dist_world"] == 2 and e["dist_rank"] == rank and e["WORLD_SIZE"] == "2"
        assert e["GROUP_RANK"] == str(rank) and e["TORCHELASTIC_RUN_ID"] == "slurm-9001"
        assert e["MASTER_ADDR"] == "localhost"  # the first node of the Slurm list hosts rank 0
    assert not list((tmp_path / ".trainguard").iterdir())  # the job token is removed at the end
    first = [json.loads(x) for x in (tmp_path / "node0.log").read_text().splitlines() if x.startswith("{")]
    assert any("metrics on http://127.0.0.1:" in r["msg"] for r in first)  # --log-format json from the script
