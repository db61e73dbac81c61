"""checkpoint/ reviewed as a hostile new user would use it: inputs the format did not expect."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint.errors import CheckpointConfigError, CheckpointError, StorageUnavailableError


@pytest.mark.timeout(120)
def test_steps_from_ten_to_the_twelfth_are_listed_restored_and_retained(make_config, tmp_path) -> None:
    # A step counted in tokens seen passes 10**12 in a long run: its folder step_1000000000000 was written, but
    # the listing took only 12 digits, so the restore resumed from the last step below 10**12, with no word, and
    # retention never removed the newer folders.
    cfg = make_config(memory={"enabled": False}, disk={"keep": 2})
    steps = [999_999_999_999, 10**12, 10**12 + 7]
    with Checkpointer(cfg, job="tokens") as ck:
        for s in steps:
            assert ck.save({"w": torch.full((4,), float(s % 1000))}, s).wait(60)
        # Past 2**53-1 the coordinator refuses the step in every heartbeat and peers refuse its replicas.
        with pytest.raises(CheckpointError, match=r"0\.\.9007199254740991"):
            ck.save({"w": torch.zeros(4)}, 2**53)
        assert [(i.step, i.tiers) for i in ck.steps()] == [(s, ["disk"]) for s in steps[1:]]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "tokens").iterdir() if p.is_dir()) == [
        "step_1000000000000", "step_1000000000007"]
    state = {"w": torch.zeros(4)}
    with Checkpointer(cfg, job="tokens") as ck:
        assert ck.restore(state) == 10**12 + 7 and state["w"][0].item() == 7.0



@pytest.mark.parametrize("fields", [{"directory": " /data/ckpt"}, {"directory": "ckpt "},
                                    {"directory": "/data/ckpt", "memory": {"directory": "/dev/shm/tg\n"}},
                                    {"directory": "/data/ckpt", "remote": {"url": "s3://bucket/ckpt "}}])
def test_a_location_with_stray_whitespace_is_refused(fields) -> None:
    # CKPT=" /data/ckpt" (a config file's or an environment variable's stray space) made a folder " " under the
    # working directory, or a sibling "ckpt " of the intended one, and every checkpoint went there with no word.
    with pytest.raises(CheckpointConfigError, match="whitespace"):
        CheckpointConfig(**fields)


def test_the_hook_refuses_a_checkpoint_directory_with_stray_whitespace_before_writing(tmp_path, monkeypatch) -> None:
    import trainguard
    from trainguard.errors import TrainguardError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_DIR", "ckpt ")
    with pytest.raises(TrainguardError, match="whitespace"):
        trainguard.init(job="ws", save_every=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_mx_format_tensors_round_trip(make_config) -> None:
    # MXFP8's e8m0 block scales and FP4 weights (two per byte) were refused as "a dtype the format does not store",
    # so a model trained with them could not be checkpointed at all.
    raw = torch.tensor([1, 2, 127, 200, 255, 0], dtype=torch.uint8)
    state = {"scales": raw.clone().view(torch.float8_e8m0fnu), "fp4": raw.clone().view(torch.float4_e2m1fn_x2)}
    with Checkpointer(make_config(), job="mx") as ck:
        assert ck.save(state, 3).wait(60)
        back = {"scales": None, "fp4": torch.zeros(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
        assert ck.restore(back) == 3
    assert back["scales"].dtype == torch.float8_e8m0fnu and back["fp4"].dtype == torch.float4_e2m1fn_x2
    assert back["scales"].view(torch.uint8).tolist() == raw.tolist() == back["fp4"].view(torch.uint8).tolist()


def test_a_file_given_as_the_checkpoint_directory_is_named(make_config, tmp_path) -> None:
    # checkpoint_dir="model.pt" (the path of a checkpoint file): nothing was said at start, every save failed, and
    # restore() raised a bare NotADirectoryError into the training script (the hook raises only our errors).
    (tmp_path / "model.pt").write_bytes(b"weights")
    events = []
    ck = Checkpointer(make_config(directory=str(tmp_path / "model.pt")), job="file", on_event=events.append)
    try:
        assert any("which is a file, not a directory" in e.message for e in events), events
        with pytest.raises(StorageUnavailableError, match="give a directory, not a file"):
            ck.restore({"w": torch.zeros(2)})
    finally:
        ck.close()
    # A link to a filesystem that is not mounted is no file: it is named as what it is.
    (tmp_path / "mnt").symlink_to(tmp_path / "not-mounted")
    events.clear()
    with Checkpointer(make_config(directory=str(tmp_path / "mnt")), job="link", on_event=events.append):
        assert any("not-mounted, which does not exist" in e.message for e in events), events
