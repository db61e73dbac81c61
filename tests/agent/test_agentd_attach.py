"""`trainguard run` on a node with a daemon attaches to it: the daemon's detectors (not the launcher's own) find a
node fault, and the daemon keeps the job's memory tier, so a SIGKILLed launcher's restart restores from memory.

Real processes: the daemon (ExecStart of deploy/trainguard-agent.service), `trainguard run` launchers with gloo
workers saving through the hook, `kill -9` of the launcher's whole process group; a fake sysfs tree in the real
formats for the daemon's PCIe detector; the arena in a per-test folder of /dev/shm.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from agentd_unit import UnitDaemon, clean_env, pcie_daemon_config, wait_until
from tg_testutil import REPO
from trainguard.checkpoint.arena import memory_committed
from trainguard.testing.sysfs import FakeNodeHardware

SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.timeout(180)


def daemon_config(sysfs: Path, shm: Path, ttl_s: float = 300.0) -> str:
    return pcie_daemon_config("n1", sysfs, f"""[memory_tier]
root = "{shm}"
ttl_s = {ttl_s}
""")


@pytest.fixture
def shm():
    path = Path(f"/dev/shm/tg-h16d-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_cmd(job: str | None, *args: str) -> list[str]:
    named = ["--rdzv-id", job] if job is not None else []
    return [sys.executable, "-m", "trainguard.cli", "run", "--standalone", *named, "--no-standby", *args]


def test_attached_launcher_sees_the_daemons_detectors_not_its_own(tmp_path: Path, tg_env: dict, shm: Path):
    daemon_hw = FakeNodeHardware(tmp_path / "daemon-sysfs")
    FakeNodeHardware(tmp_path / "launcher-sysfs")  # healthy: what the launcher's own pcie detector would read
    (tmp_path / "det.toml").write_text(f'root = "{tmp_path / "launcher-sysfs"}"\n[pcie]\ninterval_s = 0.2\n')
    daemon = UnitDaemon(tmp_path / "daemon", daemon_config(tmp_path / "daemon-sysfs", shm), clean_env(tg_env))
    env = dict(clean_env(tg_env), TRAINGUARD_AGENT_SOCKET_PATH=str(daemon.socket_path))
    proc = None
    try:
        daemon.wait_ready()
        proc = subprocess.Popen(
            run_cmd(f"att-{os.getpid()}", "--nproc-per-node", "1", "--max-restarts", "0", "--detectors",
                    "process,pcie", "--detector-config", str(tmp_path / "det.toml"), str(SCRIPTS / "sleeper.py")),
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "launcher.log", "w"),
            start_new_session=True)
        daemon.wait_log(f"job att-{os.getpid()} attached by launcher pid {proc.pid}")
        daemon.wait_log("reporting node ")  # to the job's (embedded) coordinator, under the launcher's node id
        daemon.wait_sampled("pcie")  # the healthy tree is the baseline: the next change is an event
        daemon_hw.narrow_link(4)
        wait_until(lambda: "node daemon: pcie.link_narrow" in (tmp_path / "launcher.log").read_text(), 30,
                   "the daemon's event in the launcher's log")
        daemon_hw.aer_fatal()
        proc.wait(timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        daemon.close()
    err = (tmp_path / "launcher.log").read_text()
    assert "attached job att-" in err and "to the node daemon at" in err, err[-3000:]
    # The faults exist only in the daemon's tree: the launcher learned them from the daemon (its event stream,
    # and the daemon's own report to the job's coordinator, whichever comes first).
    assert "node daemon: pcie.link_narrow: PCIe link of 0000:3b:00.0 trained at x4, below its x16" in err, err
    assert proc.returncode == 1 and "restart budget exhausted" in err and "pcie.aer_fatal" in err, err[-3000:]


def newest_restore(out: Path, rank: int, pids_before: set[str]) -> dict:
    files = [p for p in out.glob(f"restore-r{rank}-*.json") if p.name not in pids_before]
    assert files, f"rank {rank} never restored"
    return json.loads(min(files, key=lambda p: p.stat().st_mtime).read_text())


def _kill_and_rerun(daemon: UnitDaemon, env: dict, shm: Path, tmp_path: Path, job: str | None, nproc: int) -> None:
    """Runs ``arena_trainer.py`` under the attached launcher, SIGKILLs the launcher's session once step 5 is in
    the memory tier, removes the disk copy and reruns the same command: every rank restores from memory."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir(parents=True)
    cmd = run_cmd(job, "--nproc-per-node", str(nproc), "--max-restarts", "0", "--detectors", "process",
                  "--checkpoint-dir", str(ckpt), str(SCRIPTS / "arena_trainer.py"), str(out), "16")
    first = second = None
    try:
        first = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 start_new_session=True)
        if job is None:  # the arena the run creates is named after its job
            def default_named() -> list[str]:
                return [d.name for d in shm.iterdir() if d.is_dir() and d.name.startswith("arena_trainer-")] \
                    if shm.is_dir() else []

            wait_until(default_named, 90, "the job's arena")
            job = default_named()[0]
        wait_until(lambda: memory_committed(str(shm), job) and memory_committed(str(shm), job)[-1][0] >= 5, 90,
                   "step 5 in the memory tier")
        # kill -9 the launcher and everything in its session (workers, persist process, guard).
        group = [p for p in psutil.process_iter() if _sid(p) == first.pid]
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
        psutil.wait_procs(group, timeout=20)
        saved = memory_committed(str(shm), job)[-1][0]
        daemon.wait_log(f"every launcher of job {job} is gone; keeping its arena 300 s")
        assert (shm / job).is_dir()
        shutil.rmtree(ckpt)  # no disk copy: only the memory tier can serve the restart
        before = {p.name for p in out.glob("restore-*.json")}
        second = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 0, err[-3000:]
        assert "it kept this job's memory tier from a previous launcher" in err, err[-3000:]
        for rank in range(nproc):
            got = newest_restore(out, rank, before)
            assert got["tier"] == "memory" and got["next_step"] == saved + 1, got
            # Bitwise: the restored parameters and optimizer state hash to what the killed run had at that step.
            assert got["digest"] == (out / f"digest-r{rank}-s{saved}").read_text()
        # The job ended: the daemon removed its arena (nothing left in /dev/shm).
        wait_until(lambda: not (shm / job).exists(), 20, "the arena's removal")
        daemon.wait_log(f"memory tier: removed the arena of job {job} (the job ended)")
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


def test_sigkilled_launchers_restart_restores_from_the_daemons_memory(tmp_path: Path, tg_env: dict, shm: Path):
    """Rerunning the same command restores from memory: with an explicit job name, and with none (the default
    name of a one-node job follows its checkpoint directory, not its start time). The named job has two ranks
    (every rank restores the same step bitwise); the default name does not depend on the ranks, so that job has
    one (one torch worker fewer in each of its two runs). Both jobs run side by side on one daemon (each is
    judged on its own job name and arena): their waits overlap and one daemon starts instead of two."""
    FakeNodeHardware(tmp_path / "sysfs")
    daemon = UnitDaemon(tmp_path / "daemon", daemon_config(tmp_path / "sysfs", shm), clean_env(tg_env))
    env = dict(clean_env(tg_env), TRAINGUARD_AGENT_SOCKET_PATH=str(daemon.socket_path),
               TRAINGUARD_CHECKPOINT_SHM_DIR=str(shm))
    try:
        daemon.wait_ready()
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(_kill_and_rerun, daemon, env, shm, tmp_path / "rdzv-id", f"mem-{os.getpid()}", 2),
                    pool.submit(_kill_and_rerun, daemon, env, shm, tmp_path / "default-name", None, 1)]
            for run in runs:
                run.result()
    finally:
        daemon.close()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare(1) and root")
def test_a_launcher_in_another_pid_namespace_is_known_by_its_lock_not_its_pid(tmp_path: Path, tg_env: dict,
                                                                             shm: Path):
    """As in Kubernetes, where the daemon and the launcher run in pods of their own: the launcher is pid 1 of its
    namespace, and "pid 1" in the daemon's is another process that always lives. Known by pid, a SIGKILLed
    launcher would keep its job attached and its arena held forever; known by the lock it holds beside the
    daemon's socket, it is seen gone and its arena ages out."""
    job = f"ns-{os.getpid()}"
    FakeNodeHardware(tmp_path / "sysfs")
    daemon = UnitDaemon(tmp_path / "daemon", daemon_config(tmp_path / "sysfs", shm, ttl_s=2.0), clean_env(tg_env))
    env = dict(clean_env(tg_env), TRAINGUARD_AGENT_SOCKET_PATH=str(daemon.socket_path),
               TRAINGUARD_CHECKPOINT_SHM_DIR=str(shm))
    cmd = ["unshare", "--pid", "--fork", "--kill-child",
           *run_cmd(job, "--nproc-per-node", "1", "--max-restarts", "0", "--detectors", "process",
                    "--checkpoint-dir", str(tmp_path / "ckpt"), str(SCRIPTS / "sleeper.py"))]
    proc = None
    try:
        daemon.wait_ready()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "launcher.log", "w"), start_new_session=True)
        daemon.wait_log(f"job {job} attached by launcher pid 1, lock {job}.1.")
        locks = list((daemon.socket_path.parent / "launchers").glob(f"{job}.1.*.lock"))
        assert len(locks) == 1, locks
        (shm / job).mkdir(parents=True, exist_ok=True)  # the arena, as the first save would leave it
        launcher = psutil.Process(proc.pid).children()[0]  # pid 1 of the new namespace
        launcher.kill()  # its namespace dies with it: workers included
        proc.wait(timeout=30)
        daemon.wait_log(f"every launcher of job {job} is gone without detaching")
        daemon.wait_log(f"memory tier: removed the arena of job {job} (no launcher for 2 s)")
        assert not (shm / job).exists() and not locks[0].exists()
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        daemon.close()


def _sid(p: psutil.Process) -> int:
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError):
        return -1


def test_a_second_run_of_a_default_named_job_is_refused_with_the_fix(tmp_path: Path, tg_env: dict):
    """The default name of a one-node job follows its checkpoint directory: a second `trainguard run` of the same
    command while the first lives would share its memory and be refused every checkpoint. It is refused at once,
    naming the first run and the flags that set them apart, and the first run is untouched."""
    env = dict(clean_env(tg_env), TRAINGUARD_RUN_REGISTRY=str(tmp_path / "runs"))
    cmd = run_cmd(None, "--nproc-per-node", "1", "--max-restarts", "0", "--detectors", "process",
                  "--checkpoint-dir", str(tmp_path / "ckpt"), str(SCRIPTS / "sleeper.py"))
    first = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_until(lambda: (tmp_path / "runs").is_dir() and any((tmp_path / "runs").glob("*.json")), 60,
                   "the first run's record")
        second = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is already running here as pid {first.pid}" in second.stderr, second.stderr[-2000:]
        assert "give it --job NAME or another --checkpoint-dir" in second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
