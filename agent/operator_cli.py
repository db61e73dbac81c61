"""``trainguard status`` and ``trainguard events``: an operator's view of a node agent.

Both talk to the local agent over its unix socket (``--socket``, default ``$TRAINGUARD_AGENT_SOCKET_PATH`` or
``/run/trainguard/agent.sock``) or to a remote one over TCP (``--target HOST:PORT``, with ``--ca`` for TLS and
``--cert/--key`` for mutual TLS). Every unary call carries a deadline (``--timeout``); an event stream is renewed
every :data:`STREAM_RENEW_S` seconds so no call lives without one, and events are de-duplicated across renewals
and reconnects.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from typing import IO, Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from trainguard.agent.config import SOCKET_ENV, hostport_arg
from trainguard.agent.errors import AgentError
from trainguard.agent.rpc_limits import MAX_HEALTH_EVENTS, MAX_REPLAY
from trainguard.agent.tls import TlsFiles, channel_credentials
from trainguard.cli_support import watch_reader_gone
from trainguard.proto import agent_pb2, agent_pb2_grpc, common_pb2

#: Socket used when neither ``--socket``, ``--target`` nor ``$TRAINGUARD_AGENT_SOCKET_PATH`` says otherwise.
DEFAULT_SOCKET = "/run/trainguard/agent.sock"
#: Seconds after which ``events --follow`` renews its stream (each call keeps a deadline).
STREAM_RENEW_S = 600.0
_SEEN_IDS = 4096


def target_arg(text: str) -> str:
    """argparse type of ``--target``: ``HOST:PORT`` (``[v6]:PORT``), never a URL.

    Without it ``--target http://node7:7350`` and ``--target node7`` reached gRPC and came back as "no node agent
    answers", sending the operator after a daemon that was running.

    Raises:
        argparse.ArgumentTypeError: a URL, or not ``HOST:PORT`` (argparse names the flag).
    """
    if "://" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is a URL; give the agent's HOST:PORT, e.g. node7:7350")
    return hostport_arg(text)


def positive_seconds_arg(text: str) -> float:
    """argparse type of ``--timeout`` and ``--watch``: a finite number of seconds above 0.

    Without it ``--timeout 0`` read as "no node agent answers" (DEADLINE_EXCEEDED) and ``--watch -1`` ended in a
    ValueError traceback from ``time.sleep``.

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or not above 0.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: use a number of seconds above 0")
    return value


def _count_arg(limit: int) -> Callable[[str], int]:
    """argparse type of an event count in ``[0, limit]`` (the agent refuses more: INVALID_ARGUMENT)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not 0 <= value <= limit:
            raise argparse.ArgumentTypeError(f"{value} is outside 0-{limit}")
        return value

    return parse


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """Flags choosing and securing the agent to talk to."""
    p.add_argument("--socket", default=None, metavar="PATH",
                   help=f"unix socket of the local agent (default ${SOCKET_ENV}, the daemon's {DEFAULT_SOCKET}, "
                        "else the newest `trainguard run` on this host)")
    p.add_argument("--target", default=None, type=target_arg, metavar="HOST:PORT",
                   help="a remote agent's TCP address")
    p.add_argument("--ca", default=None, metavar="FILE", help="PEM CA bundle: use TLS to --target and verify it")
    p.add_argument("--cert", default=None, metavar="FILE", help="PEM client certificate (mutual TLS)")
    p.add_argument("--key", default=None, metavar="FILE", help="PEM key of --cert")
    p.add_argument("--server-name", default=None, metavar="NAME",
                   help="name expected in the agent's certificate (default: the host of --target)")
    p.add_argument("--timeout", type=positive_seconds_arg, default=5.0, metavar="SECONDS",
                   help="deadline of each call (default 5)")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``status`` and ``events`` to the ``trainguard`` parser."""
    p = sub.add_parser("status", help="show a node agent's view of node health",
                       description="Show node health (detectors, workers, recent events, predictor risk).")
    add_connection_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON (one object; one per line with --watch)")
    p.add_argument("--watch", nargs="?", type=positive_seconds_arg, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--events", type=_count_arg(MAX_HEALTH_EVENTS), default=10, metavar="N",
                   help=f"recent events to show (0-{MAX_HEALTH_EVENTS}, default 10)")
    p.set_defaults(handler=handle_status)

    p = sub.add_parser("events", help="print a node agent's health events",
                       description="Print recent health events; with --follow, stream new ones until Ctrl-C.")
    add_connection_arguments(p)
    p.add_argument("--follow", "-f", action="store_true", help="keep streaming new events")
    p.add_argument("--replay", type=_count_arg(MAX_REPLAY), default=20, metavar="N",
                   help=f"recent events to print first (0-{MAX_HEALTH_EVENTS}; with --follow 0-{MAX_REPLAY}; "
                        "default 20)")
    p.add_argument("--min-severity", default="info", choices=["info", "warning", "error", "critical"])
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.set_defaults(handler=handle_events)


def open_channel(args: argparse.Namespace) -> tuple[grpc.Channel, str]:
    """Opens the channel the connection flags describe.

    Returns:
        The channel and a printable address.

    Raises:
        AgentError: flags that do not fit together.
        AgentConfigError: an unreadable certificate file.
    """
    if (args.cert or args.key or args.ca) and not args.target:
        raise AgentError("--ca/--cert/--key apply to --target HOST:PORT; the unix socket needs no TLS")
    if args.target and args.socket:  # --socket was dropped without a word, and a live socket's agent went unasked
        raise AgentError("--socket and --target name two agents: give --socket PATH for this host's agent or "
                         "--target HOST:PORT for one over TCP, not both")
    if args.target:
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        if args.ca or args.cert:
            creds = channel_credentials(TlsFiles(args.cert or "", args.key or "", args.ca or ""))
            return grpc.secure_channel(args.target, creds, options), f"{args.target} (TLS)"
        return grpc.insecure_channel(args.target), args.target
    if args.socket:
        path, origin = args.socket, "--socket"
    else:
        from trainguard.agent.job_registry import default_socket

        path, origin = default_socket()  # env, the daemon, else the newest `trainguard run` on this host
    return grpc.insecure_channel(f"unix:{path}"), f"unix:{path} ({origin})"


def _unreachable(address: str, exc: grpc.RpcError) -> AgentError:
    if address.startswith("unix:"):
        path = address[len("unix:"):].rsplit(" (", 1)[0]
        if _connect_denied(path):
            # gRPC reports a socket this user may not open as UNAVAILABLE, like one nobody listens on: the
            # operator went looking for a stopped daemon that was running.
            return AgentError(f"permission denied on the agent's socket {path}: run this as the agent's user or a "
                              "member of its group (e.g. with sudo), or point --socket at a socket you may open")
    from trainguard.agent.coordinator_link import foreign_listener, foreign_said

    foreign = foreign_listener(exc.code(), exc.details() or "", "node agent")
    if foreign is not None:
        # Something answers there, so "no node agent answers" sent the operator looking for a stopped daemon.
        return AgentError(f"{address} is not a trainguard node agent: {foreign} ({foreign_said(exc.details() or '')})"
                          "; point --target at the agent's grpc.listen address (127.0.0.1:7350 by default; not a "
                          "coordinator's, not a metrics port) or --socket at its unix socket")
    details = (exc.details() or "").splitlines()[0] if exc.details() else ""
    if len(details) > 200:  # cut at a word, with a mark: a cut mid-word read "Connection re)"
        details = details[:200].rsplit(" ", 1)[0] + " ..."
    return AgentError(f"no node agent answers at {address} ({exc.code().name}: {details}); is `trainguard agent` "
                      "running, and are --socket/--target and the TLS flags right?")


def _connect_denied(path: str) -> bool:
    """Whether connecting to the unix socket ``path`` fails for want of permission (on the socket file or a
    folder above it)."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(path)
    except PermissionError:
        return True
    except OSError:
        return False
    finally:
        s.close()
    return False


def fetch_subsystems(channel: grpc.Channel, timeout: float) -> tuple[dict[str, str], list[str]]:
    """Every ``grpc.health.v1`` status the agent serves (service -> SERVING/NOT_SERVING), and the services
    switched off by configuration (SERVING, named in the ``List`` call's trailing metadata); both empty if
    unsupported."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from trainguard.agent.health import OFF_METADATA_KEY

    try:
        reply, call = health_pb2_grpc.HealthStub(channel).List.with_call(health_pb2.HealthListRequest(),
                                                                           timeout=timeout)
    except grpc.RpcError:
        return {}, []
    off = [v for k, v in (call.trailing_metadata() or ()) if k == OFF_METADATA_KEY]
    return ({name: health_pb2.HealthCheckResponse.ServingStatus.Name(st.status)
             for name, st in sorted(reply.statuses.items())}, sorted(n for v in off for n in v.split(",") if n))


def fetch(stub: agent_pb2_grpc.NodeAgentStub, address: str, events: int, timeout: float) -> agent_pb2.NodeHealth:
    """One GetHealth call with a deadline.

    Raises:
        AgentError: the agent is unreachable or refused the call.
    """
    try:
        return stub.GetHealth(agent_pb2.GetHealthRequest(max_events=events), timeout=timeout)
    except grpc.RpcError as exc:
        raise _unreachable(address, exc) from exc


# -- rendering ---------------------------------------------------------------------------------------------


def _enum(value: int, enum: Any, prefix: str) -> str:
    try:
        return enum.Name(value).removeprefix(prefix)
    except ValueError:
        return str(value)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(headers), *(fmt(r) for r in rows)]


def event_time(event: common_pb2.HealthEvent) -> str:
    """UTC ``HH:MM:SS`` of an event (``-`` when unset)."""
    if not event.time.seconds:
        return "-"
    return datetime.fromtimestamp(event.time.seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def render(h: agent_pb2.NodeHealth, subsystems: dict[str, str] | None = None, off: Sequence[str] = ()) -> str:
    """The health snapshot (and the grpc.health.v1 statuses, when given, ``off`` naming the services switched
    off by configuration) as a readable table."""
    ckpt = str(h.last_checkpoint_step) if h.last_checkpoint_step >= 0 else "-"
    gen = str(h.generation) if h.generation >= 0 else "-"
    risk = f"{h.predictor_score:.2f}" + (f" (alert at {h.predictor_threshold:.2f})" if h.predictor_threshold else "")
    lines = [f"node {h.node_id}   trainguard {h.version}   up {_duration(h.uptime_s)}   job {h.job or '-'}   "
             f"generation {gen}   last checkpoint {ckpt}   risk {risk}", ""]
    if subsystems:
        # The agent's own subsystems; per-detector statuses are in the detector table below.
        parts = [f"{name.removeprefix('trainguard.agent.') or 'server'} "
                 f"{'off' if name in off else 'ok' if st == 'SERVING' else st.lower()}"
                 for name, st in subsystems.items() if ".detector." not in name and name != "trainguard.v1.NodeAgent"]
        lines += ["health: " + ", ".join(parts)]
        # The reason beside the state: before, "coordinator not_serving" sent the operator to the journal.
        lines += [f"  {name}: {why}" for name, why in sorted(h.subsystem_details.items())
                  if subsystems.get(f"trainguard.agent.{name}", "SERVING") != "SERVING"]
        lines += [""]
    if h.detectors:
        rows = [[d.name, _enum(d.state, agent_pb2.DetectorState, "DETECTOR_STATE_"), str(len(d.metrics)),
                 d.detail[:100]] for d in h.detectors]
        lines += _table(["DETECTOR", "STATE", "METRICS", "DETAIL"], rows) + [""]
    else:
        lines += ["no detectors", ""]
    if h.workers:
        rows = []
        for w in h.workers:
            age = f"{w.last_heartbeat_age_s:.1f}s ago" if w.last_heartbeat_age_s >= 0 else "never"
            state = _enum(w.state, agent_pb2.WorkerState, "WORKER_STATE_")
            if w.state in (agent_pb2.WORKER_STATE_FAILED, agent_pb2.WORKER_STATE_SUCCEEDED):
                state += f" ({w.exit_code})"
            rows.append([str(w.rank), str(w.local_rank), str(w.pid), state, str(w.step), age])
        lines += _table(["RANK", "LOCAL", "PID", "STATE", "STEP", "HEARTBEAT"], rows) + [""]
    else:
        lines += ["no workers", ""]
    lines += render_failslow(h.failslow)
    buddies = f"replicating to {', '.join(h.replica_buddies) or 'nobody yet'}"
    if h.replica_limit_bytes:
        lines += [f"memory replicas: {h.replica_bytes / 2**20:.1f} of {h.replica_limit_bytes / 2**20:.0f} MiB held "
                  f"for other nodes; {buddies}", ""]
    elif h.replica_buddies:  # --replica-memory-mib 0: the node's own snapshots still go to its buddies
        lines += [f"memory replicas: holding none for other nodes (--replica-memory-mib 0); {buddies}", ""]
    if h.recent_events:
        rows = [[event_time(e), _enum(e.severity, common_pb2.Severity, "SEVERITY_"), e.source, e.kind,
                 e.subject or "-", e.message[:100]] for e in h.recent_events]
        lines += _table(["TIME", "SEVERITY", "SOURCE", "KIND", "SUBJECT", "MESSAGE"], rows)
    else:
        lines.append("no recent events")
    return "\n".join(lines)


def render_failslow(f: common_pb2.FailSlowStatus) -> list[str]:
    """The coordinator's fail-slow findings (slow ranks and by how much, the last hang localisation)."""
    lines: list[str] = []
    if f.job_step_s:
        lines.append(f"fail-slow: job step {f.job_step_s * 1000:.0f} ms (median), {f.job_slowdown:.2f}x its own "
                     f"baseline, {f.ranks_observed} ranks compared" + (f"; action: {f.action}" if f.action else ""))
    if f.slow:
        rows = [[str(s.rank) if s.rank >= 0 else "(node)", s.node_id, f"{s.ratio:.2f}x", f"{s.excess_s * 1000:.0f} ms", f"{s.individual:.2f}x",
                 s.basis, datetime.fromtimestamp(s.since, timezone.utc).strftime("%H:%M:%SZ") if s.since else "-"]
                for s in f.slow]
        lines += _table(["SLOW RANK", "NODE", "VS OTHERS", "COST/STEP", "VS OWN BASELINE", "BASIS", "SINCE"], rows)
        if f.message:
            lines.append(f.message)
    if f.link_probe and f.link_probe not in f.message:
        lines.append(f"link probe: {f.link_probe}")
    h = f.hang
    if h.ranks_seen:
        ranks = ", ".join(str(r) for r in h.outlier_ranks) or "none (all stacks alike)"
        lines.append(f"last hang (generation {h.generation}): outlier rank(s) {ranks} on "
                     f"{', '.join(h.outlier_nodes) or '-'} in {h.outlier_frame or '-'}; others in "
                     f"{h.majority_frame or '-'} ({h.ranks_seen} ranks, {h.groups} stack groups, "
                     f"{h.repeats} in a row)")
    return lines + [""] if lines else lines


_INT64 = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def _int64_as_numbers(message: Any, doc: dict) -> None:
    """Turns the strings protobuf's JSON mapping gives 64-bit integers (``"step": "215"``) back into numbers, in
    place, walking ``message``'s descriptor (nested messages, repeated fields and map values too); scripts read
    ``w["step"] + 1``, and Python's JSON has no 53-bit limit to protect."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in doc:
            continue
        value, sub = doc[field.name], getattr(message, field.name)
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            kfield, vfield = kind.fields_by_name["key"], kind.fields_by_name["value"]
            for key in value:
                if vfield.message_type is not None and not vfield.message_type.full_name.startswith("google."):
                    native_key = key if kfield.cpp_type == FieldDescriptor.CPPTYPE_STRING else \
                        (key == "true" if kfield.cpp_type == FieldDescriptor.CPPTYPE_BOOL else int(key))
                    _int64_as_numbers(sub[native_key], value[key])
                elif vfield.cpp_type in _INT64:
                    value[key] = int(value[key])
        elif kind is not None:
            if kind.full_name.startswith("google."):
                continue  # well-known types (Timestamp, Duration, Struct) keep their JSON forms
            if field.is_repeated:
                for m, d in zip(sub, value):
                    _int64_as_numbers(m, d)
            else:
                _int64_as_numbers(sub, value)
        elif field.cpp_type in _INT64:
            doc[field.name] = [int(v) for v in value] if field.is_repeated else int(value)


def _to_json(message: Any) -> dict:
    """``message`` as a JSON-ready dict: every field (zero values too, so rank 0 has ``rank``), proto field
    names, and 64-bit integers as numbers."""
    doc = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
    _int64_as_numbers(message, doc)
    return doc


def format_event(e: common_pb2.HealthEvent, as_json: bool) -> str:
    """One event as one line (text or JSON)."""
    if as_json:
        return json.dumps(_to_json(e), separators=(",", ":"))
    sev = _enum(e.severity, common_pb2.Severity, "SEVERITY_")
    action = _enum(e.action, common_pb2.Action, "ACTION_").lower().replace("_", "-")
    subject = f" {e.subject}" if e.subject else ""
    return f"{event_time(e)} {sev:<8} {e.source} {e.kind}{subject}: {e.message} (action {action})"


# -- handlers ----------------------------------------------------------------------------------------------


def handle_status(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """``trainguard status``: prints the table (or JSON), once or every ``--watch`` seconds.

    With ``--watch``, an unreachable agent is noted and watched on: in the table's place, or with ``--json`` on
    ``err`` (default stderr), so ``out`` holds only health documents.
    """
    out = out or sys.stdout
    channel, address = open_channel(args)
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    try:
        def snapshot(pretty: bool) -> str:
            h = fetch(stub, address, args.events, args.timeout)
            subsystems, off = fetch_subsystems(channel, args.timeout)
            if args.json:
                doc = {**_to_json(h), "health_services": subsystems, "health_off": off}
                return json.dumps(doc, indent=2) if pretty else json.dumps(doc, separators=(",", ":"))
            return render(h, subsystems, off)

        if args.watch is None:
            print(snapshot(pretty=True), file=out)
            return 0
        clear = out.isatty() and not args.json
        while True:
            try:
                text = snapshot(pretty=False)
            except AgentError as exc:  # keep watching through an agent restart
                if args.json:
                    # stdout stays one JSON document per line (what `| jq` reads); the note goes where
                    # `events --follow` puts its reconnection notes.
                    print(f"trainguard: {exc}", file=err or sys.stderr, flush=True)
                    time.sleep(args.watch)
                    continue
                text = f"trainguard: {exc}"
            stamp = datetime.now(timezone.utc).strftime("%H:%M:%S")
            if clear:
                out.write("\x1b[H\x1b[2J" + f"every {args.watch:g}s  {address}  {stamp}\n\n")
            print(text, file=out, flush=True)
            if not args.json and not clear:
                print(file=out)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        channel.close()


def follow_events(stub: agent_pb2_grpc.NodeAgentStub, replay: int, min_severity: int,
                  renew_s: float = STREAM_RENEW_S, err: IO[str] | None = None,
                  stop: threading.Event | None = None, calls: list | None = None) -> Iterator[common_pb2.HealthEvent]:
    """Yields events until ``stop`` is set (forever without one): renews the stream every ``renew_s`` seconds,
    reconnects after errors, and drops events already yielded (by ``event_id``).

    Args:
        stub: NodeAgent stub.
        replay: recent events asked for on each (re)connection.
        min_severity: ``trainguard.v1.Severity`` value.
        renew_s: deadline of each stream call, in seconds.
        err: where reconnection notes go (default stderr).
        stop: when set, the stream ends; whoever sets it also cancels the call in ``calls`` so a blocked read
            returns at once.
        calls: if given, holds the live call as its only element (for that cancel).
    """
    err = err or sys.stderr
    stop = stop or threading.Event()
    seen: OrderedDict[str, None] = OrderedDict()
    backoff = 0.2
    refused = False  # the agent's streams are all taken: said once, until a stream is had again
    while not stop.is_set():
        call = stub.WatchEvents(agent_pb2.WatchEventsRequest(replay=replay, min_severity=min_severity),
                                timeout=renew_s)
        if calls is not None:
            calls[:] = [call]
        if stop.is_set():  # set between the check above and the call being published
            call.cancel()
            return
        try:
            for event in call:
                backoff = 0.2
                if refused:
                    print("trainguard: event stream open again", file=err, flush=True)
                    refused = False
                if event.event_id in seen:
                    continue
                seen[event.event_id] = None
                if len(seen) > _SEEN_IDS:
                    seen.popitem(last=False)
                yield event
        except grpc.RpcError as exc:
            if stop.is_set():
                return
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # renewal
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.UNAUTHENTICATED):
                raise
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # Every stream the agent allows is taken (one per launcher, per `events --follow`): only its
                # own words say which option to raise; a bare "RESOURCE_EXHAUSTED; reconnecting" every few
                # seconds said nothing.
                if not refused:
                    print(f"trainguard: the agent refuses another event stream ({exc.details()}); retrying until "
                          "one ends", file=err, flush=True)
                    refused = True
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            print(f"trainguard: event stream {exc.code().name}; reconnecting in {backoff:.1f}s", file=err, flush=True)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            continue
        # The server ended the stream (agent stopping): reconnect the same way.
        time.sleep(backoff)
        backoff = min(backoff * 2, 5.0)


def handle_events(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    """``trainguard events``: recent events, then (``--follow``) new ones until Ctrl-C."""
    out = out or sys.stdout
    if args.replay < 0:
        raise AgentError("--replay must be >= 0")
    if not args.follow and args.replay > MAX_HEALTH_EVENTS:
        # Without --follow the events come from GetHealth, which serves at most MAX_HEALTH_EVENTS.
        raise AgentError(f"--replay {args.replay}: at most {MAX_HEALTH_EVENTS} without --follow "
                         f"(with --follow up to {MAX_REPLAY})")
    min_sev = common_pb2.Severity.Value(f"SEVERITY_{args.min_severity.upper()}")
    channel, address = open_channel(args)
    stub = agent_pb2_grpc.NodeAgentStub(channel)
    try:
        if not args.follow:
            h = fetch(stub, address, args.replay, args.timeout)
            for e in h.recent_events:
                if e.severity >= min_sev:
                    print(format_event(e, args.json), file=out)
            return 0
        # Fail fast with one line when nothing answers, before streaming forever.
        fetch(stub, address, 0, args.timeout)
        stop, calls = threading.Event(), []

        def reader_gone() -> None:
            stop.set()
            for call in list(calls):
                call.cancel()

        try:
            watch_reader_gone(out.fileno(), reader_gone)
        except (AttributeError, OSError, ValueError):
            pass  # not a real file (tests hand in a StringIO): nothing to watch
        for e in follow_events(stub, args.replay, min_sev, stop=stop, calls=calls):
            print(format_event(e, args.json), file=out, flush=True)
        if stop.is_set():
            raise BrokenPipeError("the reader of stdout went away")  # ends with the usual 141, no traceback
        return 0
    except KeyboardInterrupt:
        return 0
    except grpc.RpcError as exc:
        raise _unreachable(address, exc) from exc
    finally:
        channel.close()
