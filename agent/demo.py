"""``trainguard demo``: the main job in one command.

Trains ``examples/train.py`` (installed as ``trainguard.examples``, so the demo runs from a wheel) on 2 workers (DDP, gloo, CPU), SIGKILLs rank 1 at a random step, and shows the
recovery: when the fault struck, when it was detected, when the workers restarted, which step they resumed
from, and the final accuracy. Then it runs the same job without a fault and checks that both runs end with
bitwise-equal parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from trainguard.agent.fault_records import FaultRecord
from trainguard.agent.run import format_summary, run_job
from trainguard.agent.run_args import add_run_arguments
from trainguard.errors import UsageError

def _example() -> Path:
    import trainguard.examples

    return Path(trainguard.examples.__file__).resolve().parent / "train.py"


EXAMPLE = _example()


def _run(argv: list[str]) -> tuple:
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    return run_job(p.parse_args(argv))


def fault_line(f: FaultRecord) -> str:
    """The result line of the demo's fault: the step the injector struck at (the first tick at or after the
    asked-for step, so it may lie a few steps later), the detection delay and where the job resumed."""
    at = f" at step {f.step}" if f.step is not None else ""
    return (f"   fault: rank {f.rank} {f.cause}{at}; detected in "
            f"{(f.detected_at - (f.injected_at or f.detected_at)) * 1000:.0f} ms; resumed at step "
            f"{f.resumed_step} after {f.recovery_s or float('nan'):.2f} s (fault to first resumed step)")


#: The demo's checkpoint folders under ``--workdir``; its jobs resume from whatever they hold.
CHECKPOINT_FOLDERS = ("ckpt-faulty", "ckpt-clean")


def _check_workdir(work: Path) -> None:
    """Refuses a ``--workdir`` the demo cannot use as a fresh start.

    A second demo into the same folder resumed both jobs from the first one's last checkpoint: the fault never
    struck (its step lay behind), and the demo exited 1 without a word of why. A file there was a traceback.

    Raises:
        UsageError: ``work`` is not a folder, or holds an earlier demo's checkpoints.
    """
    if work.exists() and not work.is_dir():
        raise UsageError(f"--workdir {work}: not a folder; give a new or empty folder")
    used = [name for name in CHECKPOINT_FOLDERS if (work / name).is_dir() and any((work / name).iterdir())]
    if used:
        raise UsageError(f"--workdir {work} holds an earlier demo's checkpoints ({', '.join(used)}), which the "
                         "demo would resume from instead of training; give a new folder or remove those")


def run_demo(steps: int = 300, kill_step: int | None = None, workdir: str | None = None) -> int:
    """Runs the demo; returns 0 when the faulty run recovered and matched the fault-free one.

    Raises:
        UsageError: the example script is missing (a broken installation), a bad ``steps``/``kill_step``, or a
            ``workdir`` that is a file or holds an earlier demo's checkpoints.
    """
    if not EXAMPLE.is_file():
        raise UsageError(f"the demo needs {EXAMPLE}, which this installation lacks; reinstall trainguard")
    if steps < 40:
        raise UsageError("--steps must be >= 40 so the fault lands after a checkpoint")
    # Late enough that the warm standby workers have finished importing torch, as in any real job.
    low = 200 if steps >= 220 else 25
    kill_step = kill_step if kill_step is not None else random.randint(low, steps - 10)
    if not 0 < kill_step < steps:
        raise UsageError(f"--kill-step must be in 1..{steps - 1}")
    own = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="trainguard-demo-"))
    _check_workdir(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        common = ["--nproc-per-node", "2", "--max-restarts", "2"]
        ckpt_faulty, ckpt_clean = (str(work / name) for name in CHECKPOINT_FOLDERS)
        script = [str(EXAMPLE), "--steps", str(steps), "--save-every", "20", "--step-delay", "0.03"]
        print(f"== trainguard demo: 2 workers train an MLP on digits for {steps} steps, checkpoint every 20;\n"
              f"   rank 1 gets SIGKILL once it reports step {kill_step}", flush=True)
        faulty = _run(common + ["--job", "demo-faulty", "--checkpoint-dir", ckpt_faulty,
                                "--log-dir", str(work / "logs-faulty"), "--fault", f"1:{kill_step}:KILL",
                                *script, "--out", str(work / "faulty.json")])
        print(format_summary(faulty), flush=True)
        print("== the same job without a fault, for comparison", flush=True)
        clean = _run(common + ["--job", "demo-clean", "--checkpoint-dir", ckpt_clean,
                               "--log-dir", str(work / "logs-clean"), *script, "--out", str(work / "clean.json")])
        print(format_summary(clean), flush=True)
        if faulty.exit_code != 0 or clean.exit_code != 0:
            print(f"demo failed; worker logs are in {work}", file=sys.stderr)
            own = False
            return 1
        a = json.loads((work / "faulty.json").read_text())
        b = json.loads((work / "clean.json").read_text())
        same = a["params_sha256"] == b["params_sha256"]
        f = faulty.faults[0] if faulty.faults else None
        print("== result")
        if f is not None:
            print(fault_line(f))
        print(f"   final test accuracy {a['test_accuracy']:.4f} (fault-free run: {b['test_accuracy']:.4f})")
        print(f"   final parameters bitwise equal to the fault-free run: {'yes' if same else 'NO'}")
        return 0 if same and f is not None else 1
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:  # pragma: no cover - convenience for `python -m trainguard.agent.demo`
    """Runs the demo with defaults."""
    sys.exit(run_demo())


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
