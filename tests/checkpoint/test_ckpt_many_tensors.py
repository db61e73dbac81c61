"""States of many small tensors (a mixture of experts' norms and biases and their Adam state): a review found each
tensor took a 4 KiB page of the data file and of every memory slot (164 MB per copy for 0.6 MB of values), and the
manifest's encoding on the training thread cost seconds per save. Figures: bench/bench_many_tensors.py."""

from __future__ import annotations

import json
from dataclasses import asdict

import torch
import xxhash

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.manifest import SMALL_ALIGNMENT, Manifest, plan_layout


def test_small_tensors_are_packed_and_large_ones_stay_on_alignment_boundaries() -> None:
    specs = [("a", "float32", (4,)), ("big", "float32", (1024,)), ("b", "int64", ()), ("c", "bool", (3,)),
             ("empty", "float32", (0, 3)), ("d", "bfloat16", (2, 5)), ("big2", "uint8", (4096,))]
    entries, total = plan_layout(specs, 4096)
    at = {e.key: (e.offset, e.nbytes) for e in entries}
    assert at["a"] == (0, 16) and at["big"] == (4096, 4096)  # 4096 bytes: on a page
    assert at["b"][0] == 8192 and at["c"][0] == 8192 + 64 and at["d"][0] == 8192 + 128  # packed by 64
    assert at["big2"] == (12288, 4096) and total == 16384  # the file's length stays a multiple of the alignment
    spans = sorted((o, o + n) for o, n in at.values() if n)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    assert all(o % SMALL_ALIGNMENT == 0 for o, _ in at.values())
    many, size = plan_layout([(f"p{i}", "float32", (4,)) for i in range(40000)], 4096)
    assert size <= 40000 * SMALL_ALIGNMENT + 4096  # 2.6 MB, where a page each took 164 MB


def test_the_manifest_bytes_are_the_canonical_json_every_reader_checks() -> None:
    # to_json no longer copies the manifest and encodes it once: the bytes must stay those of the canonical
    # encoding (sorted keys, no spaces, the checksum over the rest), or older readers would refuse new copies.
    entries, total = plan_layout([("w", "float32", (3, 2)), ("s", "int64", ())], 4096)
    man = Manifest(job="j", step=7, rank=1, world_size=2, tensors=entries, data_bytes=total, chunks=["00ff"],
                   tree={"t": "dict", "k": ["w", "é", 3], "v": [{"t": "tensor", "i": 0}, 1.5, None]},
                   sharded=True, location="loc")
    body = asdict(man)
    body["self_xxh3"] = xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    assert man.to_json() == json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert Manifest.from_json(man.to_json()) == man


def test_a_state_of_thousands_of_small_tensors_saves_compactly_and_restores_exactly(make_config, tmp_path) -> None:
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(500)])
    opt = torch.optim.Adam(params.parameters())
    sum(p.sum() for p in params).backward()
    opt.step()
    state = {"model": params, "optim": opt}
    with Checkpointer(make_config(), job="many") as ck:
        for step in range(3):  # both slots, then the first again: its cached views are reused
            want = [p.detach().clone() for p in params]
            ck.save(state, step, overlap_with=opt)
            opt.step()  # waits for the overlapped copy, then moves the parameters on
        assert ck.wait(timeout=60)
    data = next((tmp_path / "ckpt" / "many").glob("step_000000000002/rank_00000.data"))
    assert data.stat().st_size <= 2000 * SMALL_ALIGNMENT + 4096  # 2,000 tensors; a page each was 8.2 MB
    fresh = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4)) for _ in range(500)])
    opt2 = torch.optim.Adam(fresh.parameters())
    with Checkpointer(make_config(), job="many") as ck:
        assert ck.restore({"model": fresh, "optim": opt2}) == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh, want))


def test_a_slot_reused_with_another_layout_holds_the_new_state(make_config) -> None:
    # The tensors' places in a slot are kept from one save to the next; a state whose shapes changed (a layer
    # added, a tensor resized) must get new ones, on the same slot and on a slot that had to grow.
    with Checkpointer(make_config(memory={"keep": 1}), job="shapes") as ck:
        ck.save({"a": torch.full((4,), 1.0), "b": torch.full((2,), 2.0)}, 0)
        ck.save({"a": torch.full((4,), 1.0), "b": torch.full((2,), 2.0)}, 1)
        assert ck.wait(timeout=30)
        ck.save({"a": torch.full((2,), 3.0), "b": torch.full((4,), 4.0)}, 2)  # slot 0 again, other shapes
        ck.save({"a": torch.full((3000,), 5.0), "b": torch.full((2,), 6.0)}, 3)  # slot 1, grown
        assert ck.wait(timeout=30)
        for step, a, b in ((2, torch.full((2,), 3.0), torch.full((4,), 4.0)),
                           (3, torch.full((3000,), 5.0), torch.full((2,), 6.0))):
            got = {"a": torch.zeros_like(a), "b": torch.zeros_like(b)}
            assert ck.restore(got, step=step) == step
            assert torch.equal(got["a"], a) and torch.equal(got["b"], b), step


def test_first_saves_from_two_threads_both_land(make_config) -> None:
    # Found by a review: two threads making the first save() of one Checkpointer raced for the arena's lease,
    # and one failed with ArenaOwnedError blaming "another Checkpointer" (2 races in 3 without the fix; four
    # fresh Checkpointers race here). Calls now run one at a time.
    import threading

    for attempt in range(4):
        errors: list[BaseException] = []
        with Checkpointer(make_config(memory={"keep": 2}), job=f"threads{attempt}") as ck:
            go = threading.Barrier(2)

            def save(step: int) -> None:
                try:
                    go.wait()
                    ck.save({"w": torch.full((1 << 12,), float(step))}, step)
                except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                    errors.append(exc)
            threads = [threading.Thread(target=save, args=(s,)) for s in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, (attempt, errors)
            assert ck.wait(timeout=30)
            # Both landed; step 2 saved before step 1 is a job that went back, so step 2 is gone then (documented).
            steps = {i.step for i in ck.steps()}
            assert steps in ({1, 2}, {1}), steps
            newest = max(steps)
            live = {"w": torch.zeros(1 << 12)}
            assert ck.restore(live) == newest and torch.equal(live["w"], torch.full((1 << 12,), float(newest)))
