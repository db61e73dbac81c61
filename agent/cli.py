"""Subcommands of the node agent: ``run``, ``agent``, ``status``, ``events``, ``demo``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the agent's subcommands to the ``trainguard`` parser."""
    from trainguard.agent.run_args import add_run_arguments

    p = sub.add_parser("run", help="run a training script under trainguard on this node",
                       description="Run a training script on this node with torchrun's environment; restart all "
                                   "ranks in a new generation when one fails.")
    add_run_arguments(p)
    from trainguard.agent.run_deploy import add_run_deploy_arguments

    add_run_deploy_arguments(p)  # Slurm, coordinator TLS/token, /metrics, health
    from trainguard.agent.qualify.cli import add_qualify_run_arguments

    add_qualify_run_arguments(p)  # --qualify, --qualify-config
    p.set_defaults(handler=_run)

    p = sub.add_parser("demo", help="train on 2 workers, SIGKILL one mid-run, show the recovery")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-step", type=int, default=None, help="step at which rank 1 is killed (default: random)")
    p.add_argument("--workdir", default=None, help="where checkpoints and logs go (default: a temp dir)")
    p.set_defaults(handler=_demo)

    from trainguard.agent import operator_cli

    p = sub.add_parser("agent", help="run the node agent daemon",
                       description="Run the node agent daemon in the foreground (systemd: Type=notify).")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="TOML configuration (default $TRAINGUARD_AGENT_CONFIG or /etc/trainguard/agent.toml); a "
                        "relative path is taken from the current folder")
    p.add_argument("--grpc-listen", default=None, metavar="HOST:PORT",
                   help="TCP address of the gRPC services ('' disables TCP); overrides grpc.listen")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="unix socket for local workers and `trainguard status` ('' disables it); overrides "
                        "grpc.socket; a relative path is taken from the current folder (in the config file and "
                        "$TRAINGUARD_AGENT_SOCKET_PATH it must be absolute)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="state directory; overrides agent.state_dir; a relative path is taken from the current "
                        "folder (in the config file and $TRAINGUARD_AGENT_STATE_DIR it must be absolute)")
    p.set_defaults(handler=_agent)

    operator_cli.register(sub)  # `status` and `events`


def _run(args: argparse.Namespace) -> int:
    from trainguard.agent.run import handle_run

    return handle_run(args)


def _demo(args: argparse.Namespace) -> int:
    from trainguard.agent.demo import run_demo

    return run_demo(steps=args.steps, kill_step=args.kill_step, workdir=args.workdir)


def _agent(args: argparse.Namespace) -> int:
    from trainguard.agent.agentd import handle_agent

    return handle_agent(args)
