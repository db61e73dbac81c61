"""Runs the configured checks within their time bounds and returns the :class:`~.verdict.Verdict`.

Bounds: each check runs on its own daemon thread and is waited for at most ``min(check_timeout_s, what is left of
budget_s)``; a check still running then fails as timed out (a sysfs read stuck in a dying driver must not hold a
node's registration forever; the thread is abandoned, it cannot be killed). A check that starts with nothing left
of the budget fails without running. A check that raises fails with the exception's text: qualification must
never pass a node it could not check.
"""

from __future__ import annotations

import logging
import threading
import time

from trainguard.agent.qualify.base import Outcome, QualifyContext, failed, make_check
from trainguard.agent.qualify.verdict import CheckResult, CheckStatus, Verdict

log = logging.getLogger(__name__)


def _run_bounded(name: str, ctx: QualifyContext, timeout_s: float) -> Outcome:
    """One check on its own thread, waited for at most ``timeout_s`` seconds."""
    box: list[Outcome] = []
    deadline = time.monotonic() + timeout_s

    def body() -> None:
        try:
            box.append(make_check(name).run(ctx, deadline))
        except Exception as exc:  # noqa: BLE001 (any crash of a check is a failed check, reported with its text)
            log.debug("qualification check %s raised", name, exc_info=True)
            box.append(failed(f"could not check ({type(exc).__name__}: {exc})"))

    t = threading.Thread(target=body, name=f"qualify-{name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        return failed(f"timed out after {timeout_s:.1f} s")
    return box[0]


def qualify_node(ctx: QualifyContext) -> Verdict:
    """Runs every check of ``ctx.config.checks`` in order, within the budget.

    Args:
        ctx: the node and its ``[qualify]`` settings (validated).

    Returns:
        The verdict, with each check's outcome and duration and the total wall time.
    """
    cfg = ctx.config
    t0 = time.monotonic()
    results: list[CheckResult] = []
    for name in cfg.checks:
        start = time.monotonic()
        left = cfg.budget_s - (start - t0)
        if left <= 0:
            results.append(CheckResult(name, CheckStatus.FAIL,
                                       f"not run: the {cfg.budget_s:g} s budget was spent by the checks before it"))
            continue
        outcome = _run_bounded(name, ctx, min(cfg.check_timeout_s, left))
        results.append(CheckResult(name, outcome.status, outcome.detail, time.monotonic() - start, outcome.measured_s))
    verdict = Verdict(ctx.node_id, tuple(results), time.monotonic() - t0)
    (log.info if verdict.passed else log.error)("%s", verdict.summary())
    return verdict


__all__ = ["qualify_node"]
