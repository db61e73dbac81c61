"""`trainguard status --json` / `events --json` documents: every field, zero values included, and integers as JSON
numbers (proto3's JSON mapping leaves zero fields out and writes 64-bit integers as strings)."""

from __future__ import annotations

import json

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
