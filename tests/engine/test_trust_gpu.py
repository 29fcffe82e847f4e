"""The pool's guarantees on a CUDA pool, where the engine's tensors live in
practice: blocks handed out hold no earlier bytes, values that overflow the
cache dtype are refused after conversion on the GPU, and sealed blocks cross
engines through Redis bit-identical from GPU memory."""
import dataclasses
import time

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument
from tests.helpers import config
from tests.tiers.redis_server import redis_server  # noqa: F401 (fixture)

gpu = pytest.mark.gpu
pytestmark = [gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

T = "default"
L, HQ, HKV, D, BS = 2, 4, 2, 64, 16   # head_dim: one the GPU kernels take
N = 64


def codebooks() -> Codebooks:
    g = torch.Generator().manual_seed(0)
    return Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g), v=torch.randn(L, HKV, D // 2, 256, 2, generator=g))


def cuda_engine(codec: str, residual: int = 32, **kw) -> Engine:
    e = Engine(**kw)
    cfg = config(codec, "c", block_size=BS, residual=residual, num_blocks=N // BS if codec == "fp16" else 16,
                 max_sequences=1, num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    e.create_cache(dataclasses.replace(cfg, device="cuda"))
    if codec == "pq":
        e.set_codebooks("c", codebooks())
    return e


def kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, n, HKV, D, generator=g).half().cuda(), torch.randn(L, n, HKV, D, generator=g).half().cuda())


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_reserved_unwritten_slots_on_a_cuda_pool_read_zeros(codec):
    e = cuda_engine(codec, residual=N)     # nothing seals: PQ codes of zeros do not read as zeros
    c = e.cache("c")
    e.allocate("c", "alice", "a", [])
    k, v = kv(N, 1)
    for i in range(0, N, BS):
        e.append("c", "alice", ["a"], k[:, i:i + BS], v[:, i:i + BS], [BS])
    e.free("c", "alice", ["a"])
    e.allocate("c", "bob", "b", [])
    for _ in range(0, N, BS):
        e.reserve("c", "bob", "b", BS)
    e.reserve("c", "bob", "b", 0)
    assert c.seq("bob", "b").length == N
    got_k, got_v = e.retrieve("c", "bob", "b", 0, N)
    assert not got_k.any() and not got_v.any(), "a reservation nobody wrote read earlier bytes"
    out = e.attend("c", "bob", 0, ["b"], torch.randn(1, HQ, D, device="cuda").half())
    assert not out.any()
    e.check_invariants()


def test_values_that_overflow_the_cache_dtype_are_refused_on_the_gpu():
    e = cuda_engine("fp16")
    e.allocate("c", T, "s", [])
    k, v = kv(4, 2)
    big = k.float()
    big[0, 1, 0, 3] = 1e5                                   # finite in fp32, Inf in fp16
    with pytest.raises(InvalidArgument) as err:
        e.append("c", T, ["s"], big, v.float(), [4])
    assert str(err.value).startswith("k:")
    assert e.sequence_info("c", T, "s").length == 0, "a refused append changed the sequence"
    e.append("c", T, ["s"], k, v, [4])
    q = torch.randn(1, HQ, D, device="cuda").half()
    with pytest.raises(InvalidArgument) as err:
        e.attend("c", T, 0, ["s"], q, scale=3e38)
    assert str(err.value).startswith("scale")
    out = e.attend("c", T, 0, ["s"], q)
    assert torch.isfinite(out).all()


def test_sealed_blocks_cross_cuda_engines_through_redis_bit_identical(redis_server):
    from kvstore.tiers.redis_store import RedisConfig
    server = redis_server
    a = cuda_engine("pq", residual=8, redis=RedisConfig(server.url))
    b = cuda_engine("pq", residual=8, redis=RedisConfig(server.url))
    tokens = list(range(1000, 1000 + N))
    k, v = kv(N, 3)
    a.allocate("c", T, "a", tokens)
    a.append("c", T, ["a"], k, v, [N], token_ids=[tokens])
    sealed = len(a.sequence_info("c", T, "a").sealed_blocks)
    assert sealed > 0
    deadline = time.monotonic() + 10
    while a.stats()["c"]["redis"]["blocks_out"] < sealed:
        assert time.monotonic() < deadline, "A's sealed blocks never reached Redis"
        time.sleep(0.02)
    got = b.allocate("c", T, "b", tokens).cached_tokens
    assert got >= sealed * BS
    for x, y in zip(a.retrieve("c", T, "a", 0, got), b.retrieve("c", T, "b", 0, got)):
        assert torch.equal(x.cpu(), y.cpu())


def test_a_payload_changed_in_redis_is_refused_on_a_gpu_cache(redis_server):
    """Payloads received into pinned memory for a GPU cache are checked before
    their copies: one whose bytes changed under an intact header ends the
    prefix before it, counted, never served; put back, the prefix is whole."""
    from kvstore.tiers.redis_format import HEADER_BYTES, block_key
    from kvstore.tiers.redis_store import RedisConfig
    url = redis_server.url
    a = cuda_engine("pq", residual=8, redis=RedisConfig(url))
    tokens = list(range(5000, 5000 + N))
    k, v = kv(N, 4)
    a.allocate("c", T, "a", tokens)
    a.append("c", T, ["a"], k, v, [N], token_ids=[tokens])
    hashes = list(a.sequence_info("c", T, "a").block_hashes)
    sealed = len(a.sequence_info("c", T, "a").sealed_blocks)
    assert sealed >= 3
    deadline = time.monotonic() + 10
    while a.stats()["c"]["redis"]["blocks_out"] < sealed:
        assert time.monotonic() < deadline, "A's sealed blocks never reached Redis"
        time.sleep(0.02)
    fp = a.caches["c"].fingerprint
    r = redis_server.client()
    key = block_key(fp, hashes[1])
    good = r.get(key)
    bad = bytearray(good)
    bad[HEADER_BYTES + (len(good) - HEADER_BYTES) // 2] ^= 0x5A     # the header (and its checksum) as stored
    r.set(key, bytes(bad))

    b = cuda_engine("pq", residual=8, redis=RedisConfig(url))
    assert b.allocate("c", T, "b", tokens).cached_tokens == BS, "served up to the changed block, not past it"
    s = b.stats()["c"]["redis"]
    assert s["refused"] == 1 and s["prefix_hits"] == 1
    b.free("c", T, ["b"])

    r.set(key, good)
    c = cuda_engine("pq", residual=8, redis=RedisConfig(url))
    got = c.allocate("c", T, "c", tokens).cached_tokens
    assert got >= sealed * BS
    for x, y in zip(a.retrieve("c", T, "a", 0, got), c.retrieve("c", T, "c", 0, got)):
        assert torch.equal(x.cpu(), y.cpu())
    assert c.stats()["c"]["redis"]["refused"] == 0
