"""Small host->GPU copies (block ids, slot maps, plan items) without stalls.

A copy from pageable memory waits for the stream to drain; `pin_memory()` on
every call allocates page-locked memory, which is slow and, while the GPU is
busy with earlier copies, cannot reuse what it cached. A fixed ring of pinned
slots, each guarded by an event, makes a small copy one memcpy into the next
free slot and one non-blocking DMA.
"""
from __future__ import annotations

import threading

import torch

SLOTS = 8
SLOT_ELEMS = 1 << 18        # int64 elements per slot (2 MiB)


class _Ring:
    def __init__(self):
        self.buf = torch.empty((SLOTS, SLOT_ELEMS), dtype=torch.int64, pin_memory=True)
        # One event per slot, made once and re-recorded: synchronize() waits
        # for its latest record, i.e. the slot's previous copy.
        self.events: list[torch.cuda.Event | None] = [None] * SLOTS
        self.recorded = [False] * SLOTS
        self.next = 0
        self.lock = threading.Lock()

    def copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = t.numel()
        with self.lock:
            i = self.next
            self.next = (i + 1) % SLOTS
            ev = self.events[i]
            if self.recorded[i]:
                ev.synchronize()        # only if the GPU is SLOTS copies behind
            src = self.buf[i, :n].view(-1)
            if t.dtype == torch.int64:
                src.copy_(t.reshape(-1))
                stage = src
            else:                       # reinterpret the slot's bytes as t's dtype
                stage = self.buf[i].view(torch.uint8)[: n * t.element_size()].view(t.dtype)
                stage.copy_(t.reshape(-1))
            out = torch.empty(t.shape, dtype=t.dtype, device=device)
            out.view(-1).copy_(stage, non_blocking=True)
            if ev is None:
                ev = self.events[i] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            self.recorded[i] = True
            return out


_ring: _Ring | None = None
_ring_lock = threading.Lock()


def block_table(rows: list[list[int]], device) -> torch.Tensor:
    """Ragged block-id lists -> int32 [len(rows), max len] (zero-padded) on device."""
    width = max(1, max(len(r) for r in rows))
    t = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)    # one op, not one per row
    return to_device(t, device)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """CPU tensor -> the same values on device, without synchronising."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    if t.numel() * t.element_size() > SLOT_ELEMS * 8:
        return t.pin_memory().to(device, non_blocking=True)
    global _ring
    if _ring is None:
        with _ring_lock:
            if _ring is None:
                _ring = _Ring()
    return _ring.copy(t.contiguous(), device)
