"""Restart reliability drill: SIGKILL one worker mid-run, N times in a row, for trainguard and torchrun.

Each drill runs ``bench/drill_worker.py`` on 2 workers (gloo, CPU) under a launcher, waits until rank 1 has
completed step ``--kill-step`` of the first generation, SIGKILLs it from outside, and then requires the job to
finish all steps within ``--hang-timeout`` seconds. It reports, per launcher, how many drills passed and the
recovery time (SIGKILL to the first step completed by the restarted generation), median and max.

Two workers (``--worker``): ``hook`` (``bench/drill_worker.py``, uses ``trainguard.init``) and ``plain``
(``bench/plain_worker.py``, a plain DDP script that never imports trainguard and saves its own checkpoints). The
same worker runs under every launcher of a run.

Launchers compared in the same run:
- ``trainguard``: ``trainguard run --max-restarts 2`` (warm standby workers on, the default; the agent hosts each
  generation's store).
- ``trainguard-no-standby``: the same with ``--no-standby``: restarted workers start a fresh interpreter.
- ``torchrun-static``: ``torchrun --max-restarts 2`` with its default static rendezvous.
- ``torchrun-c10d``: ``torchrun --max-restarts 2 --rdzv-backend c10d``.
- ``torchrun-c10d-noshare``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a control: it stops
  torchrun from reusing its rendezvous store for the workers' process group, the cause named in pytorch#135712).

Usage: ``python bench/bench_restart.py --drills 20``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKERS = {"hook": HERE / "drill_worker.py", "plain": HERE / "plain_worker.py"}


def _read(out: Path, rank: int) -> list[tuple[int, int, float, int]]:
    try:
        lines = (out / f"rank{rank}.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        parts = line.split()
        if len(parts) == 4:
            rows.append((int(parts[0]), int(parts[1]), float(parts[2]), int(parts[3])))
    return rows


def _command(launcher: str, steps: int, delay: float, out: Path, worker_kind: str) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    worker = [str(WORKERS[worker_kind]), str(out), str(steps), str(delay)]
    if launcher in ("trainguard", "trainguard-no-standby"):
        extra = ["--no-standby"] if launcher == "trainguard-no-standby" else []
        return [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--max-restarts", "2",
                *extra, *worker], env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2"]
    if launcher == "torchrun-static":
        port = _free_port()
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", out.name]
        if launcher == "torchrun-c10d-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return cmd + worker, env


def _kill_tree(proc: subprocess.Popen) -> None:
    # A SIGKILLed torchrun leaves its workers running (they are not in its process group and get no death
    # signal), so collect every descendant first and kill them all.
    import psutil

    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(procs, timeout=5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drill(launcher: str, steps: int, kill_step: int, delay: float, hang_timeout: float,
          worker_kind: str = "hook") -> dict:
    """Runs one kill-and-restart drill; returns its outcome and timings."""
    with tempfile.TemporaryDirectory(prefix="tg-drill-") as tmp:
        out = Path(tmp)
        cmd, env = _command(launcher, steps, delay, out, worker_kind)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        result = {"launcher": launcher, "passed": False, "recovery_s": None, "reason": ""}
        try:
            t_kill = None
            deadline = time.monotonic() + 120
            while t_kill is None:
                rows = [r for r in _read(out, 1) if r[0] == 0 and r[1] >= kill_step]
                if rows:
                    os.kill(rows[0][3], signal.SIGKILL)
                    t_kill = time.time()
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    result["reason"] = "never reached the kill step"
                    return result
                time.sleep(0.01)
            deadline = time.monotonic() + hang_timeout
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                result["reason"] = f"hung: no exit {hang_timeout:.0f}s after the kill"
                return result
            resumed = [r[2] for rank in (0, 1) for r in _read(out, rank) if r[0] >= 1]
            if resumed:
                result["recovery_s"] = min(resumed) - t_kill
            finished = all(any(r[1] == steps - 1 for r in _read(out, rank)) for rank in (0, 1))
            if proc.returncode != 0 or not finished:
                tail = (proc.stderr.read() or "").strip().splitlines()[-1:] if proc.stderr else []
                result["reason"] = f"exit code {proc.returncode}, finished={finished}: {' '.join(tail)[:200]}"
                return result
            result["passed"] = True
            return result
        finally:
            _kill_tree(proc)


def main() -> None:
    """Runs the drills and prints a table (and JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drills", type=int, default=20)
    ap.add_argument("--launchers", default="trainguard,torchrun-static,torchrun-c10d,torchrun-c10d-noshare")
    # The kill lands ~8 s into training: long enough for the standby workers to finish importing torch, as
    # they have in any real job that runs for more than a few seconds before a fault.
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kill-step", type=int, default=160)
    ap.add_argument("--step-delay", type=float, default=0.05)
    ap.add_argument("--hang-timeout", type=float, default=45.0)
    ap.add_argument("--worker", choices=sorted(WORKERS), default="hook",
                    help="hook: uses trainguard.init; plain: a DDP script that never imports trainguard")
    ap.add_argument("--json", default=None, help="write all drill results here")
    args = ap.parse_args()
    print(f"worker: {args.worker}; load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} cores", flush=True)
    results: dict[str, list[dict]] = {}
    launchers = args.launchers.split(",")
    for launcher in launchers:
        results[launcher] = []
    # Interleaved (one drill of each launcher in turn), so a change in the shared machine's load hits all alike.
    for i in range(args.drills):
        for launcher in launchers:
            r = drill(launcher, args.steps, args.kill_step, args.step_delay, args.hang_timeout, args.worker)
            results[launcher].append(r)
            print(f"{launcher:<22} drill {i + 1:>2}: {'pass' if r['passed'] else 'FAIL'}"
                  + (f"  recovery {r['recovery_s']:.2f}s" if r["recovery_s"] is not None else "")
                  + (f"  ({r['reason']})" if r["reason"] else ""), flush=True)
    print()
    print(f"{'launcher':<22} {'passed':>8} {'recovery median':>16} {'recovery max':>13}")
    base = None
    for launcher, rs in results.items():
        rec = [r["recovery_s"] for r in rs if r["passed"] and r["recovery_s"] is not None]
        med = statistics.median(rec) if rec else float("nan")
        if launcher == "trainguard":
            base = med
        print(f"{launcher:<22} {sum(r['passed'] for r in rs):>4}/{len(rs):<3} {med:>15.2f}s "
              f"{(max(rec) if rec else float('nan')):>12.2f}s")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if base:
        for launcher, rs in results.items():
            rec = [r["recovery_s"] for r in rs if r["passed"] and r["recovery_s"] is not None]
            if launcher != "trainguard" and rec:
                print(f"recovery time of {launcher} / trainguard: {statistics.median(rec) / base:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
