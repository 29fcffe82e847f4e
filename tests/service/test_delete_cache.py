"""DeleteCache: what it drops and says it dropped, what refuses it (sequences
of live sessions unless force, mapped pools always, tenants other than
default), and that a deleted cache is really gone: its memory, its disk
copies, its name."""
import gc
import weakref
from dataclasses import replace

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import FailedPrecondition, NotFound
from kvstore.service.auth import Authenticator
from kvstore.service.daemon import create_server
from kvstore.service.leases import LeaseManager
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from helpers import config, kv

L, HQ, HKV, D = 2, 4, 2, 16
TOKEN = "delete-cache-tenant-token"


def fill(e: Engine, name: str, seq: str, n: int, owner: str = "", seed: int = 0) -> None:
    prompt = list(range(100 * seed, 100 * seed + n))
    cached = e.allocate(name, "default", seq, prompt, owner=owner).cached_tokens
    k, v = kv(L, n - cached, HKV, D, seed)
    e.append(name, "default", [seq], k, v, [n - cached], token_ids=[prompt[cached:]])


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "kv.sock")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} other\n")
    server, _, _ = create_server(socket_path=sock, auth=Authenticator.from_args(None, str(tokens)),
                                 max_pool_bytes=300_000)
    client = KVStoreClient(f"unix://{sock}", heartbeat=False)
    yield sock, client
    client.close()
    server.stop(0)


def create(client: KVStoreClient, name: str = "c", num_blocks: int = 64, head_dim: int = D):
    return client.create_cache(name, "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=head_dim, codec="fp16",
                               block_size=8, residual=8, num_blocks=num_blocks)


def test_live_sessions_refuse_it_until_force_and_the_reply_counts_what_went(live):
    _, client = live
    create(client)
    k = torch.randn(L, 20, HKV, D).half()
    client.allocate("c", "held", list(range(20)))
    client.append("c", ["held"], k, k, token_ids=[list(range(20))])
    client.allocate("c", "pinned", list(range(100, 108)), pinned=True)
    g = torch.randn(L, 16, HKV, D).half()
    client.allocate("c", "gone", list(range(200, 216)))
    client.append("c", ["gone"], g, g, token_ids=[list(range(200, 216))])
    client.free("c", ["gone"])                            # its two full, hashed blocks stay findable
    before = client.stats("c").caches[0]
    assert (before.main.used, before.main.cached) == (3, 2)
    with pytest.raises(grpc.RpcError) as e:
        client.delete_cache("c")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details().startswith("force: cache 'c': 2 of its 2 sequences are held by live client leases")
    assert client.stats("c").caches[0] == before          # refused: nothing changed
    r = client.delete_cache("c", force=True)
    assert (r.sequences, r.leased_sequences, r.pinned_sequences, r.disk_sequences) == (2, 2, 1, 0)
    assert r.main_blocks == before.main.used == 3         # 20 tokens (3 blocks) + 0 for the empty pinned one
    assert r.cached_blocks == 2                           # the freed sequence's; the held ones are not counted again
    assert r.reserved_bytes == before.reserved_bytes > 0
    with pytest.raises(grpc.RpcError) as e:
        client.stats("c")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert [c.cache for c in client.stats().caches] == []


def test_sequences_without_a_live_session_go_without_force(live):
    sock, client = live
    create(client)
    with grpc.insecure_channel(f"unix://{sock}") as ch:      # no session metadata: owns nothing that lapses
        pb_grpc.KVStoreStub(ch).Allocate(pb.AllocateRequest(cache="c", sequence_id="x", prompt_token_ids=[1, 2]),
                                         timeout=10)
    r = client.delete_cache("c")
    assert (r.sequences, r.leased_sequences) == (1, 0)


def test_only_the_default_tenant_may_delete(live):
    sock, client = live
    create(client)
    other = KVStoreClient(f"unix://{sock}", heartbeat=False, token=TOKEN)
    try:
        with pytest.raises(grpc.RpcError) as e:
            other.delete_cache("c")
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "only tenant 'default' may delete" in e.value.details()
    finally:
        other.close()
    assert client.get_cache("c").spec.name == "c"


def test_the_name_and_the_budget_are_free_again(live):
    _, client = live
    create(client, num_blocks=64)                  # 131072 bytes of a 300000-byte budget
    create(client, "d", num_blocks=64)
    with pytest.raises(grpc.RpcError) as e:
        create(client, "e", num_blocks=64)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    client.delete_cache("d")
    create(client, "e", num_blocks=64)             # fits now
    create(client, "d", num_blocks=8)              # the name is free, with another spec
    assert client.get_cache("d").capacity_blocks == 8


def test_a_deleted_cache_is_released():
    e = Engine()
    e.create_cache(config(codec="pq"))
    g = torch.Generator().manual_seed(0)
    e.train_codebooks("c", torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g), niter=2)
    fill(e, "c", "a", 40)
    ref = weakref.ref(e.cache("c"))
    e.delete_cache("c")
    gc.collect()
    assert ref() is None, "something still holds the deleted cache (and its pools)"
    with pytest.raises(NotFound):
        e.append("c", "default", ["a"], *kv(L, 1, HKV, D), [1])


def test_a_mapped_pool_refuses_it_even_with_force_until_the_session_lapses():
    e = Engine()
    e.create_cache(config(codec="fp16"))
    fill(e, "c", "a", 20)
    e.map_pool("c", ("default", "mapper"))
    now = [0.0]
    leases = LeaseManager(e, timeout_s=10, clock=lambda: now[0])
    leases.touch("default", "mapper")
    for force in (False, True):
        with pytest.raises(FailedPrecondition, match="mapped by 1 client session"):
            e.delete_cache("c", force=force, live=leases.is_live)
    assert e.stats("c")["c"]["sequences"] == 1            # refused: nothing dropped
    now[0] = 11.0
    assert leases.reap() == [("default", "mapper")]       # the lapse ends the mapping
    assert e.delete_cache("c", live=leases.is_live).sequences == 1


def test_disk_copies_are_deleted_and_do_not_come_back(tmp_path):
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config(codec="fp16"))
    fill(e, "c", "a", 20)
    e.offload("c", "default", ["a"])
    assert e.delete_cache("c").disk_sequences == 1
    e.create_cache(config(codec="fp16"))                  # same spec and fingerprint: restores what disk holds
    assert e.list_sequences("c", "default") == []
    e.close()
    e.cold_store.close()
    e2 = Engine(lmdb_path=str(tmp_path / "lmdb"))         # and a restart does not bring it back either
    e2.create_cache(config(codec="fp16"))
    assert e2.list_sequences("c", "default") == []


def test_host_tier_sequences_are_counted(tmp_path):
    e = Engine()
    e.create_cache(replace(config(codec="fp16", num_blocks=8, max_sequences=4), host_bytes=1 << 20))
    fill(e, "c", "a", 40, seed=1)                          # 5 of the 8 blocks
    fill(e, "c", "b", 40, seed=2)                          # moves a down to the host tier
    assert e.sequence_info("c", "default", "a").tier == "host"
    r = e.delete_cache("c")
    assert (r.sequences, r.host_blocks, r.main_blocks) == (2, 5, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["fp16", "pq", "pq-host"])
def test_gpu_memory_goes_back_to_the_driver(codec):
    # pq: the encoder's tables of the cache's codebooks (GPU tensors of their own) go too;
    # pq-host: a host tier, whose hooks on the cache's pools refer back to the cache
    codec, host = codec.split("-")[0], codec.endswith("-host")
    e = Engine("cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()      # what earlier tests of this process left cached would serve the pool
    base = torch.cuda.memory_reserved()
    cfg = replace(config(codec=codec, head_dim=64), device="cuda",     # a head_dim the GPU kernels take
                  host_bytes=1 << 20 if host else 0)
    # A pool that fits in what the allocator holds unused (segments of earlier tests of
    # this process that a live tensor keeps from empty_cache) would take no new memory,
    # and reserved would not move: the pool is made twice that size, at least 4096 blocks.
    slack = base - torch.cuda.memory_allocated()
    e.create_cache(replace(cfg, num_blocks=max(4096, 2 * slack // cfg.bytes_per_block() + 1)))
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        shape = (cfg.geometry.num_layers, cfg.geometry.num_kv_heads, cfg.m, 256, 64 // cfg.m)
        e.set_codebooks("c", Codebooks(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g)))
    assert torch.cuda.memory_reserved() > base
    e.delete_cache("c")
    gc.collect()
    assert torch.cuda.memory_reserved() <= base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_mapped_pool_over_grpc_holds_until_the_mapping_session_lapses(tmp_path):
    import time
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(Engine("cuda"), socket_path=sock, lease_timeout=1.0)
    mapper = KVStoreClient(f"unix://{sock}", heartbeat=False)
    operator = KVStoreClient(f"unix://{sock}", heartbeat=False)      # another session
    try:
        create(mapper, head_dim=64)                                  # a head_dim the GPU kernels take
        mapper.stub.MapPool(pb.MapPoolRequest(cache="c"), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            operator.delete_cache("c", force=True)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "mapped by 1 client session" in e.value.details()
        deadline = time.monotonic() + 30
        while True:          # the mapper makes no more calls: its lease lapses after 1 s
            try:
                operator.delete_cache("c")
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline
                time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            mapper.reserve("c", "x", 1)                              # the mapper's next step: the cache is gone
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        mapper.close()
        operator.close()
        server.stop(0)
