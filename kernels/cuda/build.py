"""Compile and launch the CUDA C++ kernels of this folder (NVRTC through CuPy RawModule).

A kernel source (`attention.cu`, `merge.cu`, `encode.cu`) names the headers it needs with
`#include "x.cuh"`; `source()` inlines them (each once, in order) so that NVRTC gets one
self-contained string: CuPy's compile cache is keyed by that string, so an edited header
can never reach the GPU as a stale cached module.

CuPy is imported on first use only: CPU machines never import it. `available()` is the
router's gate for every CUDA C++ kernel (kernels/router.py).
"""
from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

from .. import tunables

_DIR = os.path.dirname(os.path.abspath(__file__))
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)
_cupy = None
_cupy_failed = False
_functions: dict = {}
_streams: dict = {}
_stream_kwarg = True      # cupy's Function takes stream=: no Device / stream contexts per launch
# NVRTC's options besides -arch (scripts/nvrtc_check.py compiles with the same ones)
OPTIONS = ("-std=c++17", "--use_fast_math")


def source(name: str) -> str:
    """The text NVRTC compiles for kernel source `name`: its local includes inlined."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        with open(os.path.join(_DIR, fname)) as f:
            text = f.read()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)
    return expand(name)


def cupy():
    """The cupy module, or None where it does not import (CPU machines, no CUDA libraries)."""
    global _cupy, _cupy_failed
    if _cupy is None and not _cupy_failed:
        try:
            import cupy as cp
            _cupy = cp
        except Exception:   # ImportError, missing CUDA libraries, ...
            _cupy_failed = True
    return _cupy


def available() -> bool:
    """The CUDA C++ kernels can run here: a GPU, cupy, and not switched off (tunables.CUDA)."""
    return tunables.CUDA and torch.cuda.is_available() and cupy() is not None


def index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def capability(idx: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(idx)


@functools.lru_cache(maxsize=None)
def reserved_smem(idx: int) -> int:
    """Bytes of shared memory the driver reserves at the start of each block's window
    (cudaDevAttrReservedSharedMemoryPerBlock: 1 KiB on sm_80 to sm_90)."""
    return int(cupy().cuda.runtime.deviceGetAttribute(111, idx))


@functools.lru_cache(maxsize=None)
def num_sms(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def function(src: str, name: str, device: torch.device):
    """The kernel instantiation `name` (a C++ name expression) of source file `src`,
    compiled and loaded once per device."""
    key = (device.index, name)
    fn = _functions.get(key)
    if fn is None:
        cp = cupy()
        with cp.cuda.Device(device.index or 0):
            major, minor = torch.cuda.get_device_capability(device)
            mod = cp.RawModule(code=source(src), options=OPTIONS + (f"-arch=sm_{major}{minor}",),
                               name_expressions=[name])
            fn = mod.get_function(name)
        _functions[key] = fn
    return fn


def stream(device: torch.device):
    """cupy's wrapper of torch's current stream on device (launches join torch's order)."""
    s = torch.cuda.current_stream(device)
    key = (device.index, s.cuda_stream)
    ext = _streams.get(key)
    if ext is None:
        ext = cupy().cuda.ExternalStream(s.cuda_stream, device.index or 0)
        _streams[key] = ext
    return ext


def launch(fn, device, grid, block, args, shared_mem=0, stream_=None):
    """Launch on torch's current stream of device (stream_: that stream's cupy wrapper,
    from stream(), when the caller launches several kernels)."""
    global _stream_kwarg
    cp = cupy()
    idx = device.index or 0
    if _stream_kwarg and cp.cuda.runtime.getDevice() == idx:
        # The launch itself takes ~5 µs; the two context managers took ~25 more.
        try:
            fn(grid, block, args, shared_mem=shared_mem, stream=stream_ or stream(device))
            return
        except TypeError:       # a cupy without stream=
            _stream_kwarg = False
    with cp.cuda.Device(idx), (stream_ or stream(device)):
        fn(grid, block, args, shared_mem=shared_mem)


# Kernel arguments as numpy scalars (cupy packs them by type). numpy is imported once at
# module level: an import statement in each of these cost ~1 µs a call, 30 a launch.
def ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


NULL = np.uint64(0)
i64, i32, f32 = np.int64, np.int32, np.float32


def ceil(a: int, b: int) -> int:
    return -(-a // b)
