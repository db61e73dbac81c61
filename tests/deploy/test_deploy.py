"""The shipped deployment files: Kubernetes manifests validated offline against the API schemas (and a broken
copy refused, naming the field); every trainguard command line in them parsed by trainguard's own parser; the
agent's ConfigMap loaded by the agent's config loader; probes, /dev/shm and the security flags where they must
be; the node daemon's socket, the checkpoint arenas and the client certificate a train pod attaches with, each
the same host or secret file in both pods. The Slurm batch script runs for real under a fake ``srun`` that
starts it once per node of the list."""

from __future__ import annotations

import importlib
import json
import os
import posixpath
import re
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tg_testutil

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(K8S.glob("*.yaml"))
SBATCH = ROOT / "deploy" / "slurm" / "trainguard.sbatch"
SCRIPTS = ROOT / "tests" / "agent" / "scripts"

try:
    importlib.import_module("kubernetes_validate")

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


def test_long_running_pods_have_grpc_probes_and_the_train_pod_a_memory_dev_shm() -> None:
    pytest.importorskip("yaml")
    specs = _pod_specs()
    for name in ("DaemonSet/trainguard-agent", "Deployment/trainguard-coordinator", "Job/llm-pretrain"):
        (c,) = specs[name]["containers"]
        assert "grpc" in c["livenessProbe"] and "grpc" in c["startupProbe"], name
        port = c["livenessProbe"]["grpc"]["port"]
        assert port in [p["containerPort"] for p in c["ports"]], name
    spec = specs["Job/llm-pretrain"]  # data loader workers and NCCL; the daemon keeps no data in its /dev/shm
    (c,) = spec["containers"]
    vol = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in spec["volumes"] if v["name"] == vol)["emptyDir"]["medium"] == "Memory"


def test_a_pod_lost_with_its_node_is_replaced_not_the_end_of_the_job() -> None:
    # Found by a review: with backoffLimit 0 and nothing else, the Job controller failed the whole Job (and ended
    # every other pod) at the first pod lost with its node, so no recovery could happen. A disruption is not
    # counted now; the new pod of the index registers under the same node id, so it takes the slot back.
    pytest.importorskip("yaml")
    job = next(d for d in _docs(K8S / "train-job.yaml") if d["kind"] == "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    (c,) = spec["template"]["spec"]["containers"]
    assert "--node-id=llm-pretrain-$(JOB_COMPLETION_INDEX)" in c["command"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it


def test_the_agent_configmap_loads(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    from trainguard.agent.config import AgentConfig

    cm = next(d for d in _docs(K8S / "agent-daemonset.yaml") if d["kind"] == "ConfigMap")
    path = tmp_path / "agent.toml"
    path.write_text(cm["data"]["agent.toml"])
    cfg = AgentConfig.load(path, env={})
    assert cfg.detectors.root == "/host" and cfg.log.format == "json"


# -- what a train pod shares with the node daemon ---------------------------------------------------------------
DAEMON, TRAIN = "DaemonSet/trainguard-agent", "Job/llm-pretrain"


def _mount(spec: dict, path: str) -> tuple[dict, dict] | None:
    """The volume mount holding ``path`` in the pod's container, and its volume; None on the image's own files.
    With nested mounts the deepest mount point wins, as in the container."""
    (c,) = spec["containers"]
    over = [m for m in c.get("volumeMounts", [])
            if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not over:
        return None
    m = max(over, key=lambda m: len(m["mountPath"]))
    return m, next(v for v in spec["volumes"] if v["name"] == m["name"])


def _backing(name: str, path: str) -> tuple:
    """What file ``path`` in pod ``name``'s container is: ``("hostPath", host path)``, ``("secret", name, key)``,
    ``("configMap", name, key)``, or something only that pod sees (an emptyDir, the image)."""
    spec = _pod_specs()[name]
    found = _mount(spec, path)
    if found is None:
        return ("image of", name, path)
    m, vol = found
    rel = posixpath.normpath(posixpath.join(m.get("subPath", ""), posixpath.relpath(path, m["mountPath"])))
    if "hostPath" in vol:
        return ("hostPath", posixpath.normpath(posixpath.join(vol["hostPath"]["path"], rel)))
    if "secret" in vol and "items" not in vol["secret"]:
        return ("secret", vol["secret"]["secretName"], rel)
    if "configMap" in vol and "items" not in vol["configMap"]:
        return ("configMap", vol["configMap"]["name"], rel)
    return ("volume of", name, m["name"], rel)


def _use_env(monkeypatch, name: str) -> dict[str, str]:
    """Makes this process's trainguard environment the container's (downward-API values as placeholders)."""
    (c,) = _pod_specs()[name]["containers"]
    for var in [v for v in os.environ if v.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(var)
    env = {e["name"]: e.get("value", "x") for e in c.get("env", [])}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return dict(os.environ)


def _daemon_config(tmp_path: Path, monkeypatch):
    """The configuration ``trainguard agent`` starts with in the DaemonSet: its command line, its environment and
    the ConfigMap file it reads."""
    from trainguard.agent.agentd import config_loader
    from trainguard.cli import build_parser

    (c,) = _pod_specs()[DAEMON]["containers"]
    args = build_parser().parse_args(c["command"][1:])
    kind, cm_name, key = _backing(DAEMON, args.config)
    assert kind == "configMap", args.config
    cm = next(d for d in _docs(K8S / "agent-daemonset.yaml")
              if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm_name)
    path = tmp_path / key
    path.write_text(cm["data"][key])
    _use_env(monkeypatch, DAEMON)
    return config_loader(str(path), args.grpc_listen, args.socket, args.state_dir)()


def _launcher_attachment(monkeypatch):
    """What ``trainguard run`` in the train Job's container asks of the node daemon, from its command line and
    environment: ``(socket path it dials, JobAttachment it sends)``, taken at the daemon link."""
    from trainguard.agent import health_source
    from trainguard.agent.tls import TlsFiles
    from trainguard.cli import build_parser
    from trainguard.recovery.rpc_security import RpcSecurity

    (c,) = _pod_specs()[TRAIN]["containers"]
    args = build_parser().parse_args([_expand(a) for a in c["command"][1:]])
    env = _use_env(monkeypatch, TRAIN)
    seen: dict = {}

    class Link:
        path = "daemon"

        def attach(self, job):
            seen["job"] = job
            return SimpleNamespace(node_id="n", arena_kept=False)

    def connect(path, timeout_s=0.0):
        seen["socket"] = path
        return Link()

    monkeypatch.setattr(health_source.DaemonLink, "connect", staticmethod(connect))
    # As run_security builds it, without reading the token file.
    tls = TlsFiles(args.coordinator_cert or "", args.coordinator_key or "", args.coordinator_ca or "")
    link = health_source.attach_daemon(args.job, args.coordinator, args.node_id, RpcSecurity(tls, "t" * 32),
                                       bool(args.checkpoint_dir), environ=env)
    assert link is not None
    return seen["socket"], seen["job"]


def _ids(name: str) -> tuple[int, set[int]]:
    """The container's uid (set in the manifest: the image's is unknown here) and the groups it runs with."""
    spec = _pod_specs()[name]
    (c,) = spec["containers"]
    pod, ctr = spec.get("securityContext", {}), c.get("securityContext", {})
    uid = ctr.get("runAsUser", pod.get("runAsUser"))
    assert uid is not None, f"{name}: the container's user is the image's, not the manifest's"
    gid = ctr.get("runAsGroup", pod.get("runAsGroup"))
    groups = {g for g in [gid, pod.get("fsGroup"), *pod.get("supplementalGroups", [])] if g is not None}
    return uid, groups


def test_a_train_pod_reaches_the_node_daemons_socket_through_the_host(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("yaml")
    cfg = _daemon_config(tmp_path, monkeypatch)
    assert cfg.grpc.socket
    dialled, _ = _launcher_attachment(monkeypatch)
    served, reached = _backing(DAEMON, cfg.grpc.socket), _backing(TRAIN, dialled)
    assert served[0] == "hostPath" and served == reached, (served, reached)
    for name, path in ((DAEMON, cfg.grpc.socket), (TRAIN, dialled)):
        _, vol = _mount(_pod_specs()[name], path)
        assert vol["hostPath"].get("type") == "DirectoryOrCreate", name  # whichever pod starts first creates it
    assert not _mount(_pod_specs()[DAEMON], cfg.grpc.socket)[0].get("readOnly")  # the daemon creates the socket
    # The launcher holds its liveness lock in launchers/ beside the socket (pids differ between the pods).
    from trainguard.agent.launcher_lock import launchers_dir

    assert _backing(TRAIN, launchers_dir(dialled)) == _backing(DAEMON, launchers_dir(cfg.grpc.socket))
    assert not _mount(_pod_specs()[TRAIN], launchers_dir(dialled))[0].get("readOnly")
    # The socket belongs to the daemon's user and group, with grpc.socket_mode; connecting needs write access.
    (duid, dgroups), (tuid, tgroups) = _ids(DAEMON), _ids(TRAIN)
    mode = cfg.grpc.socket_mode
    assert (tuid == duid and mode & 0o200) or (dgroups & tgroups and mode & 0o020), (oct(mode), duid, tuid)


def test_the_checkpoint_arenas_are_one_host_tmpfs_folder_for_the_daemon_and_the_train_pods(
        tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("yaml")
    from trainguard.checkpoint.config import MemoryTierConfig
    from trainguard.checkpoint.service import CheckpointService

    root = _daemon_config(tmp_path, monkeypatch).memory_tier.root
    _, attachment = _launcher_attachment(monkeypatch)  # from here on, the train container's environment
    workers = MemoryTierConfig().directory  # where the workers' snapshots go by default
    service = CheckpointService(job=attachment.job).shm_dir  # the launcher's checkpoint service
    # The daemon keeps an arena only under its own root, compared as a path string in its own container.
    assert attachment.arena_root == root == workers == service, (attachment.arena_root, root, workers, service)
    kept, written = _backing(DAEMON, root), _backing(TRAIN, root)
    assert kept[0] == "hostPath" and kept == written, (kept, written)
    assert kept[1].startswith("/dev/shm/"), kept  # the host's tmpfs: the arena is the memory tier
    for name in (DAEMON, TRAIN):  # the workers write it, the daemon removes it
        m, vol = _mount(_pod_specs()[name], root)
        assert not m.get("readOnly") and vol["hostPath"].get("type") == "DirectoryOrCreate", name


def test_a_train_pod_sends_its_client_certificate_the_daemon_mounts_none(monkeypatch) -> None:
    """AttachJob carries the PEM contents the launcher reads in its own container, so the daemon needs no job's
    secret mounted (it used to open the launcher's paths, which forced every job's secret into its pod)."""
    pytest.importorskip("yaml")
    _, attachment = _launcher_attachment(monkeypatch)
    files = [attachment.tls_ca_file, attachment.tls_cert_file, attachment.tls_key_file]
    assert all(files), files  # the shipped Job dials its coordinator with mutual TLS
    for path in files:
        assert _backing(TRAIN, path)[0] == "secret", path  # readable where the launcher runs
    daemon_secrets = [v["secret"]["secretName"] for v in _pod_specs()[DAEMON].get("volumes", []) if "secret" in v]
    assert daemon_secrets == [], daemon_secrets


def test_the_daemon_can_keep_an_attached_jobs_tls_files(monkeypatch) -> None:
    """The daemon writes each attached job's TLS files (sent with AttachJob) into a 0700 folder of the temp dir;
    with readOnlyRootFilesystem and no volume there, every AttachJob of the shipped mutual-TLS Job was refused
    (Read-only file system), so each job ran without the daemon. The folder is a writable, memory-backed volume
    of the daemon's pod only: the keys stay off the host's disks and out of the train pods."""
    pytest.importorskip("yaml")
    spec = _pod_specs()[DAEMON]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    tmp = next((env[v] for v in ("TMPDIR", "TEMP", "TMP") if env.get(v)), "/tmp")  # as tempfile.gettempdir()
    found = _mount(spec, tmp)
    if not c.get("securityContext", {}).get("readOnlyRootFilesystem") and found is None:
        return  # the image's own /tmp is writable
    assert found is not None, f"{tmp}: on the read-only root filesystem"
    m, vol = found
    assert not m.get("readOnly") and vol.get("emptyDir", {}).get("medium") == "Memory", (m, vol)


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


def test_the_sbatch_script_runs_one_job_across_its_nodes_and_a_spare_takes_a_lost_nodes_place(
        tmp_path: Path, tg_env) -> None:
    """Three Slurm nodes, one a spare (SPARES=1): the same command line on each, only SLURM_NODEID differs. Node 1's
    trainguard run is SIGKILLed in the first generation; the spare takes its slot, the job succeeds, and so does
    the script, although the step failed (a task was killed)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(stat.S_IRWXU)
    port = tg_testutil.free_port()
    out = tmp_path / "out"
    out.mkdir()
    env = {**tg_env, "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "SLURM_JOB_ID": "9001", "SLURM_JOB_NAME": "llm", "SLURM_JOB_NODELIST": "localhost,127.0.0.1,127.0.0.2",
           "SLURM_NNODES": "3", "SRUN_LOG_DIR": str(tmp_path), "TRAIN_SCRIPT": str(SCRIPTS / "lose_node.py"),
           "CKPT_DIR": str(tmp_path / "ckpt"), "METRICS_LISTEN": "127.0.0.1:0", "SPARES": "1",
           "TRAINGUARD_COORDINATOR_PORT": str(port), "TRAINGUARD_RUN_REGISTRY": str(tmp_path / "runs")}
    done = subprocess.run(["bash", str(SBATCH), str(out)], env=env, capture_output=True, text=True, timeout=170)
    logs = {i: (tmp_path / f"node{i}.log").read_text() for i in (0, 1, 2) if (tmp_path / f"node{i}.log").exists()}
    said = done.stderr + "\n".join(f"--- node{i}:\n{text[-2000:]}" for i, text in logs.items())
    assert done.returncode == 0, said
    assert "trainguard run --log-format json" not in logs[1] and '"status": "succeeded"' not in logs[1], said
    envs = [json.loads((out / f"env{r}.json").read_text()) for r in (0, 1)]
    for rank, e in enumerate(envs):  # one job of two nodes, the spare in node 1's place after one restart
        assert e["dist_world"] == 2 and e["dist_rank"] == rank and e["WORLD_SIZE"] == "2", said
        assert e["GROUP_RANK"] == str(rank) and e["TORCHELASTIC_RUN_ID"] == "slurm-9001"
        assert e["TORCHELASTIC_RESTART_COUNT"] == "1", said
        assert e["MASTER_ADDR"] == "localhost"  # the first node of the Slurm list hosts rank 0
    spare = [json.loads(x) for x in logs[2].splitlines() if x.startswith("{")]
    assert any("node 2 of 3 (127.0.0.2, spare)" in r["msg"] for r in spare), said
    assert any(r.get("status") == "succeeded" for r in spare), said  # it trained to the end, and said so
    assert not list((tmp_path / ".trainguard").iterdir())  # the job token and the exit statuses are removed
    first = [json.loads(x) for x in logs[0].splitlines() if x.startswith("{")]
    assert any("metrics on http://127.0.0.1:" in r["msg"] for r in first)  # --log-format json from the script  # --log-format json from the script
