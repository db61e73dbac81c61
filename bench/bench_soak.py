"""Soak drill benchmark: real training under trainguard with faults from the StepFun trace, ETTR vs the baseline.

Runs ``trainguard drill`` (see :mod:`trainguard.drill.soak`): a 2-worker DDP job under ``trainguard run`` for
``--minutes`` of training with faults drawn from the StepFun trace (time compressed; the factor is printed), plus
one hang (SIGSTOP) and one ENOSPC window on the checkpoint tmpfs. It prints per-fault detection and recovery
times, steps lost, the measured ETTR, the check against a fault-free run, and the ETTR model fed with the
measured figures (the drill's own schedule, and 16,384 GPUs on the StepFun trace and a Llama-3 rate), trainguard
next to the torchrun-like baseline. Needs root for the tmpfs (or ``--extra stop``).

With ``--nodes 2`` the job runs on a small cluster (standalone coordinator, node agents in network namespaces with
fake PCIe trees, a warm spare; :mod:`trainguard.drill.soak_cluster`) and every fault class of the trace is
injected for real: hardware faults, lost agents, cut data links, predicted failures, a coordinator kill.

Usage::

    python bench/bench_soak.py [--minutes 3] [--plot docs/soak.png] [--components-out measured.json] [...]
    python bench/bench_soak.py --nodes 2 --minutes 5 --plot docs/soak-cluster.png --components-out bench/components/drill-cluster.json

Every ``trainguard drill`` flag is accepted.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["drill", *sys.argv[1:]]))
