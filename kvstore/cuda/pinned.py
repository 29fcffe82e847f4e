"""Small host->GPU copies (block ids, slot maps, plan items) without stalls.

A copy from pageable memory waits for the stream to drain; `pin_memory()` on
every call allocates page-locked memory, which is slow and, while the GPU is
busy with earlier copies, cannot reuse what it cached. A fixed ring of pinned
slots, each guarded by an event, makes a small copy one memcpy into the next
free slot and one non-blocking DMA.
"""
from __future__ import annotations

import threading

import numpy as np

import torch

SLOTS = 8                   # to start with; the ring grows while the GPU is behind
MAX_SLOTS = 128
SLOT_ELEMS = 1 << 17        # int64 elements per slot (1 MiB)


class _Ring:
    def __init__(self):
        self.bufs = [self._slot() for _ in range(SLOTS)]
        self.events: list[torch.cuda.Event | None] = [None] * SLOTS
        self.next = 0
        self.lock = threading.Lock()
        # (slot buffer, device index) -> its event, re-recorded per copy: a new
        # torch.cuda.Event per copy cost ~5-10 µs of a decode step. A slot is
        # handed out again only once its last record has completed (_advance),
        # so re-recording never hides a copy still in flight.
        self._own: dict[tuple[int, int], torch.cuda.Event] = {}

    @staticmethod
    def _slot() -> torch.Tensor:
        return torch.empty(SLOT_ELEMS, dtype=torch.int64, pin_memory=True)

    def acquire(self) -> tuple[int, torch.Tensor]:
        """The next free slot (index, buffer); it stays taken until release()."""
        with self.lock:
            i = self._advance()
            self.events[i] = _TAKEN
            return i, self.bufs[i]

    def _advance(self) -> int:
        """The next slot whose last copy has run (under self.lock)."""
        i = self.next
        ev = self.events[i]
        if ev is not None and not ev.query():
            # The copy that used this slot has not run yet: the stream is
            # waiting behind other work (a client's step, for the daemon).
            # Waiting here would tie the host to that work, so grow instead.
            if len(self.bufs) < MAX_SLOTS:
                self.bufs.insert(i, self._slot())
                self.events.insert(i, None)
            else:
                ev.synchronize()
        self.next = (i + 1) % len(self.bufs)
        return i

    def release(self, i: int, buf: torch.Tensor, device: torch.device | None) -> None:
        """Free slot i once the copies from it enqueued on device's current stream
        have run (device None: nothing was copied)."""
        ev = None
        if device is not None:
            ev = self._event(buf, device)
            ev.record(torch.cuda.current_stream(device))
        with self.lock:
            # The ring may have grown meanwhile: find the slot by its buffer.
            j = i if i < len(self.bufs) and self.bufs[i] is buf else next(
                k for k, b in enumerate(self.bufs) if b is buf)
            self.events[j] = ev

    def copy(self, t: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
        n = t.numel()
        with self.lock:
            i = self._advance()
            buf = self.bufs[i]
            if t.dtype == torch.int64:
                stage = buf[:n]
                stage.copy_(t.reshape(-1))
            else:                       # reinterpret the slot's bytes as t's dtype
                stage = buf.view(torch.uint8)[: n * t.element_size()].view(t.dtype)
                stage.copy_(t.reshape(-1))
            if out is None:
                out = torch.empty(t.shape, dtype=t.dtype, device=device)
            out.view(-1).copy_(stage, non_blocking=True)
            ev = self.events[i] = self._event(buf, device)
            ev.record(torch.cuda.current_stream(device))
            return out

    def _event(self, buf: torch.Tensor, device) -> torch.cuda.Event:
        """The slot's event for device (the ring serves every device)."""
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (buf.data_ptr(), index)
        ev = self._own.get(key)
        if ev is None:
            with torch.cuda.device(index):
                ev = self._own[key] = torch.cuda.Event()
        return ev


class _Taken:
    """The event of a slot that acquire() handed out and release() has not
    given back: never complete, so copy()/acquire() pass it by."""

    @staticmethod
    def query() -> bool:
        return False

    @staticmethod
    def synchronize() -> None:
        raise RuntimeError("pinned ring: every slot is taken")


_TAKEN = _Taken()
_ring: _Ring | None = None
_ring_lock = threading.Lock()
_staging = threading.local()
STAGED_BYTES = 1 << 18      # device bytes of one staged() batch; larger tensors copy on their own


class _Batch:
    """The host -> device copies of one step as one: see staged()."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slot, self.host = _get_ring().acquire()
        self.host8 = self.host.view(torch.uint8)
        self.host_np = self.host8.numpy()       # numpy slicing: ~1 µs a copy, torch's ~5
        self.dev = torch.empty(STAGED_BYTES, dtype=torch.uint8, device=device)
        self.used = 0

    def add(self, t: torch.Tensor) -> torch.Tensor | None:
        """A device view that will hold t's values once flushed; None if t does not fit."""
        nbytes = t.numel() * t.element_size()
        off = (self.used + 15) // 16 * 16
        if off + nbytes > STAGED_BYTES:
            return None
        self.used = off + nbytes
        if nbytes:
            try:
                self.host_np[off:off + nbytes] = t.reshape(-1).numpy().view(np.uint8)
            except TypeError:       # a dtype numpy lacks (bfloat16)
                self.host8[off:off + nbytes].view(t.dtype).copy_(t.reshape(-1))
        return self.dev[off:off + nbytes].view(t.dtype).view(t.shape)

    def flush(self) -> None:
        copied = self.used > 0
        if copied:
            self.dev[:self.used].copy_(self.host8[:self.used], non_blocking=True)
        _get_ring().release(self.slot, self.host, self.device if copied else None)


class staged:
    """`with staged(device): ...`: the to_device() calls of the block (same
    device, CPU tensors) return views of one device buffer, filled by a single
    copy from one pinned slot when the block ends. For the small index tensors
    of a decode step (block tables, plan items): one ~10 µs copy instead of one
    per tensor (~50 µs each, measured). The views hold their values only
    after the block: launch nothing that reads them inside it. Nested blocks
    join the outer one."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.batch = None

    def __enter__(self):
        if self.device.type == "cuda" and getattr(_staging, "batch", None) is None:
            self.batch = _staging.batch = _Batch(self.device)
        return self

    def __exit__(self, *exc):
        if self.batch is not None:
            _staging.batch = None
            self.batch.flush()


def host_table(rows, cols: int | None = None) -> torch.Tensor:
    """Ragged block-id rows (lists, arrays, protobuf repeated fields) -> int32
    [len(rows), cols or the longest] on the host, zero-padded. numpy converts a
    row in C; torch.tensor(list) costs ~0.5 us per element, 10 ms for a B=8
    step at 32K context."""
    n = max([1] + [len(r) for r in rows]) if cols is None else cols
    t = np.zeros((len(rows), n), dtype=np.int32)
    for i, r in enumerate(rows):
        if len(r) > n:
            raise ValueError(f"row {i} has {len(r)} blocks, the table {n} columns")
        if len(r):
            t[i, :len(r)] = r
    return torch.from_numpy(t)


def block_table(rows, device) -> torch.Tensor:
    """Ragged block-id rows -> int32 [len(rows), max len] (zero-padded) on device."""
    return to_device(host_table(rows), device)


def _get_ring() -> _Ring:
    global _ring
    if _ring is None:
        with _ring_lock:
            if _ring is None:
                _ring = _Ring()
    return _ring


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """CPU tensor -> the same values on device, without synchronising."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    batch = getattr(_staging, "batch", None)
    if (batch is not None and t.device.type == "cpu"
            and (device.index is None or device.index == batch.device.index)):
        out = batch.add(t)
        if out is not None:
            return out
    if t.numel() * t.element_size() > SLOT_ELEMS * 8:
        return t.pin_memory().to(device, non_blocking=True)
    return _get_ring().copy(t.contiguous(), device)


def copy_into(dst: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Host values t -> the existing tensor dst (same numel and dtype), stream-ordered.

    For buffers a captured CUDA graph reads: their address must not change, only
    their contents, and the copy must land after the replays queued before it."""
    if dst.numel() != t.numel() or dst.dtype != t.dtype:
        raise ValueError(f"copy_into: {tuple(t.shape)} {t.dtype} does not fit {tuple(dst.shape)} {dst.dtype}")
    if not dst.is_contiguous():
        raise ValueError("copy_into: the destination must be contiguous")
    if dst.device.type != "cuda":
        dst.view(-1).copy_(t.reshape(-1))
        return dst
    if t.numel() * t.element_size() > SLOT_ELEMS * 8:
        dst.view(-1).copy_(t.reshape(-1).pin_memory(), non_blocking=True)
        return dst
    return _get_ring().copy(t.contiguous(), dst.device, out=dst)
