"""The CUDA encoder's tables (kernels/cuda/encode.py encode_plan: ~0.24 GB of GPU memory
for each codebook of an 8B model) live as long as their codebooks: one plan a codebook
tensor, rebuilt over the old one when SetCodebooks writes new values into it, and dropped
with its cache. The plan builder is stubbed (it needs a GPU); what is checked is which
plans the cache keeps."""
import torch

from helpers import config
from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.kernels import router
from kvstore.kernels.cuda import encode as cuda_encode

L, HKV, D = 2, 2, 16


def _stub(monkeypatch, backend_cuda: bool):
    built = []

    def plan(codebook):
        built.append(codebook.clone())
        return object()
    monkeypatch.setattr(cuda_encode, "plan_pq_encode", plan)
    monkeypatch.setattr(cuda_encode, "_encode_plans", {})
    if backend_cuda:
        monkeypatch.setattr(router, "encode_backend", lambda cb: router.CUDA)
    return built


def test_one_plan_a_codebook_rebuilt_when_written_in_place(monkeypatch):
    built = _stub(monkeypatch, backend_cuda=False)
    cb = torch.randn(HKV, D // 2, 256, 2)
    p = cuda_encode.encode_plan(cb)
    assert cuda_encode.encode_plan(cb) is p and len(built) == 1
    cb.add_(1.0)                                   # new values, same tensor
    q = cuda_encode.encode_plan(cb)
    assert q is not p and torch.equal(built[-1], cb)
    assert len(cuda_encode._encode_plans) == 1     # rebuilt over the old plan, not beside it
    assert cuda_encode.encode_plan(cb, refresh=True) is not q and len(cuda_encode._encode_plans) == 1
    cuda_encode.release_plan(cb)
    assert cuda_encode._encode_plans == {}


def _codebooks(seed: int) -> Codebooks:
    g = torch.Generator().manual_seed(seed)
    return Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                     v=torch.randn(L, HKV, D // 2, 256, 2, generator=g))


def test_a_cache_keeps_one_plan_a_codebook_and_its_deletion_drops_them(monkeypatch):
    built = _stub(monkeypatch, backend_cuda=True)
    e = Engine()
    for name in ("a", "b"):
        e.create_cache(config("pq", name))
        e.set_codebooks(name, _codebooks(1))
    assert len(cuda_encode._encode_plans) == 4 and len(built) == 4        # K and V of each cache
    for seed in (2, 3):                                                   # SetCodebooks again, twice
        e.set_codebooks("a", _codebooks(seed))
    assert len(cuda_encode._encode_plans) == 4 and len(built) == 8
    k_cb = e.cache("a").main.k_cb
    assert torch.equal(built[-2], k_cb) and torch.equal(k_cb, _codebooks(3).k)   # plans of the new values
    e.delete_cache("a")
    left = e.cache("b").main
    assert set(cuda_encode._encode_plans) == {cuda_encode._plan_key(left.k_cb), cuda_encode._plan_key(left.v_cb)}
    e.delete_cache("b")
    assert cuda_encode._encode_plans == {}
