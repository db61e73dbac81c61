"""Hang localisation: group every rank's Python stack by signature and name the outliers (pure, no I/O).

When one rank hangs (a stuck data loader, a deadlock, a kernel that never returns), every other rank soon
waits for it in a collective, so every rank looks hung to its node's process detector. The ranks that wait
share one stack; the culprit's differs. ByteRobust localises hangs this way: the biggest group of identical
stacks is the majority, the ranks outside it are the outliers. On a tie (e.g. 1 rank against 1) the group
whose innermost frame is a collective or a wait is the majority: those ranks wait on the others.

Signatures are the main thread's frames as ``function (file)``, line numbers dropped (two ranks waiting in the
same all-reduce from slightly different lines are the same), innermost first. Both ``py-spy dump`` and
``faulthandler`` output are parsed. A rank with no stack (its dump failed) forms its own group.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Innermost-frame function names that mean "waiting for the other ranks".
WAIT_FUNCTIONS = re.compile(
    r"(all_reduce|allreduce|all_gather|allgather|reduce_scatter|broadcast|barrier|monitored_barrier|"
    r"_wait|^wait$|recv|irecv|all_to_all|gather|scatter|synchronize|send)", re.IGNORECASE)

_PYSPY_THREAD = re.compile(r'^Thread\s+\S+\s+\((?:active|idle)[^)]*\):\s*"(?P<name>[^"]*)"')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?)\s+\((?P<file>[^():]+)(?::\d+)?\)\s*$")
_FH_THREAD = re.compile(r"^(?P<cur>Current thread|Thread) 0x[0-9a-fA-F]+")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line \d+ in (?P<func>\S+)')
_FROZEN = re.compile(r"^<frozen ([\w.]+)>$")
_NO_STACK = ("<no stack>",)
# Innermost frames kept: where a rank is stuck; the launcher frames below the training loop differ between a
# first start and a warm standby, and between dumpers, without saying anything about the hang.
_MAX_FRAMES = 8


def _file_name(path: str) -> str:
    """A frame's file as both dumpers agree on it: the base name, ``<frozen runpy>`` read as ``runpy.py``."""
    m = _FROZEN.match(path)
    return f"{m.group(1).rsplit('.', 1)[-1]}.py" if m else os.path.basename(path)


def parse_main_stack(text: str) -> tuple[str, ...]:
    """The main thread's innermost frames of a py-spy or faulthandler dump, innermost first, as ``func (file)``.

    Args:
        text: the dump.

    Returns:
        The frames (at most 8); ``("<no stack>",)`` when none can be read.
    """
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _PYSPY_THREAD.match(line)
        if m:
            threads.append((m.group("name"), []))
            continue
        m = _FH_THREAD.match(line)
        if m:
            # faulthandler names no thread, and "Current thread" is whichever thread took the signal (often the
            # hook's heartbeat thread); the main thread is the oldest, listed last.
            threads.append(("?", []))
            continue
        if not threads:
            continue
        m = _FH_FRAME.match(line) or _PYSPY_FRAME.match(line)
        if m and len(threads[-1][1]) < _MAX_FRAMES:
            threads[-1][1].append(f"{m.group('func')} ({_file_name(m.group('file'))})")
    if not threads:
        return _NO_STACK
    main = next((fr for name, fr in threads if name == "MainThread" and fr), None)
    if main is None:
        main = next((fr for _, fr in reversed(threads) if fr), None)
    return tuple(main) if main else _NO_STACK


def is_waiting(signature: tuple[str, ...]) -> bool:
    """Whether the innermost frames look like waiting for other ranks (a collective, a barrier, a wait)."""
    return any(WAIT_FUNCTIONS.search(frame.split(" (", 1)[0]) for frame in signature[:3])


@dataclass(frozen=True)
class Localisation:
    """The outcome of grouping stacks.

    Attributes:
        outlier_ranks: ranks outside the majority group (empty when every stack is alike).
        outlier_nodes: their nodes, sorted.
        outlier_frame: innermost frame of the (largest) outlier group.
        majority_frame: innermost frame of the majority.
        groups: number of distinct signatures.
        ranks_seen: ranks grouped.
    """

    outlier_ranks: tuple[int, ...]
    outlier_nodes: tuple[str, ...]
    outlier_frame: str
    majority_frame: str
    groups: int
    ranks_seen: int


def localise(stacks: Mapping[int, str], node_of: Mapping[int, str]) -> Localisation:
    """Groups ranks by stack signature and names the outliers.

    Args:
        stacks: rank -> dump text.
        node_of: rank -> node id.

    Returns:
        The localisation.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, text in sorted(stacks.items()):
        groups.setdefault(parse_main_stack(text), []).append(rank)
    if not groups:
        return Localisation((), (), "", "", 0, 0)
    # Majority: the biggest group; on a tie, one that waits on others, then a real stack over none.
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), not is_waiting(kv[0]), kv[0] == _NO_STACK))
    majority_sig, _ = ordered[0]
    outliers = sorted(r for sig, ranks in ordered[1:] for r in ranks)
    outlier_frame = ordered[1][0][0] if len(ordered) > 1 else ""
    return Localisation(tuple(outliers), tuple(sorted({node_of.get(r, "?") for r in outliers})), outlier_frame,
                        majority_sig[0], len(groups), len(stacks))


@dataclass
class HangCollection:
    """Stacks of one hang being gathered from every node (the coordinator asks in heartbeat replies)."""

    generation: int
    request_id: str
    opened: float
    deadline: float
    expected: frozenset[int]
    stacks: dict[int, str] = field(default_factory=dict)
    node_of: dict[int, str] = field(default_factory=dict)
    nodes_answered: set[str] = field(default_factory=set)

    def add(self, node_id: str, evidence: Mapping[str, str]) -> int:
        """Takes ``stack.<rank>`` entries of an event's evidence about the generation's ranks; returns how many
        ranks were new. Other ranks are dropped: any number was kept, so reports naming made-up ranks grew the
        collection (and the localisation's outliers) with text for ranks the job does not have."""
        new = 0
        for key, text in evidence.items():
            if not key.startswith("stack."):
                continue
            try:
                rank = int(key.split(".", 1)[1])
            except ValueError:
                continue
            if rank not in self.expected:
                continue
            if rank not in self.stacks:
                new += 1
            self.stacks[rank] = text
            self.node_of[rank] = node_id
        self.nodes_answered.add(node_id)
        return new

    def complete(self, now: float) -> bool:
        """Every expected rank has a stack, or the deadline passed."""
        return self.expected <= self.stacks.keys() or now >= self.deadline
