"""What one request and one sequence may hold in host memory: a sequence never
holds more tokens than its cache's pools can (prompt ids at Allocate, ids and
tokens at Append); token ids are kept compact (4 bytes each); Stats and the
Prometheus metrics show the host memory a cache holds; a daemon holds at most
lifecycle.MAX_CACHES caches."""
import gc
import tracemalloc

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.engine.engine import Engine
from kvstore.service.daemon import create_server
from kvstore.service.metrics import Metrics
from kvstore.v1 import kvstore_pb2 as pb

from helpers import config, kv

L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
TENANT = "default"


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "kv.sock")
    metrics = Metrics()
    server, _, _ = create_server(socket_path=sock, metrics=metrics)
    client = KVStoreClient(f"unix://{sock}", heartbeat=False)
    yield client, metrics, server.kvstore_engine
    client.close()
    server.stop(0)


def make(client, name: str, codec: str, num_blocks: int, **kw):
    client.create_cache(name, "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=codec,
                        block_size=BS, residual=R, num_blocks=num_blocks, **kw)
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        client.train_codebooks(name, torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g),
                               niter=2)


def test_a_prompt_past_what_the_cache_holds_is_refused_with_no_trace(live):
    """A 256-token fp16 cache (32 blocks of 8): 2M-token prompts are refused as
    INVALID_ARGUMENT, not stored; the PQ cache's bound adds its fp16 tail (R + block)."""
    client, _, engine = live
    make(client, "f16", "fp16", 32)
    make(client, "pq", "pq", 32)
    before = client.stats()
    for name in ("f16", "pq"):
        for i in range(3):
            with pytest.raises(grpc.RpcError) as info:
                client.allocate(name, f"huge-{i}", list(range(2_000_000)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("prompt_token_ids"), info.value.details()
    assert client.stats() == before
    assert all(not c.seqs for c in engine.caches.values())
    for name, most in (("f16", 32 * BS), ("pq", 32 * BS + R + BS)):
        with pytest.raises(grpc.RpcError) as info:
            client.allocate(name, "one-over", list(range(most + 1)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.allocate(name, "at-the-bound", list(range(most))) == 0
        assert client.sequence_info(name, "at-the-bound").known_token_ids == most


def test_an_append_past_what_the_cache_holds_is_invalid_not_exhausted(live):
    client, _, engine = live
    make(client, "f16", "fp16", 4)          # 32 tokens
    client.allocate("f16", "s", list(range(20)))
    k, v = kv(L, 20, HKV, D)
    client.append("f16", ["s"], k, v, token_ids=[list(range(20))])
    before = client.sequence_info("f16", "s"), client.stats()
    k, v = kv(L, 13, HKV, D, seed=1)
    for ids in (None, [list(range(20, 33))]):     # 33 tokens: never fits, whatever is freed
        with pytest.raises(grpc.RpcError) as info:
            client.append("f16", ["s"], k, v, token_ids=ids)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("counts")
    k40, v40 = kv(L, 40, HKV, D, seed=2)
    with pytest.raises(grpc.RpcError) as info:       # the count alone is past the bound, ids with it
        client.append("f16", ["s"], k40, v40, token_ids=[list(range(40))])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("counts")
    with pytest.raises(grpc.RpcError) as info:       # more ids than the cache holds, for fewer tokens
        client.append("f16", ["s"], k, v, token_ids=[list(range(40))])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("token_ids")
    assert (client.sequence_info("f16", "s"), client.stats()) == before
    k, v = kv(L, 12, HKV, D, seed=1)
    client.append("f16", ["s"], k, v)                # 32 tokens: fits
    assert client.sequence_info("f16", "s").length == 32


def test_token_ids_are_kept_in_4_bytes_each():
    """Host memory one sequence's prompt keeps: 4 bytes an id plus one hash a
    block (a list of Python ints takes ~36 bytes an id)."""
    n = 200_000
    e = Engine()
    e.create_cache(config("fp16", num_blocks=n // 8 + 1))
    # As the servicer passes it: the request's repeated field, whose ids are not Python ints yet.
    prompt = pb.AllocateRequest(prompt_token_ids=range(1000, 1000 + n)).prompt_token_ids
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        e.allocate("c", TENANT, "s", prompt)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    hashes = (n // 8) * 80         # a 32-byte bytes object (65 bytes) and its list slot
    assert held < 4 * n + hashes + 64 * 1024, f"{held} bytes held for {n} token ids"
    s = e.cache("c").seqs[(TENANT, "s")]
    assert s.token_ids.itemsize == 4 and list(s.token_ids[:3]) == [1000, 1001, 1002]
    # Forks, appended ids and hashes keep the same format and the same chain.
    e.fork("c", TENANT, "s", "t")
    t = e.cache("c").seqs[(TENANT, "t")]
    assert t.token_ids == s.token_ids and t.token_ids is not s.token_ids and t.hashes == s.hashes


def test_stats_and_metrics_show_host_memory_held(live):
    client, metrics, engine = live
    make(client, "pq", "pq", 256, host_bytes=1 << 20)
    make(client, "f16", "fp16", 64)
    empty = {c.cache: c for c in client.stats().caches}
    host = engine.cache("pq").tiering.host.nbytes()
    assert 0 < host <= 1 << 20
    assert empty["pq"].host_tier_bytes == host and empty["f16"].host_tier_bytes == 0
    assert empty["pq"].host_metadata_bytes == 0
    n = 1000
    client.allocate("pq", "s", list(range(n)))
    st = {c.cache: c for c in client.stats().caches}
    # 4 bytes an id and a 32-byte hash a block, plus the objects holding them
    assert 4 * n + 32 * (n // BS) <= st["pq"].host_metadata_bytes <= 4 * n + 200 * (n // BS) + 4096
    assert st["f16"].host_metadata_bytes == 0
    got = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in metrics.render().splitlines()
                                    if line and not line.startswith("#"))}
    assert got['kvstore_host_metadata_bytes{cache="pq"}'] == st["pq"].host_metadata_bytes
    assert got['kvstore_host_metadata_bytes{cache="f16"}'] == 0
    assert got['kvstore_host_bytes{cache="pq"}'] == host          # the host tier's pinned pools


def test_a_daemon_holds_at_most_max_caches(monkeypatch):
    """Any tenant may create caches: their number is bounded (each adds metrics series,
    a lock and books), the refusal naming name and changing nothing."""
    from kvstore.engine import lifecycle
    from kvstore.engine.engine import Engine
    from kvstore.errors import ResourceExhausted
    from helpers import config
    monkeypatch.setattr(lifecycle, "MAX_CACHES", 3)
    e = Engine()
    for i in range(3):
        e.create_cache(config("fp16", name=f"c{i}", num_blocks=4))
    with pytest.raises(ResourceExhausted, match="^name: the daemon holds 3 caches"):
        e.create_cache(config("fp16", name="c3", num_blocks=4))
    assert sorted(e.caches) == ["c0", "c1", "c2"]
    e.create_cache(config("fp16", name="c0", num_blocks=4), exist_ok=True)     # the same one again: no error
    e.delete_cache("c0")
    e.create_cache(config("fp16", name="c3", num_blocks=4))
