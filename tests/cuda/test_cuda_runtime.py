"""cuda_rt.current_stream: torch's current stream, one Stream object per raw
stream instead of a new one per call (the AppendAttend hot path asks three
times a call)."""
import pytest
import torch

from kvstore.cuda import runtime as cuda_rt


def test_current_stream_without_the_raw_api_is_torchs(monkeypatch):
    # CPU builds have no raw-stream call: torch's own answer, whatever it is
    sentinel = object()
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sentinel)
    assert cuda_rt.current_stream(torch.device("cuda", 0)) is sentinel
    assert cuda_rt.current_stream("cuda:0") is sentinel


@pytest.mark.gpu
def test_current_stream_follows_the_current_stream():
    dev = torch.device("cuda", torch.cuda.current_device())
    first = cuda_rt.current_stream(dev)
    assert cuda_rt.current_stream(dev) is first                     # no new object per call
    assert first == torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        got = cuda_rt.current_stream(dev)
        assert got.cuda_stream == side.cuda_stream and got == side
        assert cuda_rt.current_stream(dev.index) is got
    assert cuda_rt.current_stream(dev) is first                     # back on the first stream
    # the cached object works as torch's own: work ordered on it runs on that stream
    x = torch.zeros(4, device=dev)
    ev = torch.cuda.Event()
    side.wait_stream(first)              # the zero fill (on the first stream) before the side stream's add
    with torch.cuda.stream(side):
        x.add_(1)
        ev.record(cuda_rt.current_stream(dev))
    first.wait_event(ev)
    assert x.sum().item() == 4
