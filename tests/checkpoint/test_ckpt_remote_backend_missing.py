"""A remote URL whose fsspec backend package is not installed (s3:// without s3fs) is a configuration error at
start that names the package, not an outage: it was reported as "cannot reach", the remote tier was retried for
ever, and the job ran without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fsspec.registry import known_implementations

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.errors import CheckpointConfigError


def _missing() -> tuple[str, str]:
    """A protocol fsspec knows whose backend package is not installed in this venv, and that package."""
    for protocol in ("s3", "gs", "abfs", "oci", "webdav", "dropbox"):
        known = known_implementations.get(protocol)
        if known and importlib.util.find_spec(known["class"].split(".", 1)[0]) is None:
            return protocol, known["class"].split(".", 1)[0]
    pytest.skip("every candidate backend is installed here")


@pytest.mark.parametrize("chained", [False, True])
def test_a_missing_backend_package_is_a_config_error_naming_it(make_config, chained) -> None:
    protocol, package = _missing()
    url = f"{'simplecache::' if chained else ''}{protocol}://bucket/x"
    with pytest.raises(CheckpointConfigError, match=rf"pip install {package} .*checkpoint\.remote\.url"):
        with Checkpointer(make_config(remote={"url": url}), job="j") as ck:
            ck.save({"t": torch.zeros(4)}, 1)
