"""Pre-flight node qualification: a short, bounded check a node passes before it takes a slot.

Anchors: Guard's node sweep (MLSys 2026: step-time variance cut from 20% to 1% by keeping slow nodes out) and
DLRover's node check (each node runs a small matmul and collective before training and is excluded when it fails
or is slow). Here a node checks itself locally (:mod:`.links`: PCIe links at full width and speed, NICs at their
speed, RDMA ports active; :mod:`.local`: the configured detectors clean, the checkpoint disk writes fast enough)
and against a few already-qualified peers (:mod:`.peers`: a timed exchange over the data network, compared with
the nodes before it), each check under a timeout and the whole under a budget (:mod:`.runner`), and brings the
:class:`~.verdict.Verdict` to its registration (:mod:`.agent_side`). The coordinator cordons a node that failed,
with the reason (:mod:`trainguard.recovery.qualification`), and never places it: not in the first generation, not
as a spare. See the README's "Node qualification" section.
"""

from trainguard.agent.qualify.config import CHECK_NAMES, QualifyConfigError, QualifySection
from trainguard.agent.qualify.verdict import CheckResult, CheckStatus, Verdict

# The runner and the agent's side are imported from their modules (.runner, .agent_side): the agent's config
# and the CLI's parser need only the settings and the verdict types.
__all__ = ["CHECK_NAMES", "CheckResult", "CheckStatus", "QualifyConfigError", "QualifySection", "Verdict"]
