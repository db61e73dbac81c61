"""``trainguard detect``: run every configured detector on this node and print what they see.

Exit code 0 when no detector is failed or in error, 1 otherwise (so it doubles as a node health probe), 2 on a
configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

#: Longest ``--window`` between the two samples, seconds.
MAX_WINDOW_S = 3600.0


def register(subparsers: Any) -> None:
    """Adds the ``detect`` subcommand.

    Args:
        subparsers: the top-level parser's subparsers.
    """
    p = subparsers.add_parser(
        "detect",
        help="run the node detectors once and print their state",
        description="Runs every configured detector on this node and prints a table (or JSON). Detectors with "
                    "nothing to watch here (no GPU, no RDMA NIC...) are listed as no-hardware.",
    )
    p.add_argument("--config", help="agent TOML file whose [detectors] table to use (default: all built-ins)")
    p.add_argument("--only", help="comma-separated detector names to run instead of the configured ones")
    p.add_argument("--root", help="read sysfs/procfs/dev under this directory instead of / (fake trees)")
    p.add_argument("--window", type=float, default=1.0,
                   help="seconds between two samples, so that counters give rates (0: one sample; default 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_detect)


def _detect(args: argparse.Namespace) -> int:
    from trainguard.detectors.base import DetectorState
    from trainguard.detectors.errors import DetectorConfigError
    from trainguard.detectors.runner import DetectorRunner
    from trainguard.detectors.settings import DetectorSettings

    if not 0 <= args.window <= MAX_WINDOW_S:
        # 1e10 ended in an OverflowError traceback from time.sleep(); an hour is already far past any use.
        raise DetectorConfigError(f"--window {args.window} must be >= 0 and at most {MAX_WINDOW_S:.0f} seconds")
    if args.root and not os.path.isdir(args.root):
        # Checked like a config's root: a mistyped one read as a node with no hardware at all (exit 0).
        raise DetectorConfigError(f"--root {args.root!r} is not a directory; create the fake tree first or fix "
                                  "the path")
    if args.config:
        cfg = DetectorSettings.load(args.config, table="detectors", flag="--config")
    else:
        cfg = DetectorSettings(source="trainguard detect")
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        if not names:
            # Ran nothing and exited 0: a health probe passing on an empty $VAR.
            raise DetectorConfigError(f"--only {args.only!r} names no detector; give comma-separated names "
                                      "(e.g. --only pcie,kmsg) or leave the flag out to run every one")
        cfg = DetectorSettings.from_table(
            {"enabled": names, "root": cfg.root, "interval_s": cfg.interval_s,
             **{n: cfg.tables[n] for n in names if n in cfg.tables}}, source="--only", enabled_flag="--only")
    if not cfg.enabled:
        raise DetectorConfigError(f"{args.config}: detectors.enabled is empty: no detector to run; name some "
                                  "(or \"all\") to check this node")
    events = []
    runner = DetectorRunner(cfg.create(root=args.root), on_event=events.append)
    try:
        runner.run_once()
        if args.window > 0:
            time.sleep(args.window)
            runner.run_once()
    finally:
        runner.stop()
    statuses = runner.statuses()
    if args.json:
        print(json.dumps({
            "detectors": [{"name": s.name, "state": s.state.label, "detail": s.detail, "metrics": s.metrics}
                          for s in statuses],
            "events": [e.to_dict() for e in events],
        }, indent=2, sort_keys=True))
    else:
        _print_table(statuses, events)
    bad = {DetectorState.FAILED, DetectorState.ERROR}
    return 1 if any(s.state in bad for s in statuses) else 0


def _print_table(statuses: list[Any], events: list[Any]) -> None:
    from trainguard.detectors.base import DetectorState
    from trainguard.detectors.text import printable as p

    # Every field that quotes what was read is escaped: a device, interface or process name with ESC or U+202E
    # in it rewrote the table (the JSON form escapes them itself).
    width = max([len("DETECTOR")] + [len(s.name) for s in statuses])
    print(f"{'DETECTOR':<{width}}  {'STATE':<12} {'METRICS':>7}  DETAIL")
    for s in statuses:
        print(f"{p(s.name):<{width}}  {s.state.label:<12} {len(s.metrics):>7}  {p(s.detail)}")
    absent = [s for s in statuses if s.state == DetectorState.NO_HARDWARE]
    if absent:
        print(f"\nNo hardware to watch on this node for {len(absent)} detector(s):")
        for s in absent:
            print(f"  {p(s.name):<{width}}  {p(s.detail)}")
    shown = [e for e in events if not e.kind.endswith(".cleared")]
    if shown:
        print(f"\nEvents ({len(shown)}):")
        for e in shown:
            subject = f" [{p(e.subject)}]" if e.subject else ""
            print(f"  {e.severity.name.lower():<8} {e.action.name.lower().replace('_', '-'):<15} "
                  f"{p(e.source)}: {p(e.kind)}{subject}: {p(e.message)}")
    else:
        print("\nNo events.")
