"""Per-call plumbing for requests that name CUDA buffers: the daemon's own
stream, ordered after the client's ready event and before its done event."""
from __future__ import annotations

import threading

from . import runtime as cuda_rt


class CudaScope:
    """fence: an event of this thread (see Fences), re-recorded per call
    instead of the fresh event each Stream.wait_stream makes. On the current
    device its CUDA calls go through cupy's runtime on the raw handles
    (runtime.py: ~1-2 µs a call instead of torch's ~5-10)."""

    def __init__(self, stream, ready, done, fence):
        self.stream, self.ready, self.done, self.fence = stream, ready, done, fence

    def __enter__(self):
        import torch
        # Also order against the daemon's other work (calls without CUDA
        # buffers run on the default stream): device-side waits, no host sync.
        # A default stream with nothing left to run needs no fence; asking
        # costs one CUDA call where the fence costs two.
        self.default = cuda_rt.current_stream(self.stream.device)
        # The stream's own device is the current one (one GPU): switching the
        # stream is all torch.cuda.stream() would do, at a third of its cost.
        # Only there the raw calls apply: a stream handle 0 (the legacy default
        # stream) names the current device's.
        index = getattr(self.stream, "device_index", None)
        here = index is not None and index == torch.cuda.current_device()
        self._rt = rt = cuda_rt.runtime() if here else None
        if not cuda_rt.stream_idle(self.default, rt):
            cuda_rt.record(self.fence, self.default, rt)
            cuda_rt.wait(self.stream, self.fence, rt)
        cuda_rt.wait(self.stream, self.ready, rt)
        self._ctx = None
        if here:
            torch.cuda.set_stream(self.stream)
        else:
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()

    def __exit__(self, *exc):
        import torch
        cuda_rt.record(self.done, self.stream, self._rt)
        if self._ctx is None:
            torch.cuda.set_stream(self.default)
        else:
            self._ctx.__exit__(*exc)
        # The default stream's later work comes after this call's. done marks
        # its end on the stream (every record of done is on this one stream per
        # device, so a later record only waits longer): no event of our own.
        cuda_rt.wait(self.default, self.done, self._rt)


class Fences:
    """Per thread and device, CudaScope's ordering event. A wait takes the
    event's record at the time of the wait, so re-recording it for the next
    call cannot reorder (or deadlock) an earlier call."""

    def __init__(self):
        self._local = threading.local()

    def get(self, device):
        import torch
        mine = self._local.__dict__.setdefault("events", {})
        key = str(device)
        if key not in mine:
            with torch.cuda.device(device):
                mine[key] = torch.cuda.Event()
        return mine[key]
