"""`trainguard status --json` / `events --json` documents: every field, zero values included, and integers as JSON
numbers (proto3's JSON mapping leaves zero fields out and writes 64-bit integers as strings)."""

from __future__ import annotations

import json

import pytest

from trainguard.agent.operator_cli import _to_json, format_event
from trainguard.proto import agent_pb2, common_pb2


def test_status_document_has_rank_zero_and_numeric_steps() -> None:
    h = agent_pb2.NodeHealth(node_id="vm", workers=[
        agent_pb2.WorkerStatus(rank=0, local_rank=0, pid=10, step=215),
        agent_pb2.WorkerStatus(rank=1, local_rank=1, pid=11, step=2**40)])
    doc = json.loads(json.dumps(_to_json(h)))
    w0, w1 = doc["workers"]
    assert (w0["rank"], w0["local_rank"], w0["exit_code"], w0["step"]) == (0, 0, 0, 215)
    assert w1["step"] == 2**40 and type(w1["step"]) is int
    for field in agent_pb2.NodeHealth.DESCRIPTOR.fields:  # nothing dropped at its default (unset messages aside)
        assert field.has_presence or field.name in doc, field.name


def test_event_line_gives_every_field() -> None:
    e = common_pb2.HealthEvent(source="agent", kind="agent.started")
    doc = json.loads(format_event(e, as_json=True))
    assert {f.name for f in common_pb2.HealthEvent.DESCRIPTOR.fields if not f.has_presence} <= set(doc)
    for f in common_pb2.HealthEvent.DESCRIPTOR.fields:
        if f.cpp_type in (f.CPPTYPE_INT64, f.CPPTYPE_UINT64) and not f.is_repeated and f.name in doc:
            assert type(doc[f.name]) is int, f.name


def _parse(*argv: str):
    import argparse

    from trainguard.agent.operator_cli import register

    parser = argparse.ArgumentParser(prog="trainguard")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, says", [
    (("status", "--target", "http://node7:7350"), "is a URL; give the agent's HOST:PORT"),
    (("status", "--target", "node7"), "is not HOST:PORT"),
    (("status", "--timeout", "0"), "above 0"),
    (("events", "--timeout", "nan"), "above 0"),
    (("status", "--watch", "-1"), "above 0"),
    (("status", "--events", "-3"), "outside 0-1000"),
    (("status", "--events", "5000"), "outside 0-1000"),
])
def test_bad_operator_flags_are_one_line_usage_errors_naming_the_flag(argv, says, capsys) -> None:
    # Before, these reached the agent and came back as "no node agent answers" (or a traceback from
    # time.sleep for --watch -1), sending the operator after a daemon that was running.
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}" in err and says in err


def test_good_operator_flags_parse() -> None:
    args = _parse("status", "--target", "[::1]:7350", "--timeout", "0.5", "--watch", "--events", "1000")
    assert (args.target, args.timeout, args.watch, args.events) == ("[::1]:7350", 0.5, 2.0, 1000)
    assert _parse("events", "--follow", "--replay", "10000").replay == 10000


def test_events_replay_beyond_get_health_limit_needs_follow() -> None:
    from trainguard.agent.errors import AgentError
    from trainguard.agent.operator_cli import handle_events

    with pytest.raises(AgentError, match="--replay 5000: at most 1000 without --follow"):
        handle_events(_parse("events", "--socket", "/nonexistent/agent.sock", "--replay", "5000"))
