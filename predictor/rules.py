"""The rules tier: faults that are already fatal, matched on each sample and acted on at once.

Rules are data (``rules.json`` beside this module, or a file of the same format). A rule has a ``name``,
``description``, ``severity``, ``action`` and a condition ``when``, which is either ``{"all": [...]}``,
``{"any": [...]}`` or a leaf ``{"metric": NAME, "op": OP, ...}``. ``NAME`` may be a shell pattern
(``gpu*_xid_79_total``); a leaf holds when any matching metric satisfies it. Operators:

- ``increased``: the value rose since the node's previous sample. A counter's first reading (per node and
  metric, the first that is a number) is its baseline, not an increase: a cumulative counter read from the node
  (AER counters in sysfs, a since-boot XID count) holds what happened before anyone watched, an event that was
  acted on then (or was not ours to act on), and reading it as new drained a node again at every agent
  restart. A counter that falls started again (a reboot, a restarted exporter): its new value is the baseline.
  Counters that are known to start at 0 with the stream (the agent's own event counts,
  :meth:`RulesTier.count_from_zero`) are the exception: their first nonzero reading is an increase;
- ``increased_within`` (``seconds``): it rose at some sample in the last ``seconds``;
- ``gt``, ``lt``, ``eq``, ``ne`` (``value``): comparison with a constant;
- ``lt_metric`` (``other``): less than another metric of the same sample.

A metric absent from a sample (or NaN) never satisfies a leaf: :meth:`RulesTier.unevaluable` lists the rules
that cannot fire with a given set of metric names, so the agent can log that once instead of failing silently.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from trainguard.detectors.events import Action, Severity
from trainguard.predictor.errors import RuleFileError

LEAF_OPS = {"increased": (), "increased_within": ("seconds",), "gt": ("value",), "lt": ("value",),
            "eq": ("value",), "ne": ("value",), "lt_metric": ("other",)}


@dataclass(frozen=True)
class RuleHit:
    """A rule that matched a sample.

    Attributes:
        rule: rule name.
        description: what the rule means.
        severity: event severity.
        action: recommended action.
        evidence: the metric values that made it match.
    """

    rule: str
    description: str
    severity: Severity
    action: Action
    evidence: dict[str, float]


@dataclass
class _NodeState:
    prev: dict[str, float] = field(default_factory=dict)
    last_increase: dict[str, float] = field(default_factory=dict)


def _validate(cond: Any, where: str) -> None:
    if not isinstance(cond, dict):
        raise RuleFileError(f"{where}: a condition must be an object, got {type(cond).__name__}")
    if "all" in cond or "any" in cond:
        key = "all" if "all" in cond else "any"
        subs = cond[key]
        if not isinstance(subs, list) or not subs:
            raise RuleFileError(f"{where}: '{key}' needs a non-empty list of conditions")
        for i, c in enumerate(subs):
            _validate(c, f"{where}.{key}[{i}]")
        return
    op = cond.get("op")
    if op not in LEAF_OPS:
        raise RuleFileError(f"{where}: unknown operator {op!r}; use one of {sorted(LEAF_OPS)}")
    if not isinstance(cond.get("metric"), str) or not cond["metric"]:
        raise RuleFileError(f"{where}: a leaf needs a 'metric' name")
    for arg in LEAF_OPS[op]:
        if arg not in cond:
            raise RuleFileError(f"{where}: operator {op!r} needs '{arg}'")
    if op in ("gt", "lt", "eq", "ne", "increased_within") and not isinstance(cond.get(LEAF_OPS[op][0]), (int, float)):
        raise RuleFileError(f"{where}: '{LEAF_OPS[op][0]}' of {op!r} must be a number")


def _metrics_of(cond: dict[str, Any]) -> list[str]:
    if "all" in cond or "any" in cond:
        return [m for c in cond.get("all", cond.get("any")) for m in _metrics_of(c)]
    return [cond["metric"]] + ([cond["other"]] if "other" in cond else [])


class RulesTier:
    """Evaluates rules on each node's samples, keeping the little per-node state ``increased`` needs."""

    def __init__(self, rules: list[dict[str, Any]]) -> None:
        self.rules = rules
        self._nodes: dict[str, _NodeState] = {}
        self._zero_origin: tuple[str, ...] = ()
        self._watched = sorted({m for r in rules for m in _metrics_of(r["when"])})
        # pattern matching is done once per distinct set of metric names, not on every sample
        self._keys: tuple[str, ...] | None = None
        self._watched_names: list[str] = []
        self._names_of: dict[str, list[str]] = {}

    @property
    def watched_patterns(self) -> list[str]:
        """Metric name patterns the rules read (the learned tier leaves these columns to the rules)."""
        return list(self._watched)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "RulesTier":
        """Loads and validates a rules file.

        Args:
            path: rules file; default the shipped ``rules.json``.

        Returns:
            The rules tier.

        Raises:
            RuleFileError: unreadable file or malformed rule.
        """
        try:
            if path is None:
                text = resources.files("trainguard.predictor").joinpath("rules.json").read_text()
                where = "rules.json (shipped)"
            else:
                text, where = Path(path).read_text(), str(path)
            doc = json.loads(text)
        except OSError as exc:
            raise RuleFileError(f"{path}: cannot read rules file ({exc.strerror}); check the path") from exc
        except json.JSONDecodeError as exc:
            raise RuleFileError(f"{path}: rules file is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
        except UnicodeDecodeError as exc:
            raise RuleFileError(f"{path}: rules file is not UTF-8 text (a binary file?); give a rules JSON file") from exc
        rules = doc.get("rules") if isinstance(doc, dict) else None
        if not isinstance(rules, list):
            raise RuleFileError(f"{where}: expected an object with a 'rules' list")
        names = set()
        for i, r in enumerate(rules):
            w = f"{where}: rule {i}"
            if not isinstance(r, dict):
                raise RuleFileError(f"{w}: must be an object")
            for key in ("name", "description", "severity", "action", "when"):
                if key not in r:
                    raise RuleFileError(f"{w}: missing '{key}'")
            if r["name"] in names:
                raise RuleFileError(f"{w}: duplicate rule name {r['name']!r}")
            names.add(r["name"])
            try:
                Severity.parse(r["severity"])
                Action.parse(r["action"])
            except ValueError as exc:
                raise RuleFileError(f"{w} ({r['name']}): {exc}") from exc
            _validate(r["when"], f"{w} ({r['name']})")
        return cls(rules)

    def bin_aggregates(self, columns: Sequence[str]) -> dict[str, tuple[str, float | None]]:
        """How a resampling bin must merge each of ``columns`` a value rule reads, so that the rule still sees
        in the merged row what it looks for in the bin's samples (see :meth:`MetricTable.resample`): ``gt`` the
        bin's maximum, ``lt`` its minimum, ``eq``/``ne`` the value compared with; ``lt_metric`` the metric's
        minimum and the other's maximum; ``increased`` the last value (``("last", None)``: a counter). A column
        two value rules read differently is merged as the first of them in the file needs, and a value rule's
        merge wins over ``increased``'s. Each column is merged alone:
        a rule over two columns (``all``, ``lt_metric``) may hold on a merged row where no one sample met it.
        """
        wanted: list[tuple[str, tuple[str, float | None]]] = []

        def leaves(cond: dict[str, Any]) -> Iterator[dict[str, Any]]:
            if "all" in cond or "any" in cond:
                for c in cond.get("all", cond.get("any")):
                    yield from leaves(c)
            else:
                yield cond

        for rule in self.rules:
            for leaf in leaves(rule["when"]):
                op = leaf["op"]
                if op == "gt":
                    wanted.append((leaf["metric"], ("max", None)))
                elif op == "lt":
                    wanted.append((leaf["metric"], ("min", None)))
                elif op in ("eq", "ne"):
                    wanted.append((leaf["metric"], (op, float(leaf["value"]))))
                elif op == "lt_metric":
                    wanted += [(leaf["metric"], ("min", None)), (leaf["other"], ("max", None))]
                elif op in ("increased", "increased_within"):
                    wanted.append((leaf["metric"], ("last", None)))
        out: dict[str, tuple[str, float | None]] = {}
        for pattern, how in wanted:
            for col in columns:
                # a value rule's merge wins over a counter rule's last value (the last value kept no extreme)
                if not fnmatch.fnmatchcase(col, pattern):
                    continue
                if col not in out or (out[col][0] == "last" and how[0] != "last"):
                    out[col] = how
        return out

    def count_from_zero(self, patterns: list[str] | tuple[str, ...]) -> None:
        """Declares counters that start at 0 with the stream, so that their first reading is an increase.

        The agent's event-derived counters (``gpu_xid_<N>_total``, counted from the detectors' events since the
        agent started) are such: a Xid seen before the first score, or before the counter is first published,
        is new and must alarm. A counter read from the node (since boot) must not be declared.

        Args:
            patterns: metric names or shell patterns (``gpu_xid_*_total``); replaces earlier ones.
        """
        self._zero_origin = tuple(patterns)

    def forget(self, node: str) -> None:
        """Drops a node's state (it left): if it comes back, its counters' first readings are baselines again
        and no increase seen before it left is still within an ``increased_within`` window."""
        self._nodes.pop(node, None)

    def unevaluable(self, metric_names: list[str] | set[str]) -> list[str]:
        """Rules that can never fire because some metric they need is absent.

        Args:
            metric_names: the metric names the agent produces.

        Returns:
            Names of those rules (a rule with an ``any`` branch is listed only if no branch can be evaluated).
        """
        names = set(metric_names)

        def can(cond: dict[str, Any]) -> bool:
            if "all" in cond:
                return all(can(c) for c in cond["all"])
            if "any" in cond:
                return any(can(c) for c in cond["any"])
            return all(any(fnmatch.fnmatchcase(n, m) for n in names) for m in _metrics_of(cond))

        return [r["name"] for r in self.rules if not can(r["when"])]

    def evaluate(self, ts: float, node: str, metrics: dict[str, float]) -> list[RuleHit]:
        """Matches every rule against one sample of one node.

        Args:
            ts: sample time, seconds.
            node: node name.
            metrics: the sample.

        Returns:
            The rules that match (empty when healthy).
        """
        st = self._nodes.setdefault(node, _NodeState())
        keys = tuple(metrics)
        if keys != self._keys:
            self._keys = keys
            self._names_of = {p: [n for n in keys if fnmatch.fnmatchcase(n, p)] for p in self._watched}
            self._watched_names = sorted({n for names in self._names_of.values() for n in names})
        watched = {n: metrics[n] for n in self._watched_names}
        for n, v in watched.items():
            if v is None or math.isnan(v):
                continue
            prev = st.prev.get(n)
            if prev is None:  # first reading: a baseline, unless the counter is known to start at 0 here
                prev = 0.0 if any(fnmatch.fnmatchcase(n, p) for p in self._zero_origin) else v
            if v > prev:
                st.last_increase[n] = ts
        hits = []
        for r in self.rules:
            evidence: dict[str, float] = {}
            if self._holds(r["when"], ts, watched, st, evidence):
                hits.append(RuleHit(r["name"], r["description"], Severity.parse(r["severity"]),
                                    Action.parse(r["action"]), evidence))
        for n, v in watched.items():
            if v is not None and not math.isnan(v):
                st.prev[n] = v
        return hits

    def _holds(self, cond: dict[str, Any], ts: float, m: dict[str, float], st: _NodeState,
               evidence: dict[str, float]) -> bool:
        if "all" in cond:
            return all(self._holds(c, ts, m, st, evidence) for c in cond["all"])
        if "any" in cond:
            return any([self._holds(c, ts, m, st, evidence) for c in cond["any"]])
        op, pat = cond["op"], cond["metric"]
        ok = False
        for name in self._names_of.get(pat, ()):
            v = m[name]
            if v is None or math.isnan(v):
                continue
            if op == "increased":
                hit = st.last_increase.get(name) == ts
            elif op == "increased_within":
                last = st.last_increase.get(name)
                hit = last is not None and ts - last <= float(cond["seconds"])
            elif op == "lt_metric":
                other = m.get(cond["other"])
                hit = other is not None and not math.isnan(other) and v < other
                if hit:
                    evidence[cond["other"]] = float(other)
            else:
                c = float(cond["value"])
                hit = {"gt": v > c, "lt": v < c, "eq": v == c, "ne": v != c}[op]
            if hit:
                evidence[name] = float(v)
                ok = True
        return ok
