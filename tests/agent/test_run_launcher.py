"""`trainguard run` with real worker processes: environment, restarts, budget, signals, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tg_testutil import REPO, run_cli

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_workers_get_torchrun_environment(tmp_path: Path, tg_env: dict) -> None:
    r = run_cli(["run", "--nproc-per-node", "3", "--max-restarts", "0", "--job", "envjob",
                 str(SCRIPTS / "dump_env.py"), str(tmp_path)], tg_env)
    assert r.returncode == 0, r.stderr
    envs = [json.loads((tmp_path / f"env{i}.json").read_text()) for i in range(3)]
    for i, e in enumerate(envs):
        assert e["RANK"] == str(i) and e["LOCAL_RANK"] == str(i) and e["ROLE_RANK"] == str(i)
        assert e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3" and e["ROLE_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "1"
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert e["TORCHELASTIC_RUN_ID"] == "envjob"
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["TRAINGUARD_AGENT_SOCKET"] and e["TRAINGUARD_GENERATION"] == "1"
        assert (e["dist_rank"], e["dist_world"]) == (i, 3)
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert "job succeeded" in r.stderr


def test_exhausted_budget_names_rank_exit_code_and_restarts(tmp_path: Path, tg_env: dict) -> None:
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "2", str(SCRIPTS / "crash.py"), "1", "7"],
                tg_env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()
    summary = "\n".join(last[-5:])
    assert "rank 1" in summary and "exit code 7" in summary and "2 restarts" in summary, r.stderr
    assert "Traceback" not in r.stderr
    # Three generations ran: the first and two restarts.
    assert summary.count("fault ") == 3, summary


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_sigterm_stops_everything(tmp_path: Path, tg_env: dict, signum: int, code: int) -> None:
    """Either signal stops every worker gracefully; the exit code is 128 + the signal, as a shell reports it
    (found by a user's review: SIGTERM gave 130, so a scheduler could not tell it from a Ctrl-C)."""
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2",
                             str(SCRIPTS / "sleeper.py")], env=tg_env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            kids = psutil.Process(proc.pid).children(recursive=True)
            if len(kids) >= 4:  # 2 workers + 2 grandchildren
                break
            time.sleep(0.1)
        assert len(kids) >= 4, "workers did not start"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == code, err
        # SIGHUP (handled by default, as by torchrun) was summed up as "job FAILED ... 0 fault(s)"
        assert "job stopped" in err and "FAILED" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the tg_env fixture asserts that no worker or grandchild survived


def test_a_second_sigterm_during_the_stop_is_not_logged_again(tmp_path: Path, tg_env: dict) -> None:
    """A second SIGTERM while the workers were being stopped (a worker slow to exit, a scheduler or a user
    sending it again) logged "received SIGTERM: stopping workers" again, as if a second stop began; it is one
    stop, logged once, and still ends with 143."""
    ready = tmp_path / "ready"
    worker = tmp_path / "stubborn.py"
    worker.write_text("import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      f"pathlib.Path({str(ready)!r}).write_text('x')\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1",
                             "--shutdown-timeout", "1", str(worker)], env=tg_env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not any("stopping workers" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the worker ignores SIGTERM: the stop waits out its 1 s grace
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 143, "".join(lines)
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stops = [line for line in lines if "stopping workers" in line]
    assert len(stops) == 1 and "received SIGTERM" in stops[0], "".join(lines)


def test_signals_during_the_cleanup_are_logged_once_and_the_cleanup_finishes(tmp_path: Path, tg_env: dict) -> None:
    """SIGTERM sent again and again (a scheduler, a user) until the launcher is gone: the launcher used to put the
    default handlers back before its cleanup, so one landing while the embedded coordinator, the local server and
    the run folder were being cleaned up killed it there (exit -15, no summary, its run folder left behind)."""
    env = dict(tg_env, TMPDIR=str(tmp_path))  # the run folder is made here: this test looks only at its own
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2",
                             str(SCRIPTS / "sleeper.py")], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        kids: list = []
        while len(kids) < 4 and time.monotonic() < deadline:  # 2 workers + 2 grandchildren
            kids = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.05)
        assert len(kids) >= 4, "".join(lines)
        assert [p.name for p in tmp_path.glob("tg-*")], "no run folder under TMPDIR"
        # Until the cleanup says it got one (then no more: after the cleanup the defaults are back, as they were).
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline \
                and not any("while cleaning up" in line for line in lines):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        code = proc.wait(20)
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert not list(tmp_path.glob("tg-*")), f"run folder left behind (exit {code}):\n{text[-3000:]}"
    assert sum("while cleaning up" in line for line in lines) == 1, text[-3000:]
    assert code in (143, -signal.SIGTERM), text[-3000:]  # a signal after the cleanup ends it as a default would
    # the tg_env fixture asserts that no worker or grandchild survived


def test_sigkill_of_launcher_takes_workers_down(tmp_path: Path, tg_env: dict) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2",
                             str(SCRIPTS / "sleeper.py")], env=tg_env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        workers = []
        while time.monotonic() < deadline and len(workers) < 4:
            workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                       if "sleep" in " ".join(c.cmdline())]
            time.sleep(0.1)
        assert len(workers) == 4  # 2 workers, each with a grandchild
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, "workers outlived a SIGKILLed launcher"


def test_missing_script_is_one_line_error(tg_env: dict) -> None:
    r = run_cli(["run", "--nproc-per-node", "2", "no/such/script.py"], tg_env)
    assert r.returncode == 2
    assert r.stderr.strip() == "trainguard: error: training script not found: no/such/script.py"


def test_bad_flag_is_one_line_error(tg_env: dict) -> None:
    r = run_cli(["run", "--nproc-per-node", "two", "x.py"], tg_env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--nproc-per-node" in r.stderr
    r = run_cli(["run", "--fault", "1:x", str(SCRIPTS / "crash.py")], tg_env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--fault" in r.stderr


def test_unwritable_checkpoint_dir_is_one_line_error(tmp_path: Path, tg_env: dict) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run_cli(["run", "--checkpoint-dir", str(blocker / "ckpt"), str(SCRIPTS / "crash.py"), "0", "0"], tg_env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not writable" in lines[0] and str(blocker) in lines[0], r.stderr


def test_checkpoint_dir_that_no_worker_could_use_is_refused_at_launch(tmp_path: Path, tg_env: dict) -> None:
    # memory:// (dies with each process) and an unknown scheme failed every worker at trainguard.init, restart
    # after restart, and the run ended FAILED with "exit code 1" as its only reason.
    for url, why in (("memory://ck", "in-process filesystem"), ("bogus://ck", "fsspec knows no protocol 'bogus'")):
        r = run_cli(["run", "--checkpoint-dir", url, str(SCRIPTS / "crash.py"), "0", "0"], tg_env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert f"--checkpoint-dir = '{url}'" in lines[0] and why in lines[0], r.stderr


def test_metric_history_that_cannot_be_written_is_refused_before_the_job_forms(tmp_path: Path, tg_env: dict) -> None:
    # Opened only after registration, an unusable path ended the run once the coordinator had formed generation 1
    # and counted the node lost (a restart spent), saying "move the file aside to start anew".
    for path, why in (("/proc/tg-no-such/h.db", "cannot create its folder"), (str(tmp_path), "is a folder")):
        r = run_cli(["run", "--metric-history", path, str(SCRIPTS / "crash.py"), "0", "0"], tg_env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"trainguard: error: --metric-history {path}: {why}"), r.stderr


def test_a_url_given_to_log_dir_or_metric_history_is_refused(tmp_path: Path, tg_env: dict) -> None:
    # --log-dir s3://bucket/logs made a folder ./s3:/bucket/logs under the working directory and the run went on.
    for flag in ("--log-dir", "--metric-history"):
        r = run_cli(["run", flag, "s3://bucket/logs", str(SCRIPTS / "crash.py"), "0", "0"], tg_env, cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and f"{flag} s3://bucket/logs: a URL" in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []


def test_hung_worker_is_detected_and_restarted(tmp_path: Path, tg_env: dict) -> None:
    # A 2 s floor is 40x the script's 0.05 s steps (test_run_hang_silence judges 0.05 s steps against the same
    # floor without a false hang); the hung rank sleeps 600 s. --no-standby: the script imports no torch, but
    # standbys armed at its first step preload torch, and the restart waited for their imports (the second
    # generation's first step came 15 s after the restart on a loaded box, against 1 s for fresh workers);
    # restarts from standbys are covered by test_run_recovery.
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "1", "--no-standby", "--hang-floor-s", "2",
                 str(SCRIPTS / "hang_once.py")], tg_env, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sent no step heartbeat" in r.stderr and "rank 1" in r.stderr, r.stderr[-3000:]
    assert "1 fault(s)" in r.stderr


def test_run_speaks_sd_notify_and_stops_gracefully(tmp_path: Path, tg_env: dict) -> None:
    import socket

    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(60)
    env = dict(tg_env, NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2",
                             str(SCRIPTS / "sleeper.py")], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        msgs: list[str] = []

        def wait_for(key: str) -> None:
            while not any(key in m for m in msgs):
                msgs.append(sock.recv(4096).decode())

        wait_for("READY=1")
        wait_for("generation 1")  # STATUS once the workers run
        wait_for("WATCHDOG=1")
        proc.send_signal(signal.SIGTERM)
        wait_for("STOPPING=1")
        proc.wait(timeout=30)
        assert proc.returncode == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
    # Workers (sleeper.py and its grandchild) are gone: checked by the tg_env fixture.


def test_agent_without_workers_gives_up_on_a_dead_coordinator(tmp_path: Path, tg_env: dict) -> None:
    """An agent waiting for a rank table (no workers yet) whose coordinator is SIGKILLed ends with a clear error
    after --rdzv-conf join_timeout, instead of logging `heartbeat failed: UNAVAILABLE` forever."""
    port_file, err_file = tmp_path / "port", tmp_path / "agent.err"
    coord = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "lone", "--listen",
                              "127.0.0.1:0", "--store", "memory://", "--nnodes", "2", "--port-file", str(port_file)],
                             env=tg_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent = None
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert coord.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)
        with open(err_file, "w") as err:
            agent = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--coordinator",
                                      f"127.0.0.1:{port_file.read_text().strip()}", "--job", "lone",
                                      "--nproc-per-node", "1", "--rdzv-conf", "join_timeout=2",
                                      str(SCRIPTS / "print_env.py"), str(tmp_path)],
                                     env=tg_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        while "registered node" not in err_file.read_text():  # one of two nodes: it waits for the other
            assert agent.poll() is None and time.monotonic() < deadline, err_file.read_text()
            time.sleep(0.05)
        coord.kill()
        assert agent.wait(timeout=60) == 2, err_file.read_text()
        text = err_file.read_text()
        # said once for the outage (repeats at DEBUG, a WARNING every 30 s): one per failed heartbeat, twice a
        # second, was ~7,000 lines per node per hour of a coordinator outage; no worker runs, none is said to
        assert text.count("heartbeat failed: UNAVAILABLE") == 1 and "workers keep running" not in text, text[-2000:]
        error = [ln for ln in text.splitlines() if ln.startswith("trainguard: error:")]
        assert len(error) == 1 and "unreachable for" in error[0] and "join_timeout" in error[0], text[-2000:]
    finally:
        for p in (coord, agent):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_second_one_node_run_of_the_same_job_name_is_refused(tmp_path: Path, tg_env: dict) -> None:
    """Two one-node runs given the same --job on one host (other checkpoint directories) share the host's
    in-memory tier by job name: the second was refused every checkpoint (and, ending first, removed the first
    one's slots). It is refused before anything starts, naming the first run."""
    shm = tmp_path / "shm"
    env = dict(tg_env, TRAINGUARD_RUN_REGISTRY=str(tmp_path / "runs"), TRAINGUARD_CHECKPOINT_SHM_DIR=str(shm))
    job = f"twin-{os.getpid()}"
    # The first run's worker holds its rank's staging lease, as a trainer does from its first save on.
    writer = tmp_path / "writer.py"
    writer.write_text("import os, time\nfrom trainguard.checkpoint.arena import ArenaLease, rank_dir\n"
                      f"ArenaLease(rank_dir({str(shm)!r}, os.environ['TRAINGUARD_JOB'], 0)).acquire()\n"
                      "time.sleep(120)\n")

    def cmd(ckpt: str, script: Path) -> list[str]:
        return [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", "--max-restarts", "0",
                "--job", job, "--checkpoint-dir", str(tmp_path / ckpt), str(script)]

    first = subprocess.Popen(cmd("a", writer), env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        lease = shm / job / "rank_00000" / "owner.lock"
        while time.monotonic() < deadline and not (lease.exists() and lease.read_text().strip()):
            time.sleep(0.05)
        second = run_cli(cmd("b", SCRIPTS / "sleeper.py")[3:], env)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"job {job} is already running here as pid {first.pid}" in second.stderr, second.stderr[-2000:]
        assert "give it another --job/--rdzv-id" in second.stderr
        assert first.poll() is None  # the first run goes on
        # A run of the same name with its own shared-memory root (as the drills give each run) is not refused.
        apart = run_cli(["run", "--nproc-per-node", "1", "--max-restarts", "0", "--job", job, "--checkpoint-dir",
                         str(tmp_path / "c"), str(SCRIPTS / "print_env.py"), str(tmp_path)],
                        dict(env, TRAINGUARD_CHECKPOINT_SHM_DIR=str(tmp_path / "shm2")))
        assert apart.returncode == 0, apart.stderr[-2000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.parametrize("end", ["succeeds", "sigkill"])
def test_what_a_worker_starts_in_a_session_of_its_own_ends_with_the_job(tmp_path: Path, tg_env: dict,
                                                                           end: str) -> None:
    """The guard killed the workers' process groups only: a helper a worker started with start_new_session (a
    daemonised server) outlived the job, whether it succeeded or the launcher was SIGKILLed, and kept the
    launcher's output pipe open. The tg_env fixture fails the test if it survives."""
    script = tmp_path / "forky.py"
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                      "print('helper', p.pid, flush=True)\n"
                      f"time.sleep({0 if end == 'succeeds' else 300})\n")
    if end == "succeeds":
        r = run_cli(["run", "--nproc-per-node", "1", str(script)], tg_env, timeout=60)
        assert r.returncode == 0, r.stderr
        return
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", str(script)],
                            env=tg_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert "helper" in line, line
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workers_leave_no_empty_stack_dump_files(tmp_path: Path, tg_env: dict) -> None:
    """Every worker under the launcher opens its stack-dump file at start; each one left an empty
    trainguard-stack-<pid>.txt in /tmp for good (~1,100 after one run of this suite). The launcher removes each
    once it has reaped the worker: here one SIGKILLed, one stopped."""
    dumps = tmp_path / "stacks"
    dumps.mkdir()
    r = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "0", "--no-standby",
                 str(SCRIPTS / "hook_sigkill.py"), "1"], dict(tg_env, TRAINGUARD_STACK_DIR=str(dumps)))
    assert r.returncode == 1 and "killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    assert not list(dumps.iterdir())
