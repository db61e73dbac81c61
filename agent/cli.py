"""Subcommands of the node agent: ``run``, ``agent``, ``status``, ``demo``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the agent's subcommands to the ``trainguard`` parser."""
    from trainguard.agent.run import add_run_arguments, handle_run

    p = sub.add_parser("run", help="run a training script under trainguard on this node",
                       description="Run a training script on this node with torchrun's environment; restart all "
                                   "ranks in a new generation when one fails.")
    add_run_arguments(p)
    p.set_defaults(handler=handle_run)

    p = sub.add_parser("demo", help="train on 2 workers, SIGKILL one mid-run, show the recovery")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-step", type=int, default=None, help="step at which rank 1 is killed (default: random)")
    p.add_argument("--workdir", default=None, help="where checkpoints and logs go (default: a temp dir)")
    p.set_defaults(handler=_demo)

    p = sub.add_parser("agent", help="run the node agent daemon")
    p.add_argument("--socket", default="/run/trainguard/agent.sock", help="unix socket for local clients")
    p.add_argument("--grpc-listen", default=None, metavar="HOST:PORT", help="TCP address for remote clients")
    p.set_defaults(handler=_agent)

    p = sub.add_parser("status", help="show the local node agent's view of node health")
    p.add_argument("--socket", default="/run/trainguard/agent.sock")
    p.add_argument("--target", default=None, metavar="HOST:PORT", help="query a remote agent over TCP")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_status)


def _demo(args: argparse.Namespace) -> int:
    from trainguard.agent.demo import run_demo

    return run_demo(steps=args.steps, kill_step=args.kill_step, workdir=args.workdir)


def _agent(args: argparse.Namespace) -> int:
    from trainguard.agent.daemon import run_daemon

    return run_daemon(socket_path=args.socket, grpc_listen=args.grpc_listen)


def _status(args: argparse.Namespace) -> int:
    from trainguard.agent.status import show_status

    return show_status(socket_path=args.socket, target=args.target, as_json=args.json)
