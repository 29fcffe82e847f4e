"""Tensors on the wire: proto Tensor <-> torch, inline bytes or a byte range
of a registered shared-memory buffer. Used by the servicer and the client."""
from __future__ import annotations

import mmap
import os
import re
import secrets
import threading

import torch

from .errors import InvalidArgument, NotFound
from .v1 import kvstore_pb2 as pb

TO_TORCH = {pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16, pb.FLOAT32: torch.float32,
            pb.UINT8: torch.uint8, pb.INT32: torch.int32, pb.INT64: torch.int64}
TO_PROTO = {v: k for k, v in TO_TORCH.items()}
MAX_DIMS = 8
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class BufferRegistry:
    """Shared-memory buffers a client registered once and names per call."""

    def __init__(self, shm_dir: str = "/dev/shm"):
        self.shm_dir = shm_dir
        self._bufs: dict[str, tuple[mmap.mmap, torch.Tensor, str]] = {}
        self._lock = threading.Lock()

    def register_shm(self, name: str, size: int, owner: str = "") -> str:
        if not _SHM_NAME.match(name or ""):
            raise InvalidArgument("name", f"shared-memory name {name!r} must match [A-Za-z0-9._-]{{1,200}}")
        if size <= 0:
            raise InvalidArgument("size", "must be > 0")
        path = os.path.join(self.shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound("name", f"no shared memory named {name!r}") from None
        except PermissionError:
            raise InvalidArgument("name", f"shared memory {name!r} is not readable and writable by the daemon") from None
        except OSError as e:   # ".", "..": a directory, not a shared-memory object
            raise InvalidArgument("name", f"cannot open shared memory {name!r}: {e.strerror}") from None
        try:
            have = os.fstat(fd).st_size
            if have < size:
                raise InvalidArgument("size", f"{size} bytes asked, shared memory {name!r} has {have}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        buffer_id = "shm-" + secrets.token_hex(8)
        with self._lock:
            self._bufs[buffer_id] = (mm, view, owner)
        return buffer_id

    def register_cuda(self, handle: bytes, offset: int, size: int, device_uuid: str,
                      ready_event: bytes, done_event: bytes, owner: str = "") -> str:
        """Open a client's CUDA staging buffer (once) and its event pair."""
        from . import cuda_ipc
        if size <= 0:
            raise InvalidArgument("size", "must be > 0")
        if not torch.cuda.is_available():
            raise InvalidArgument("kind", "the daemon has no CUDA device; register SHM buffers instead")
        dev = cuda_ipc.device_by_uuid(device_uuid)
        alloc = cuda_ipc.ImportedAllocation(handle, offset + size, dev)
        view = alloc.bytes[offset:offset + size]
        events = None
        if ready_event or done_event:
            try:
                events = (cuda_ipc.open_event(dev, ready_event), cuda_ipc.open_event(dev, done_event))
            except Exception as e:  # a malformed handle: refuse, and let go of the memory
                alloc.close()
                raise InvalidArgument("ready_event", f"cannot open the interprocess events: {e}") from None
        buffer_id = "cuda-" + secrets.token_hex(8)
        with self._lock:
            self._bufs[buffer_id] = ((alloc, events), view, owner)
        return buffer_id

    def cuda_events(self, buffer_id: str):
        """(ready, done) events of a CUDA buffer, or None."""
        entry = self._bufs.get(buffer_id)
        if entry is None or not buffer_id.startswith("cuda-"):
            return None
        return entry[0][1]

    def unregister(self, buffer_id: str) -> None:
        with self._lock:
            entry = self._bufs.pop(buffer_id, None)
        if entry is None:
            raise NotFound("buffer_id", f"no buffer {buffer_id!r}")
        # The mmap closes when the last tensor view of it is gone.

    def get(self, buffer_id: str) -> torch.Tensor:
        entry = self._bufs.get(buffer_id)
        if entry is None:
            raise NotFound("buffer_id", f"no buffer {buffer_id!r}")
        return entry[1]

    def __len__(self) -> int:
        return len(self._bufs)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def from_proto(t: pb.Tensor, buffers: BufferRegistry | None, field: str) -> torch.Tensor:
    """Decode a Tensor, checking dtype, shape and byte length against its data."""
    if t.dtype not in TO_TORCH:
        raise InvalidArgument(field, f"dtype {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype} "
                              "is missing or not supported")
    dtype = TO_TORCH[t.dtype]
    shape = list(t.shape)
    if len(shape) > MAX_DIMS or any(s < 0 for s in shape):
        raise InvalidArgument(field, f"shape {shape} is not a valid tensor shape")
    nbytes = _nbytes(shape, dtype)
    which = t.WhichOneof("data")
    if which == "inline":
        if len(t.inline) != nbytes:
            raise InvalidArgument(field, f"{len(t.inline)} bytes for shape {shape} {dtype} ({nbytes} bytes)")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(t.inline), dtype=dtype).reshape(shape)
    if which == "ref":
        if buffers is None:
            raise InvalidArgument(field, "buffer references are not accepted here")
        buf = buffers.get(t.ref.buffer_id)
        off = t.ref.offset
        if off % torch.empty((), dtype=dtype).element_size():
            raise InvalidArgument(field, f"offset {off} is not aligned to {dtype}")
        if off + nbytes > buf.numel():
            raise InvalidArgument(field, f"bytes [{off}, {off + nbytes}) outside buffer of {buf.numel()} bytes")
        return buf[off:off + nbytes].view(dtype).reshape(shape)
    raise InvalidArgument(field, "tensor has no data (neither inline nor ref)")


def to_proto(x: torch.Tensor, buffers: BufferRegistry | None = None, out: pb.OutputRef | None = None,
             field: str = "out") -> pb.Tensor:
    """Encode x; into the registered buffer range `out` if one is given."""
    into = buffers.get(out.buffer_id) if out is not None and out.buffer_id else None
    # Stay on the device when the output goes to a CUDA buffer: no host round trip.
    x = x.detach().contiguous().to(into.device if into is not None else "cpu")
    msg = pb.Tensor(shape=list(x.shape), dtype=TO_PROTO[x.dtype])
    raw = x.view(torch.uint8).reshape(-1) if x.numel() else torch.empty(0, dtype=torch.uint8, device=x.device)
    if into is not None:
        check_output(buffers, out, raw.numel(), x.element_size(), field)
        into[out.offset:out.offset + raw.numel()].copy_(raw)
        msg.ref.buffer_id = out.buffer_id
        msg.ref.offset = out.offset
    else:
        msg.inline = raw.numpy().tobytes()
    return msg


def check_output(buffers: BufferRegistry | None, out: pb.OutputRef | None, nbytes: int, align: int, field: str) -> None:
    """Refuse a bad output range before any state changes."""
    if out is None or not out.buffer_id:
        return
    if buffers is None:
        raise InvalidArgument(field, "buffer references are not accepted here")
    buf = buffers.get(out.buffer_id)
    if out.offset % align or out.offset + nbytes > buf.numel():
        raise InvalidArgument(field, f"output needs bytes [{out.offset}, {out.offset + nbytes}) "
                              f"of a {buf.numel()}-byte buffer, aligned to {align}")
