"""Tensors on the wire: proto Tensor <-> torch, inline bytes or a byte range
of a registered buffer. Used by the servicer and the client; `buffers` is the
daemon's view of the registered buffers (service/buffers.py), None where
references are not accepted (the client reading a reply, remote callers)."""
from __future__ import annotations

import math

import torch

from kvstore.errors import InvalidArgument, NotFound
from kvstore.v1 import kvstore_pb2 as pb

TO_TORCH = {pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16, pb.FLOAT32: torch.float32,
            pb.UINT8: torch.uint8, pb.INT32: torch.int32, pb.INT64: torch.int64}
TO_PROTO = {v: k for k, v in TO_TORCH.items()}
MAX_DIMS = 8
MAX_DIM = 1 << 31


# what a caller that cannot name a registered buffer (buffers None) is told: one over TCP
NO_REFS = "buffer references are only for callers on the Unix socket; over TCP tensors go inline"


def _nbytes(shape, dtype: torch.dtype) -> int:
    return dtype.itemsize * math.prod(shape)


def from_proto(t: pb.Tensor, buffers, field: str) -> torch.Tensor:
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
    # Nor may the dims but the zeros multiply past int64: torch lays out an empty
    # tensor's strides (and storage) by them and overflows.
    if math.prod(max(s, 1) for s in shape) * dtype.itemsize >= 1 << 62:
        raise InvalidArgument(field, f"shape {list(shape)} is not a valid tensor shape (its nonzero dims multiply "
                              "past what a tensor can index)")
    nbytes = _nbytes(shape, dtype)
    which = t.WhichOneof("data")
    if which == "inline":
        if len(t.inline) != nbytes:
            raise InvalidArgument(field, f"{len(t.inline)} bytes for shape {list(shape)} {pb.DType.Name(t.dtype)} "
                                         f"({nbytes} bytes)")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(t.inline), dtype=dtype).reshape(shape)
    if which == "ref":
        if buffers is None:
            raise InvalidArgument(field, NO_REFS)
        ref = t.ref
        bid, off = ref.buffer_id, ref.offset
        size = _buffer(buffers, bid, f"{field}.ref.buffer_id").numel()
        if off % dtype.itemsize:
            raise InvalidArgument(field, f"offset {off} is not aligned to {pb.DType.Name(t.dtype)} "
                                         f"({dtype.itemsize} bytes)")
        if off + nbytes > size:
            raise InvalidArgument(field, f"bytes [{off}, {off + nbytes}) outside buffer of {size} bytes")
        return buffers.view(bid, off, shape, dtype)
    raise InvalidArgument(field, "tensor has no data (neither inline nor ref)")


def to_proto(x: torch.Tensor, buffers = None, out: pb.OutputRef | None = None,
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


def place(x: torch.Tensor, buffers, out: pb.OutputRef | None, field: str = "out") -> None:
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


def _buffer(buffers, buffer_id: str, field: str) -> torch.Tensor:
    """The registered buffer a reference names; NotFound naming the reference's field."""
    try:
        return buffers.get(buffer_id)
    except NotFound as e:
        raise NotFound(field, e.message) from None


def check_output(buffers, out: pb.OutputRef | None, nbytes: int, align: int, field: str) -> None:
    """Refuse a bad output range before any state changes."""
    if out is None or not out.buffer_id:
        return
    if buffers is None:
        raise InvalidArgument(field, NO_REFS)
    buf = _buffer(buffers, out.buffer_id, f"{field}.buffer_id")
    if out.offset % align or out.offset + nbytes > buf.numel():
        raise InvalidArgument(field, f"output needs bytes [{out.offset}, {out.offset + nbytes}) "
                              f"of a {buf.numel()}-byte buffer, aligned to {align}")
