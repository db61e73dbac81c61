"""`trainguard.init(checkpoint_options=...)`: a key the checkpoint config does not have is named, as inside a tier."""

from __future__ import annotations

import pytest

import trainguard
from trainguard.checkpoint.errors import CheckpointConfigError


def test_unknown_or_directory_option_is_a_config_error_naming_it(tmp_path, monkeypatch):
    # Both were TypeErrors from the dataclass ("unexpected keyword argument", "multiple values"), while
    # {"disk": {"kep": 1}} already got a CheckpointConfigError naming the key and the keys there are.
    for var in ("RANK", "WORLD_SIZE", "TRAINGUARD_AGENT_SOCKET", "TRAINGUARD_JOB"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(CheckpointConfigError, match=r"unknown key\(s\) 'overwite'; known keys: .*overwrite"):
        trainguard.init(checkpoint_dir=str(tmp_path), save_every=5, checkpoint_options={"overwite": True})
    with pytest.raises(CheckpointConfigError, match=r"checkpoint_options\['directory'\]: .*checkpoint_dir="):
        trainguard.init(checkpoint_dir=str(tmp_path), checkpoint_options={"directory": str(tmp_path / "b")})
    session = trainguard.init(checkpoint_dir=str(tmp_path), save_every=5, checkpoint_options={"overwrite": True})
    session.close()
