"""What one store commit carries: the group committer bounds its bytes as well as its writes, against a real etcd.

Before, a batch was bounded only by etcd's op count (127 writes): a burst of registrations of nodes with many
labels (a node record is up to ~17 KB: 32 labels of 510 characters) was one transaction of ~2 MB, which etcd
refuses whole at its default 1.5 MiB ``--max-request-bytes``; every registration in it was answered "retry
shortly", and the retries were batched the same way again.
"""

from __future__ import annotations

import os
import time

import recovery_fixtures

from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.domain import NodeRecord
from trainguard.recovery.spec import JobSpec

# the etcd server fixture, by name (an assignment, so no linter takes it for an unused import)
etcd_endpoint = recovery_fixtures.etcd_endpoint


def test_a_burst_of_registrations_with_many_labels_fits_etcds_request_limit(etcd_endpoint) -> None:
    job = "labels"
    spec = JobSpec(job=job, nnodes=200, store=f"etcd://{etcd_endpoint}/big{os.getpid()}-{time.monotonic_ns()}")
    core = JobCoordinator(spec)
    try:
        futs = []
        for i in range(120):  # queued faster than etcd commits them: batched
            labels = {f"label-{k:02d}": "v" * 500 for k in range(32)}
            futs.append(core.register(job, NodeRecord(f"n{i}", host=f"h{i}", address=f"10.0.0.{i}", labels=labels),
                                      30000 + i)[2])
        for f in futs:
            core.wait_durable(f, "a registration")  # NotServingError: "request is too large"
        assert len(core.members()) == 120 and core._committer.commits >= 2
    finally:
        core.close()
