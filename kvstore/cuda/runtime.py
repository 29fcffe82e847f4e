"""cupy's CUDA runtime bindings, for the few per-call CUDA calls of the
daemon's hot path (stream query, event record and wait, the meta copy) made
on raw handles: ~1-2 µs each where torch's Python API takes several times
that (docs/rpc.md). The handles are torch's
(`Stream.cuda_stream`, `Event.cuda_event`): both libraries work in the
device's primary context.

runtime() is None where cupy does not import (CPU machines) or with
KVSTORE_CUDA_RT=0: callers keep torch's calls then.

current_stream(device) is torch.cuda.current_stream(device) for the per-call
paths: torch builds a new Stream object each time (~6 µs, three times an
AppendAttend: client, CudaScope, DecodeGraphs)."""
from __future__ import annotations

import os

import torch

_rt = None


def runtime():
    global _rt
    if _rt is None:
        _rt = False
        if os.environ.get("KVSTORE_CUDA_RT", "1") != "0":
            try:
                from cupy.cuda import runtime as rt
                _rt = rt
            except Exception:   # noqa: BLE001 - no cupy, or no CUDA libraries for it
                pass
    return _rt or None


# Stream and event operations through the runtime rt (from runtime(), on the
# current device) or, with rt None, through torch. An event torch has not
# created yet (cuda_event 0: torch makes it at its first record) takes torch's
# call either way.
def stream_idle(stream, rt) -> bool:
    return stream.query() if rt is None else rt.streamQuery(stream.cuda_stream) == 0


def event_done(event, rt) -> bool:
    return event.query() if rt is None else rt.eventQuery(event.cuda_event) == 0


def record(event, stream, rt) -> None:
    handle = event.cuda_event if rt is not None else 0
    if handle:
        rt.eventRecord(handle, stream.cuda_stream)
    else:
        event.record(stream)


def wait(stream, event, rt) -> None:
    handle = event.cuda_event if rt is not None else 0
    if handle:
        rt.streamWaitEvent(stream.cuda_stream, handle, 0)
    else:
        stream.wait_event(event)


_streams: dict = {}     # (device index, raw handle) -> the Stream torch gave for it


def current_stream(device) -> torch.cuda.Stream:
    """The current stream of device (an index or a torch.device with one) as
    the Stream object torch made the first time that raw stream was current
    there: looked up by its handle (~0.5 µs). The same stream, so the same
    object in every use a Stream has (record, wait, set_stream)."""
    if isinstance(device, str):
        device = torch.device(device)
    index = device if isinstance(device, int) else device.index
    raw_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if index is None or raw_of is None:
        return torch.cuda.current_stream(device)
    key = (index, raw_of(index))
    s = _streams.get(key)
    if s is None:
        if len(_streams) >= 256:    # streams made and dropped by a caller: forget the old ones
            _streams.clear()
        s = _streams[key] = torch.cuda.current_stream(index)
    return s
