"""The snapshot phase: copying live tensors into a staging slot, optionally overlapped with compute.

CPU: plain ``copy_`` into the shared-memory slot (torch releases the GIL, so a background thread overlaps the
copy with the next forward/backward). CUDA: the slot is page-locked once with ``cudaHostRegister`` and the
device-to-host copies run ``non_blocking`` on a side stream that first waits for the compute stream; an event
marks their end.

Overlap contract (``Checkpointer.save(..., overlap_with=optimizer)``): tensors that only the optimizer mutates
(its parameters and its state tensors) may be copied after ``save`` returns; a step pre-hook on the optimizer
blocks (CPU) or makes the compute stream wait (CUDA) until the copy is done, so parameters are never mutated
mid-copy. Every other tensor (buffers such as BatchNorm statistics, RNG states, user tensors) is copied before
``save`` returns.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Sequence

import torch

log = logging.getLogger(__name__)


def storage_ptrs(optimizers: Iterable[Any]) -> set[int]:
    """Storage addresses of every parameter and state tensor of the given optimizers."""
    from trainguard.checkpoint.tree import is_dtensor

    def ptr(t: torch.Tensor) -> int:
        # A DTensor (FSDP2 parameter or its optimizer state) is saved through its local shard.
        return (t.to_local() if is_dtensor(t) else t).untyped_storage().data_ptr()

    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(ptr(p))
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 0:
                    ptrs.add(ptr(v))
    return ptrs


class PendingCopy:
    """Copies still running after ``save`` returned (overlap mode).

    ``wait()`` blocks until they are done (CPU) or, on CUDA, makes the current stream wait for them.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        #: set once the callback that hands the copy on (the persist request) has run too
        self._settled = threading.Event()
        self._error: BaseException | None = None
        self.cuda_event: Any = None

    def finish(self, error: BaseException | None = None) -> None:
        """Marks the copy finished (called by the copying thread)."""
        self._error = error
        self._done.set()

    def settle(self) -> None:
        """Marks the copy's follow-up done (called by the copying thread after its callback)."""
        self._settled.set()

    def wait_host(self, timeout: float | None = None) -> bool:
        """Blocks the calling thread until the copy finished and its callback ran; returns False on timeout.

        The copy alone is not enough here: ``Checkpointer.close()`` waited for it, found no persist request
        yet (the callback sends it) and unmapped the slot under the callback, so a step saved with
        ``overlap_with`` and then closed without ``wait()`` was never written. The optimizer's pre-hook, which
        only needs the bytes copied, uses :meth:`wait_before_mutation`.
        """
        return self._settled.wait(timeout)

    def wait_before_mutation(self) -> None:
        """Called before parameters change: GPU copies order the compute stream after them, CPU copies block."""
        if self.cuda_event is not None and not self._done.is_set():
            torch.cuda.current_stream().wait_event(self.cuda_event)
            return
        self._done.wait()

    @property
    def done(self) -> bool:
        """True once finished."""
        return self._done.is_set()

    @property
    def settled(self) -> bool:
        """True once finished and its callback (the persist request) ran."""
        return self._settled.is_set()

    @property
    def error(self) -> BaseException | None:
        """The copy's exception, if any."""
        return self._error


class SnapshotCopier:
    """Copies tensors into a staging buffer, on a CUDA side stream when tensors live on a GPU."""

    def __init__(self) -> None:
        self._stream: Any = None
        self._registered: dict[int, int] = {}
        self._pin_warned = False

    def pin(self, staging: torch.Tensor) -> None:
        """Page-locks a staging buffer once so device-to-host copies are true DMA (CUDA only; no-op on CPU)."""
        if not torch.cuda.is_available():
            return
        ptr, size = staging.data_ptr(), staging.numel()
        if self._registered.get(ptr) == size:
            return
        rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(rc) != 0:
            # Still correct without pinning (copies become staged through pageable memory), only slower; one
            # warning per copier, not one per slot.
            (log.debug if self._pin_warned else log.warning)(
                "cudaHostRegister of a %d-byte staging buffer failed (code %d); device-to-host snapshot copies "
                "will not overlap", size, int(rc))
            self._pin_warned = True
            return
        self._registered[ptr] = size

    def unpin_all(self) -> None:
        """Undoes :meth:`pin` for every registered buffer."""
        if self._registered and torch.cuda.is_available():
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()

    def copy_now(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies ``(src, dst)`` pairs and returns when all are complete."""
        cuda_pairs = [(s, d) for s, d in pairs if s.is_cuda]
        with torch.no_grad():
            for s, d in pairs:
                if not s.is_cuda:
                    d.copy_(s)
        if cuda_pairs:
            self._cuda_copy(cuda_pairs).synchronize()

    def copy_async(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   then: Callable[[BaseException | None], None]) -> PendingCopy:
        """Starts copying ``(src, dst)`` pairs in the background; ``then(error)`` runs after they finished.

        Returns:
            A :class:`PendingCopy` the optimizer pre-hook waits on.
        """
        pending = PendingCopy()
        cuda_pairs = [(s, d) for s, d in pairs if s.is_cuda]
        cpu_pairs = [(s, d) for s, d in pairs if not s.is_cuda]
        if cuda_pairs:
            pending.cuda_event = self._cuda_copy(cuda_pairs)

        def run() -> None:
            err: BaseException | None = None
            try:
                with torch.no_grad():
                    for s, d in cpu_pairs:
                        d.copy_(s)
                if pending.cuda_event is not None:
                    pending.cuda_event.synchronize()
            except BaseException as exc:  # reported through then(); never kills the thread silently
                err = exc
            pending.finish(err)
            try:
                then(err)
            finally:
                pending.settle()

        threading.Thread(target=run, name="trainguard-snapshot", daemon=True).start()
        return pending

    def _cuda_copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        compute = torch.cuda.current_stream()
        self._stream.wait_stream(compute)  # copy the values as of now, after queued kernels wrote them
        with torch.cuda.stream(self._stream), torch.no_grad():
            for s, d in pairs:
                s.record_stream(self._stream)
                d.copy_(s, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return ev
