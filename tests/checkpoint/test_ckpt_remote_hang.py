"""A remote that hangs (accepts the upload and never finishes it, like an object store endpoint that accepts
connections and never answers) must cost only the remote tier: ``save()`` keeps returning at memory speed, the
memory and disk tiers keep committing, and once the remote answers again the newest step is uploaded (older ones
waiting behind the hung upload are dropped and reported, not queued without bound). Found by a user's review:
every staging slot waited for its upload, so the third save blocked for as long as the remote hung.

The hung remote is real: a ``file://`` remote whose data file for step 1 is a FIFO nobody reads, so the upload's
``open`` blocks in the kernel exactly as a stalled socket write does, until the test starts reading it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.storage import data_name, step_dirname


class Events(list):
    def __call__(self, ev):
        self.append(ev)


def _drain(fifo: Path) -> threading.Thread:
    """Reads the FIFO to its end in the background: the hung upload completes."""
    def read() -> None:
        with open(fifo, "rb") as f:
            while f.read(1 << 16):
                pass

    th = threading.Thread(target=read, daemon=True)
    th.start()
    return th


def _wait_until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_hung_remote_never_blocks_save_and_the_newest_step_uploads_once_it_answers(make_config, tmp_path):
    remote = tmp_path / "remote"
    fifo = remote / "hung" / step_dirname(1) / data_name(0)
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    events = Events()
    cfg = make_config(remote={"url": f"file://{remote}", "keep": 5})
    drained: threading.Thread | None = None
    with Checkpointer(cfg, job="hung", on_event=events) as ck:
        try:
            saved = threading.Event()

            def train() -> None:
                for s in range(1, 9):
                    ck.save({"w": torch.full((50_000,), float(s))}, s)
                saved.set()

            threading.Thread(target=train, daemon=True).start()
            assert saved.wait(60), "save() blocked behind the hung upload of step 1"
            _wait_until(lambda: [s for s, _ in ck.disk.committed_steps()][-1:] == [8], "disk never reached step 8")
            assert [s.step for s in ck.steps()][-1] == 8  # memory and disk serve the newest step meanwhile
            assert ck.wait(8, timeout=1.0) is False  # its upload waits behind the hung one
            drained = _drain(fifo)  # the remote answers again
            assert ck.wait(8, timeout=60), "the newest step was never uploaded once the remote answered"
            committed = (remote / "hung" / "COMMITTED.json").read_text()
            assert '"step": 8' in committed or '"step":8' in committed, committed
            dropped = [e for e in events if "was saved before this upload could start" in e.message]
            assert dropped, [e.message for e in events]  # the steps overtaken while it hung are said, not queued
            assert not (remote / "hung" / step_dirname(4)).exists()
        finally:
            if drained is None:
                drained = _drain(fifo)  # never leave the persist process stuck on the FIFO
    drained.join(30)


def test_a_killed_persist_process_is_replaced_and_save_never_raises(make_config):
    """kill -9 of the persist process (an OOM kill) fails only the steps it had not finished, reported as events;
    the next save starts a new one and is durable (found by a user's review: every later save raised into the
    training loop, "the persist process died; create a new Checkpointer")."""
    import signal

    events = Events()
    cfg = make_config()
    with Checkpointer(cfg, job="killed", on_event=events) as ck:
        ck.save({"w": torch.full((1000,), 1.0)}, 1)
        assert ck.wait(1, timeout=30)
        first = ck.channel.proc
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        for s in (2, 3, 4):  # the first one finds the process gone; none of them raises
            ck.save({"w": torch.full((1000,), float(s))}, s)
        assert ck.wait(4, timeout=30) and ck.channel.proc.pid != first.pid
        assert any(e.evidence.get("tier") == "persist" and "persist process died" in e.message for e in events), \
            [e.message for e in events]
        w = torch.zeros(1000)
        assert ck.restore({"w": w}) == 4 and torch.equal(w, torch.full((1000,), 4.0))
