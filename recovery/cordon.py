"""Cordon hooks: when the coordinator cordons a node, mark it in the cluster's scheduler too.

The coordinator keeps a sick node out of *its* job; without telling the scheduler, the next job (or this job's
replacement pod) lands on the same broken machine. A hook is chosen on the command line of
``trainguard coordinator``:

- ``--cordon-command 'scontrol update nodename={host} state=drain reason="{reason}"'``: runs a command per
  cordoned node (Slurm, or any script). The template is split like a shell line *before* substitution and run
  without a shell, so a node name can never inject arguments. Fields: ``{node}`` (trainguard node id),
  ``{host}``, ``{job}``, ``{reason}``.
- ``--cordon-kubernetes``: marks the Kubernetes node ``unschedulable`` and adds the taint
  ``trainguard.dev/unhealthy=<job>:NoSchedule`` through the API server, with the pod's service account
  (in-cluster: ``$KUBERNETES_SERVICE_HOST``, the mounted token and CA) or ``--kube-api URL`` with
  ``--kube-token-file``/``--kube-ca``. The node's name is the ``host`` the agent registered (the Job manifest
  passes ``spec.nodeName``). The update is a read-modify-write guarded by ``resourceVersion``, so taints others
  set concurrently are kept; a conflict is retried.

Hooks run on one background thread (:class:`CordonDispatcher`): a slow API server or a hung ``scontrol``
never delays a recovery decision. Failures are logged and counted, never raised into the coordinator.

Why no Kubernetes client package: the hook is one GET and one PATCH; the official client brings dozens of
megabytes of generated models and its own dependency pins for that.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shlex
import ssl
import string
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from trainguard.errors import ConfigError
from trainguard.recovery.job_records import LOST_RECORD_RE

log = logging.getLogger(__name__)

#: Key of the taint the Kubernetes hook adds (its value is the job name).
TAINT_KEY = "trainguard.dev/unhealthy"
#: Where a pod finds its service account's token and the cluster CA.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: Fields a ``--cordon-command`` template may use.
COMMAND_FIELDS = ("node", "host", "job", "reason")


class CordonConfigError(ConfigError):
    """A cordon hook's flags are malformed (unknown template field, no API server, unreadable token)."""


class CordonFailed(Exception):
    """One hook could not mark one node (the dispatcher logs it and goes on)."""


@dataclass(frozen=True)
class CordonTarget:
    """A node the coordinator just cordoned.

    Attributes:
        node: trainguard node id.
        host: host name the agent registered (the scheduler's node name).
        job: the job that cordoned it.
        reason: why, one line (the policy's message).
    """

    node: str
    host: str
    job: str
    reason: str


class CordonHook(Protocol):
    """Marks a node in the scheduler; idempotent (a node may be cordoned again after a coordinator restart)."""

    name: str

    def cordon(self, target: CordonTarget) -> None:
        """Marks ``target`` unschedulable.

        Raises:
            CordonFailed: the scheduler refused or could not be reached.
        """


class CommandCordon:
    """Runs a command per cordoned node, e.g. ``scontrol update nodename={host} state=drain reason={reason}``.

    Args:
        template: the command line; split with shell quoting rules, then each word is formatted.
        timeout_s: how long the command may run, seconds.

    Raises:
        CordonConfigError: empty template or an unknown ``{field}``.
    """

    name = "command"

    def __init__(self, template: str, timeout_s: float = 30.0) -> None:
        try:
            self._words = shlex.split(template)
        except ValueError as exc:
            raise CordonConfigError(f"--cordon-command {template!r}: {exc}") from exc
        if not self._words:
            raise CordonConfigError("--cordon-command is empty; give a command such as "
                                    "'scontrol update nodename={host} state=drain reason={reason}'")
        use = ", ".join("{" + f + "}" for f in COMMAND_FIELDS)
        for word in self._words:
            try:
                for _, fname, _, _ in string.Formatter().parse(word):
                    if fname is not None and fname not in COMMAND_FIELDS:
                        raise CordonConfigError(f"--cordon-command: unknown field {{{fname}}}; use {use}")
                # A brace left open, or a conversion/format spec the field cannot take, fails here, at start-up,
                # rather than at the first cordon on the dispatcher thread.
                word.format(**dict.fromkeys(COMMAND_FIELDS, "x"))
            except (ValueError, KeyError, IndexError, AttributeError) as exc:
                raise CordonConfigError(f"--cordon-command: cannot use {word!r} ({exc}); write a field as {use}, "
                                        "and a literal brace as {{ or }}") from exc
        self.timeout_s = timeout_s

    def argv(self, target: CordonTarget) -> list[str]:
        """The command's argv for one node (no shell is involved)."""
        fields = {"node": target.node, "host": target.host, "job": target.job,
                  "reason": " ".join(target.reason.split())[:200] or "trainguard"}
        return [w.format(**fields) for w in self._words]

    def cordon(self, target: CordonTarget) -> None:
        """Runs the command.

        Raises:
            CordonFailed: it could not start, timed out or exited non-zero.
        """
        argv = self.argv(target)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CordonFailed(f"{argv[0]}: {exc}") from exc
        if done.returncode != 0:
            raise CordonFailed(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()[:300]}")


@dataclass(frozen=True)
class KubeAccess:
    """How to reach the Kubernetes API server.

    Attributes:
        url: ``https://host:port`` of the API server.
        token: bearer token (a service account's); ``""`` for none.
        ca_file: PEM CA bundle for the API server; ``""`` for the system roots (ignored for ``http://``).
    """

    url: str
    token: str = ""
    ca_file: str = ""

    @classmethod
    def resolve(cls, url: str | None, token_file: str | None, ca_file: str | None,
                environ: Mapping[str, str] | None = None, sa_dir: str = SERVICE_ACCOUNT_DIR) -> "KubeAccess":
        """Explicit flags, else the in-cluster service account.

        Raises:
            CordonConfigError: no API server known, or an unreadable token file.
        """
        env = os.environ if environ is None else environ
        if not url:
            host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise CordonConfigError("--cordon-kubernetes: not inside a pod ($KUBERNETES_SERVICE_HOST unset); "
                                        "give --kube-api URL (and --kube-token-file, --kube-ca)")
            url = f"https://{'[' + host + ']' if ':' in host else host}:{port}"
            token_file = token_file or os.path.join(sa_dir, "token")
            ca_file = ca_file or os.path.join(sa_dir, "ca.crt")
        if not url.startswith(("http://", "https://")):
            raise CordonConfigError(f"--kube-api {url!r}: use https://HOST:PORT")
        token = ""
        if token_file:
            try:
                with open(token_file, encoding="utf-8") as fh:
                    token = fh.read().strip()
            except OSError as exc:
                raise CordonConfigError(f"--kube-token-file {token_file}: cannot read ({exc.strerror})") from exc
        if ca_file and not os.path.isfile(ca_file):
            raise CordonConfigError(f"--kube-ca {ca_file}: no such file")
        return cls(url.rstrip("/"), token, ca_file or "")


class KubernetesCordon:
    """Marks the node unschedulable and taints it ``trainguard.dev/unhealthy=<job>:NoSchedule``.

    Args:
        access: the API server and credentials.
        taint_effect: ``NoSchedule`` (running pods stay) or ``NoExecute`` (they are evicted).
        timeout_s: per-request timeout, seconds.
    """

    name = "kubernetes"

    def __init__(self, access: KubeAccess, taint_effect: str = "NoSchedule", timeout_s: float = 10.0) -> None:
        if taint_effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise CordonConfigError(f"taint effect {taint_effect!r}: use NoSchedule, PreferNoSchedule or NoExecute")
        self.access = access
        self.taint_effect = taint_effect
        self.timeout_s = timeout_s
        self._ssl = ssl.create_default_context(cafile=access.ca_file or None) \
            if access.url.startswith("https://") else None

    def _call(self, method: str, path: str, body: object | None = None,
              content_type: str = "application/json") -> dict:
        headers = {"Accept": "application/json"}
        if self.access.token:
            headers["Authorization"] = f"Bearer {self.access.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.access.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise CordonFailed(f"{method} {path}: HTTP {exc.code} {detail}") from exc
        except (OSError, ValueError) as exc:
            raise CordonFailed(f"{method} {path}: {exc}") from exc

    def patch_for(self, node: dict, target: CordonTarget) -> dict | None:
        """The merge patch that cordons and taints ``node`` (a Node object), or None if already done."""
        spec = node.get("spec") or {}
        taints = list(spec.get("taints") or [])
        have = any(t.get("key") == TAINT_KEY and t.get("effect") == self.taint_effect for t in taints)
        if have and spec.get("unschedulable") is True:
            return None
        if not have:
            taints.append({"key": TAINT_KEY, "value": target.job[:63], "effect": self.taint_effect})
        # A JSON merge patch replaces the taints list whole, so it carries the ones read plus ours; the
        # resourceVersion makes the API server refuse it (409) if someone changed the node in between.
        return {"metadata": {"resourceVersion": node.get("metadata", {}).get("resourceVersion", "")},
                "spec": {"unschedulable": True, "taints": taints}}

    def cordon(self, target: CordonTarget, attempts: int = 3) -> None:
        """Cordons and taints the node named ``target.host``.

        Raises:
            CordonFailed: the API server refused (no such node, RBAC) or kept conflicting.
        """
        path = "/api/v1/nodes/" + urllib.parse.quote(target.host, safe="")
        last: CordonFailed | None = None
        for _ in range(attempts):
            node = self._call("GET", path)
            patch = self.patch_for(node, target)
            if patch is None:
                return
            try:
                self._call("PATCH", path, patch, "application/merge-patch+json")
                return
            except CordonFailed as exc:
                if "HTTP 409" not in str(exc):
                    raise
                last = exc  # changed under us: read again
        raise CordonFailed(f"node {target.host}: kept conflicting ({last})")


class CordonDispatcher:
    """Runs every hook for each cordoned node on a background thread, once per node.

    Args:
        hooks: the configured hooks (none makes :meth:`submit` a no-op).
    """

    def __init__(self, hooks: Sequence[CordonHook]) -> None:
        self.hooks = list(hooks)
        self._queue: queue.Queue[CordonTarget | None] = queue.Queue()
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        #: (hook name, node id, "ok" or the error) of every attempt, in order (for metrics and tests).
        self.results: list[tuple[str, str, str]] = []
        self._thread: threading.Thread | None = None

    def start(self) -> "CordonDispatcher":
        """Starts the worker thread; returns self."""
        if self.hooks and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cordon-hooks", daemon=True)
            self._thread.start()
        return self

    def submit(self, target: CordonTarget) -> None:
        """Queues ``target`` unless this dispatcher already handled its node."""
        with self._lock:
            if not self.hooks or target.node in self._seen:
                return
            self._seen.add(target.node)
        if LOST_RECORD_RE.fullmatch(target.node):
            # A slot holder whose node record was lost has no machine to name: a hook told to cordon the placeholder
            # would try a host that does not exist and count an error. The coordinator's log names the slot.
            log.warning("cordon hooks: not run for %s, a slot holder whose node record was lost (no host to mark in "
                        "the scheduler); clear it with `trainguard uncordon '%s'` once the slot is dealt with",
                        target.node, target.node)
            return
        self._queue.put(target)

    def forget(self, node: str) -> None:
        """The coordinator returned ``node`` to service: a later cordon of it runs the hooks again. (The mark the
        hooks made stays: lifting it, ``scontrol update state=resume`` or ``kubectl uncordon``, is the operator's
        call, as the repair was.)"""
        with self._lock:
            self._seen.discard(node)

    def _run(self) -> None:
        while True:
            target = self._queue.get()
            if target is None:
                return
            for hook in self.hooks:
                try:
                    hook.cordon(target)
                    outcome = "ok"
                    log.warning("cordon hook %s: marked node %s (host %s) in the scheduler", hook.name,
                                target.node, target.host)
                except CordonFailed as exc:
                    outcome = str(exc)
                    log.error("cordon hook %s failed for node %s: %s", hook.name, target.node, exc)
                except Exception as exc:  # noqa: BLE001 (a hook bug must not kill the dispatcher)
                    outcome = f"{type(exc).__name__}: {exc}"
                    log.exception("cordon hook %s crashed for node %s", hook.name, target.node)
                with self._lock:
                    self.results.append((hook.name, target.node, outcome))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Lets queued hooks finish (up to ``timeout_s``) and stops the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=timeout_s)
            self._thread = None


__all__ = ["COMMAND_FIELDS", "CommandCordon", "CordonConfigError", "CordonDispatcher", "CordonFailed",
           "CordonHook", "CordonTarget", "KubeAccess", "KubernetesCordon", "TAINT_KEY"]
