"""The CUDA snapshot path (pinned shared-memory staging, side-stream copies, optimizer pre-hook ordering).

Runs only where a GPU is present; on CPU-only machines the same code path is covered with plain memory by
test_ckpt_overlap.py.
"""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import Checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_overlapped_snapshot_is_exact_and_restores_in_place(make_config):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 1024, device=dev)
    with Checkpointer(make_config(), job="cuda") as ck:
        for step in range(1, 4):
            model(x).sum().backward()
            expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            ck.save({"model": model, "optim": opt}, step, overlap_with=opt)
            opt.step()  # the pre-hook orders this after the side-stream copy
            opt.zero_grad()
            assert ck.wait(step, timeout=60)
        assert ck._copier._registered, "staging slots were not page-locked"
        live_w = model[0].weight
        assert ck.restore({"model": model, "optim": opt}, step=3) == 3
        assert model[0].weight is live_w and live_w.is_cuda
        for k, v in model.state_dict().items():
            assert torch.equal(v.cpu(), expected[k]), k


def test_cuda_small_shm_stages_in_pinned_host_memory(make_config, small_tmpfs):
    """In a container with a 64 MiB /dev/shm (here 1 MiB), a GPU job stages in page-locked anonymous memory."""
    dev = torch.device("cuda")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).to(dev)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 1024, device=dev)
    events = []
    cfg = make_config(memory={"directory": str(small_tmpfs)})  # fallback "auto" -> "host" with CUDA
    with Checkpointer(cfg, job="cuda-small", on_event=events.append) as ck:
        model(x).sum().backward()
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        ck.save({"model": model, "optim": opt}, 1, overlap_with=opt)
        opt.step()
        opt.zero_grad()
        assert ck.wait(1, timeout=60)
        assert ck.staging == "host" and [e.kind for e in events] == ["checkpoint.staging_fallback"]
        assert ck._copier._registered, "anonymous staging slots were not page-locked"
    model2 = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).to(dev)
    with Checkpointer(cfg, job="cuda-small") as ck2:
        assert ck2.restore({"model": model2, "optim": torch.optim.Adam(model2.parameters())}) == 1
    for k, v in model2.state_dict().items():
        assert torch.equal(v.cpu(), expected[k]), k
