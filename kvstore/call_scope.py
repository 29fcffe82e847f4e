"""Per-call plumbing for requests that name CUDA buffers: the daemon's own
stream, ordered after the client's ready event and before its done event."""
from __future__ import annotations


class CudaScope:
    def __init__(self, stream, ready, done):
        self.stream, self.ready, self.done = stream, ready, done

    def __enter__(self):
        import torch
        # Also order against the daemon's other work (calls without CUDA
        # buffers run on the default stream): device-side waits, no host sync.
        self.default = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(self.default)
        self.stream.wait_event(self.ready)
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()

    def __exit__(self, *exc):
        self.done.record(self.stream)
        self._ctx.__exit__(*exc)
        self.default.wait_stream(self.stream)


def tensor_fields(request):
    return [getattr(request, f.name) for f in request.DESCRIPTOR.fields
            if f.message_type is not None and f.message_type.name == "Tensor" and request.HasField(f.name)]


def output_fields(request):
    return [getattr(request, f.name) for f in request.DESCRIPTOR.fields
            if f.message_type is not None and f.message_type.name == "OutputRef" and request.HasField(f.name)]
