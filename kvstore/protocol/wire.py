"""Tensors on the wire: proto Tensor <-> torch, inline bytes or a byte range
of a registered shared-memory buffer. Used by the servicer and the client."""
from __future__ import annotations

import math
import mmap
import os
import secrets
import threading

import torch

from kvstore.core.names import check_name
from kvstore.errors import InvalidArgument, NotFound, quote
from kvstore.v1 import kvstore_pb2 as pb

TO_TORCH = {pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16, pb.FLOAT32: torch.float32,
            pb.UINT8: torch.uint8, pb.INT32: torch.int32, pb.INT64: torch.int64}
TO_PROTO = {v: k for k, v in TO_TORCH.items()}
MAX_DIMS = 8
MAX_DIM = 1 << 31
MAX_VIEWS = 4096          # cached typed views of registered buffers (see BufferRegistry.view)


class BufferRegistry:
    """Shared-memory buffers a client registered once and names per call.

    NOTE: typed views of a buffer's bytes are cached by (buffer_id, offset,
    shape, dtype), since a client names the same ranges call after call.
    Unregistering a buffer drops its views under the lock, and a view is
    cached only while its buffer is registered, so a released buffer never
    serves a stale view (ids are random per registration, never reused)."""

    def __init__(self, shm_dir: str = "/dev/shm"):
        self.shm_dir = shm_dir
        self._bufs: dict[str, tuple[mmap.mmap, torch.Tensor, str]] = {}
        self._views: dict[tuple, torch.Tensor] = {}
        self.cuda_buffers = 0        # how many are CUDA buffers (none: calls skip the CUDA scope)
        self.generation = 0          # +1 per unregister: views and scopes resolved before it may be stale
        self._lock = threading.Lock()

    def register_shm(self, name: str, size: int, owner: str = "") -> str:
        check_name("name", name)     # a file name under shm_dir: no '/', ASCII
        if size <= 0:
            raise InvalidArgument("size", "must be > 0")
        path = os.path.join(self.shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound("name", f"no shared memory named {quote(name)}") from None
        except PermissionError:
            raise InvalidArgument("name", f"shared memory {quote(name)} is not readable and writable by the daemon") from None
        except OSError as e:   # ".", "..": a directory, not a shared-memory object
            raise InvalidArgument("name", f"cannot open shared memory {quote(name)}: {e.strerror}") from None
        try:
            have = os.fstat(fd).st_size
            if have < size:
                raise InvalidArgument("size", f"{size} bytes asked, shared memory {quote(name)} has {have}")
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
        from kvstore.cuda import ipc as cuda_ipc
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
            self.cuda_buffers += 1
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
            if entry is not None:
                self.generation += 1
                self.cuda_buffers -= buffer_id.startswith("cuda-")
                for key in [k for k in self._views if k[0] == buffer_id]:
                    del self._views[key]
        if entry is None:
            raise NotFound("buffer_id", f"no buffer {quote(buffer_id)}")
        # The mmap closes when the last tensor view of it is gone.

    def get(self, buffer_id: str) -> torch.Tensor:
        entry = self._bufs.get(buffer_id)
        if entry is None:
            raise NotFound("buffer_id", f"no buffer {quote(buffer_id)}")
        return entry[1]

    def view(self, buffer_id: str, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of a buffer as a tensor of shape and
        dtype; the caller has checked the range and alignment."""
        key = (buffer_id, offset, shape, dtype)
        v = self._views.get(key)
        if v is not None:
            return v
        v = self.get(buffer_id)[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape)
        with self._lock:
            if buffer_id in self._bufs:       # not unregistered meanwhile
                if len(self._views) >= MAX_VIEWS:
                    self._views.clear()
                self._views[key] = v
        return v

    def __len__(self) -> int:
        return len(self._bufs)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return dtype.itemsize * math.prod(shape)


def from_proto(t: pb.Tensor, buffers: BufferRegistry | None, field: str) -> torch.Tensor:
    """Decode a Tensor, checking dtype, shape and byte length against its data."""
    if t.dtype not in TO_TORCH:
        raise InvalidArgument(field, f"dtype {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype} "
                              "is missing or not supported")
    dtype = TO_TORCH[t.dtype]
    shape = tuple(t.shape)
    # Every dim bounded: an empty tensor passes the byte count with any other
    # dims, and torch.empty([0, 2**62]) overflows.
    if len(shape) > MAX_DIMS or not all(0 <= s <= MAX_DIM for s in shape):
        raise InvalidArgument(field, f"shape {list(shape)} is not a valid tensor shape (dims in [0, 2^31], "
                              f"at most {MAX_DIMS})")
    nbytes = _nbytes(shape, dtype)
    which = t.WhichOneof("data")
    if which == "inline":
        if len(t.inline) != nbytes:
            raise InvalidArgument(field, f"{len(t.inline)} bytes for shape {list(shape)} {dtype} ({nbytes} bytes)")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(t.inline), dtype=dtype).reshape(shape)
    if which == "ref":
        if buffers is None:
            raise InvalidArgument(field, "buffer references are not accepted here")
        ref = t.ref
        bid, off = ref.buffer_id, ref.offset
        size = buffers.get(bid).numel()
        if off % dtype.itemsize:
            raise InvalidArgument(field, f"offset {off} is not aligned to {dtype}")
        if off + nbytes > size:
            raise InvalidArgument(field, f"bytes [{off}, {off + nbytes}) outside buffer of {size} bytes")
        return buffers.view(bid, off, shape, dtype)
    raise InvalidArgument(field, "tensor has no data (neither inline nor ref)")


def to_proto(x: torch.Tensor, buffers: BufferRegistry | None = None, out: pb.OutputRef | None = None,
             field: str = "out") -> pb.Tensor:
    """Encode x; into the registered buffer range `out` if one is given."""
    x = x.detach()
    msg = pb.Tensor(shape=x.shape, dtype=TO_PROTO[x.dtype])
    if out is not None and out.buffer_id:
        place(x, buffers, out, field)
        msg.ref.buffer_id = out.buffer_id
        msg.ref.offset = out.offset
        return msg
    x = x.contiguous().cpu()
    msg.inline = x.view(torch.uint8).numpy().tobytes() if x.numel() else b""
    return msg


def place(x: torch.Tensor, buffers: BufferRegistry | None, out: pb.OutputRef | None, field: str = "out") -> None:
    """x into the registered buffer range `out` (nothing if out names none).
    A cached view on the buffer's device: a CUDA buffer gets no host round
    trip; no copy at all when x is that view already (the kernels wrote it)."""
    if out is None or not out.buffer_id:
        return
    x = x.detach()
    shape = tuple(x.shape)
    check_output(buffers, out, _nbytes(shape, x.dtype), x.dtype.itemsize, field)
    dst = buffers.view(out.buffer_id, out.offset, shape, x.dtype)
    if dst.data_ptr() != x.data_ptr() or dst.device != x.device:
        dst.copy_(x)


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
