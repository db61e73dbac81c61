"""The one bound on a training step, for every process that passes one on: the hook, the node agent, the
coordinator and every checkpoint tier.

A step past it was taken by the node agent and then refused by the coordinator in every heartbeat of the node,
which lost its lease and its slot in the job (found by a fuzzing review); the checkpoint tiers and the coordinator
had the bound, the agent did not. Kept in a module of its own, importing nothing, so the training hook can use it
without the weight of the rest.
"""

from __future__ import annotations

#: Highest step any part takes: exact as a JSON number and far from int64 overflow (the coordinator sets a
#: job-wide checkpoint steps beyond the furthest one reported), with room for steps counted in samples or tokens
#: (10**13 in a 10T-token run).
MAX_STEP = 2**53 - 1

__all__ = ["MAX_STEP"]
