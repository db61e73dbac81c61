"""``trainguard qualify``: the pre-flight node check by hand, and the ``trainguard run`` flags that turn it on.

``trainguard qualify [--config agent.toml] [--json]`` runs the ``[qualify]`` checks of the agent's configuration
(with its ``[detectors]`` set) once and prints one line per check; exit code 0 when the node qualifies, 1 when
it does not, 2 for a configuration error. The ``peers`` check needs the job's coordinator: it is skipped here.
"""

from __future__ import annotations

import argparse
import os
import sys

from trainguard.agent.qualify.config import CHECK_NAMES, QualifySection


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``trainguard qualify`` to the ``trainguard`` parser."""
    p = sub.add_parser("qualify", help="check this node before it takes a slot (links, disk, detectors)",
                       description="Run the pre-flight node qualification of the [qualify] table once: detectors "
                                   "clean, PCIe links at full width, NICs at their speed, RDMA ports active, disk "
                                   "writes fast enough. Exit code 0: qualified; 1: refused; 2: bad configuration.")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="agent TOML ([qualify] and [detectors]; default $TRAINGUARD_AGENT_CONFIG or "
                        "/etc/trainguard/agent.toml, defaults when absent)")
    p.add_argument("--checks", default=None, metavar="LIST",
                   help=f"comma-separated checks to run instead of qualify.checks ({','.join(CHECK_NAMES)})")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where the disk test writes unless qualify.disk_dir is set (default: the temp dir)")
    p.add_argument("--node-id", default=None, help="node id shown in the verdict (default: agent.node_id)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.set_defaults(handler=_qualify)


def add_qualify_run_arguments(p: argparse.ArgumentParser) -> None:
    """The ``trainguard run`` flags that qualify the node before it registers."""
    g = p.add_argument_group("pre-flight node qualification (before this node takes a slot)")
    g.add_argument("--qualify", action="store_true",
                   help="qualify this node before registering (links, disk, --detectors once); the coordinator "
                        "cordons a node that fails and never gives it a rank")
    g.add_argument("--qualify-config", default=None, metavar="FILE",
                   help="agent TOML whose [qualify] table sets the checks and thresholds (implies --qualify)")


def qualify_for_run(args: argparse.Namespace) -> QualifySection | None:
    """The ``[qualify]`` settings ``trainguard run`` was given, or None when it does not qualify.

    Raises:
        ConfigError: the file is unreadable or a ``[qualify]`` value is bad (one line naming the key).
    """
    path = getattr(args, "qualify_config", None)
    if path:
        from trainguard.agent.config import AgentConfig, AgentConfigError

        if not os.path.isfile(path):  # the loader's own message names the daemon's --config flag
            raise AgentConfigError(f"--qualify-config {path}: no such file; pass an agent TOML with a [qualify] "
                                   f"table (see deploy/agent.toml), or --qualify for the defaults")
        return AgentConfig.load(path).qualify
    if getattr(args, "qualify", False):
        section = QualifySection()
        section.validate()
        return section
    return None


def _qualify(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from trainguard.agent.config import AgentConfig
    from trainguard.agent.qualify.agent_side import context_for_agent
    from trainguard.agent.qualify.config import QualifyConfigError
    from trainguard.agent.qualify.runner import qualify_node

    cfg = AgentConfig.load(args.config)
    section = cfg.qualify
    if args.checks is not None:
        checks = [c.strip() for c in args.checks.split(",") if c.strip()]
        if not checks:
            # Ran no check and printed "qualified", exit 0: a probe passing on an empty $VAR (as `detect --only`).
            raise QualifyConfigError(f"--checks {args.checks!r} names no check; give comma-separated names (e.g. "
                                     "--checks pcie,disk) or leave the flag out to run qualify.checks")
        section = replace(section, checks=checks)
        try:
            section.validate()
        except QualifyConfigError as exc:
            raise QualifyConfigError(f"--checks {args.checks!r}: {exc}") from exc
    ctx = replace(context_for_agent(cfg, args.node_id or "", args.checkpoint_dir), config=section)
    verdict = qualify_node(ctx)
    print(verdict.to_json() if args.json else verdict.to_text(), file=sys.stdout)
    return 0 if verdict.passed else 1


__all__ = ["add_qualify_run_arguments", "qualify_for_run", "register"]
