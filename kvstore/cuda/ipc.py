"""CUDA IPC for the data planes (docs/design.md, Control plane and data planes): memory handles, inter-process
events and device matching by UUID, through the CUDA driver API (libcuda,
loaded by torch anyway) so no extra package is needed.

A handle names the whole allocation that holds a tensor; the exporter sends
the tensor's byte offset inside it, the importer opens the allocation once
and views tensors at offsets of it.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from kvstore.errors import FailedPrecondition, InvalidArgument

_cuda = None


def _lib():
    global _cuda
    if _cuda is None:
        torch.cuda.init()
        _cuda = ctypes.CDLL("libcuda.so.1")
    return _cuda


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise FailedPrecondition("ipc_handle", f"{what} failed: {name.value.decode() if name.value else rc}")


def _bind_context(device_index: int) -> None:
    """Make the device's primary context current on this thread: gRPC worker
    threads have none until something binds it, and the driver API needs it."""
    lib = _lib()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device_index)), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    lib.cuDevicePrimaryCtxRelease(dev)     # torch holds its own reference


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def check_allocator() -> None:
    """CUDA IPC cannot share memory from expandable segments or the async
    allocator: refuse to start with them, saying what to do."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    opts = {kv.split(":")[0].strip(): kv.split(":")[-1].strip() for kv in conf.split(",") if ":" in kv}
    if opts.get("expandable_segments", "False").lower() == "true":
        raise SystemExit("kvstore: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which CUDA IPC cannot "
                         "share; unset it (or set expandable_segments:False) for the daemon and its workers")
    if opts.get("backend", "") == "cudaMallocAsync":
        raise SystemExit("kvstore: PYTORCH_CUDA_ALLOC_CONF selects backend:cudaMallocAsync, whose memory CUDA IPC "
                         "handles cannot share; use the native allocator for the daemon and its workers")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_by_uuid(uuid: str) -> int:
    """Local device index of a GPU named by UUID (CUDA_VISIBLE_DEVICES may
    differ between processes)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise InvalidArgument("device_uuid", f"GPU {uuid} is not visible to the daemon")


@dataclass(slots=True)
class TensorHandle:
    handle: bytes          # 64-byte cuIpcMemHandle of the allocation
    offset: int            # byte offset of the tensor in it
    shape: tuple
    dtype: torch.dtype
    device_uuid: str


def export_tensor(t: torch.Tensor) -> TensorHandle:
    assert t.is_cuda and t.is_contiguous(), "export a contiguous CUDA tensor"
    lib = _lib()
    with torch.cuda.device(t.device):
        _bind_context(t.device.index or 0)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr())),
               "cuMemGetAddressRange")
        h = _IpcHandle()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
    # bytes(h), not h.reserved: a char array stops at its first NUL byte
    return TensorHandle(bytes(h), t.data_ptr() - base.value, tuple(t.shape), t.dtype,
                        device_uuid(t.device.index or 0))


class _CudaArray:
    """Just enough __cuda_array_interface__ for torch.as_tensor to view raw memory."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class ImportedAllocation:
    """An allocation of another process, opened once, viewed as uint8 bytes."""

    def __init__(self, handle: bytes, nbytes: int, device_index: int):
        if len(handle) != 64:
            raise InvalidArgument("ipc_handle", f"must be 64 bytes, got {len(handle)}")
        lib = _lib()
        self.device_index = device_index
        with torch.cuda.device(device_index):
            _bind_context(device_index)
            h = _IpcHandle()
            ctypes.memmove(ctypes.addressof(h), handle, 64)
            ptr = ctypes.c_uint64()
            _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, ctypes.c_uint(1)), "cuIpcOpenMemHandle")
            self.ptr = ptr.value
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
            if nbytes > size.value - (self.ptr - base.value):
                lib.cuIpcCloseMemHandle(ptr)
                raise InvalidArgument("size", f"{nbytes} bytes asked, the shared allocation has {size.value}")
            self.bytes = torch.as_tensor(_CudaArray(self.ptr, nbytes), device=f"cuda:{device_index}")

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize
        for s in shape:
            n *= s
        return self.bytes[offset:offset + n].view(dtype).view(*shape)

    def close(self) -> None:
        if self.ptr:
            self.bytes = None
            _lib().cuIpcCloseMemHandle(ctypes.c_uint64(self.ptr))
            self.ptr = 0


def import_tensor(h: TensorHandle) -> tuple[torch.Tensor, ImportedAllocation]:
    """-> (tensor, the allocation to keep open while the tensor is used)."""
    n = h.dtype.itemsize
    for s in h.shape:
        n *= s
    alloc = ImportedAllocation(h.handle, h.offset + n, device_by_uuid(h.device_uuid))
    return alloc.view(h.offset, h.shape, h.dtype), alloc


def event_pair(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """(ready, done): the client records ready after writing inputs; the daemon
    waits on it on its own stream, runs, records done; the client's stream waits
    on done before reading outputs. Nobody synchronises with the host."""
    with torch.cuda.device(device):
        return (torch.cuda.Event(interprocess=True, blocking=False),
                torch.cuda.Event(interprocess=True, blocking=False))


def open_event(device_index: int, handle: bytes) -> torch.cuda.Event:
    return torch.cuda.Event.from_ipc_handle(device_index, handle)
