"""The client's registered buffers (arenas): a shared-memory or CUDA buffer
registered with the daemon once, into which each call stages its inputs and
reserves its outputs, and views of it a model may write into directly
(StepBuffers)."""
from __future__ import annotations

import math
import mmap
import os
import secrets
from dataclasses import dataclass

import torch

from kvstore.protocol import wire
from kvstore.v1 import kvstore_pb2 as pb


class ShmArena:
    """One shared-memory buffer, reused by every call (under the client's lock):
    inputs are packed from offset 0, outputs after them."""

    def __init__(self, size: int):
        self.name = f"kvstore-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join("/dev/shm", self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = self.top = size
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.cursor = 0
        self.buffer_id = ""
        self._typed: dict[tuple, tuple[torch.Tensor, pb.Tensor]] = {}

    def alloc(self, nbytes: int, align: int = 64) -> int:
        off = (self.cursor + align - 1) // align * align
        if off + nbytes > self.top:
            raise MemoryError
        self.cursor = off + nbytes
        return off

    def reserve(self, nbytes: int, align: int = 64) -> int:
        """Bytes at the top of the buffer that calls never stage into (step_buffers)."""
        off = (self.top - nbytes) // align * align
        if off < 0:
            raise MemoryError
        self.top = off
        return off

    def offset_of(self, t: torch.Tensor) -> int | None:
        """t's byte offset if it is a dense view of the reserved region, else None."""
        off = t.data_ptr() - self.view.data_ptr()
        # The address range first: it turns away most tensors without building
        # two torch.device objects (~1 µs a call on the per-step path).
        if (off < self.top or off + t.numel() * t.element_size() > self.size or not t.is_contiguous()
                or t.device != self.view.device):
            return None
        return off

    def typed(self, off: int, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, pb.Tensor]:
        """(view of bytes at off as shape/dtype, the Tensor message naming them),
        cached: calls of a decode loop name the same ranges every time."""
        key = (off, shape, dtype)
        hit = self._typed.get(key)
        if hit is None:
            if len(self._typed) >= 1024:
                self._typed.clear()
            nb = dtype.itemsize * math.prod(shape)
            hit = self._typed[key] = (self.view[off:off + nb].view(dtype).view(shape),
                                      pb.Tensor(shape=shape, dtype=wire.TO_PROTO[dtype],
                                                ref=pb.BufferRef(buffer_id=self.buffer_id, offset=off)))
        return hit

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class CudaArena:
    """A CUDA staging buffer shared with the daemon once (IPC handle) plus an
    interprocess event pair: inputs are written and `ready` recorded on the
    caller's stream; the daemon waits on it on its own stream and records
    `done` after writing outputs, which the caller's stream waits on. The
    host never synchronises."""

    def __init__(self, size: int, device: torch.device):
        from kvstore.cuda import ipc as cuda_ipc
        self.size = self.top = size
        self.view = torch.empty(size, dtype=torch.uint8, device=device)
        self.handle = cuda_ipc.export_tensor(self.view)
        self.ready, self.done = cuda_ipc.event_pair(device)
        self.cursor = 0
        self.buffer_id = ""
        self._typed: dict[tuple, tuple[torch.Tensor, pb.Tensor]] = {}

    alloc = ShmArena.alloc
    typed = ShmArena.typed
    reserve = ShmArena.reserve
    offset_of = ShmArena.offset_of

    def close(self) -> None:
        self.view = None


@dataclass(slots=True)
class StepBuffers:
    """Views of the client's registered buffer for one decode step of a batch
    (KVStoreClient.step_buffers): the model writes the new token's k, v and
    its q here, and append_attend(..., out=out) sends them with no staging
    copy and leaves the result in `out` with no read-back copy."""
    k: torch.Tensor          # [B, Hkv, d]
    v: torch.Tensor          # [B, Hkv, d]
    q: torch.Tensor          # [B, Hq, d]
    out: torch.Tensor        # [B, Hq, d]


def place(arena, t: torch.Tensor) -> int:
    """t's offset in the arena: where it already lies (a step_buffers view), or
    a staging range it is copied into (stream-ordered on CUDA)."""
    off = arena.offset_of(t)
    if off is None:
        off = arena.alloc(t.numel() * t.element_size())
        arena.typed(off, tuple(t.shape), t.dtype)[0].copy_(t.detach(), non_blocking=arena.view.is_cuda)
    return off
