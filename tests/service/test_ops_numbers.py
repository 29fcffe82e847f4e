"""What an operator and a client read back: CreateCache of a taken name says
which fields differ, Retrieve reads to the end with end 0 (a large range in
calls of whole layers), an idle client's
lease lapse is DEBUG (one that freed sequences stays INFO), the build-info
metric, and Stats' reserved vs used bytes per pool."""
import logging
from dataclasses import replace

import grpc
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.client import client as client_mod
from kvstore.engine.engine import Engine
from kvstore.errors import AlreadyExists
from kvstore.service import buildinfo
from kvstore.service.daemon import create_server
from kvstore.service.leases import LeaseManager
from kvstore.service.metrics import Metrics

from helpers import config, kv

L, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture
def client(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    c = KVStoreClient(f"unix://{sock}", heartbeat=False)
    yield c
    c.close()
    server.stop(0)


def test_exists_with_another_configuration_names_each_difference():
    e = Engine()
    e.create_cache(config(codec="fp16"))
    with pytest.raises(AlreadyExists) as err:
        e.create_cache(replace(config(codec="fp16", block_size=16, num_layers=3), max_sequences=8), exist_ok=True)
    msg = str(err.value)
    assert msg.startswith("name: cache 'c' exists with another configuration: ")
    for part in ("geometry.num_layers 2 (existing) vs 3 (requested)", "block_size 8 (existing) vs 16 (requested)",
                 "max_sequences 16 (existing) vs 8 (requested)"):
        assert part in msg, msg
    assert "head_dim" not in msg and "codec" not in msg       # only what differs
    with pytest.raises(AlreadyExists, match="exists with this configuration \\(exist_ok returns it\\)"):
        e.create_cache(config(codec="fp16"))


def test_a_pq_cache_named_with_its_default_m_or_without_is_the_same_cache():
    """num_subvectors 0 means head_dim / 2: a CreateCache naming that M (an adapter
    given a codebooks file) and one leaving it unset (an adapter that uses the
    cache's codebooks) ask for one cache; another M is another cache."""
    e = Engine()
    e.create_cache(config(codec="pq", m=0))
    assert e.cache_info("c").cfg.codec.num_subvectors == D // 2
    e.create_cache(config(codec="pq", m=D // 2), exist_ok=True)
    e.create_cache(config(codec="pq", m=0), exist_ok=True)
    with pytest.raises(AlreadyExists, match=f"num_subvectors {D // 2} \\(existing\\) vs {D // 4} \\(requested\\)"):
        e.create_cache(config(codec="pq", m=D // 4), exist_ok=True)


def test_a_pool_given_in_bytes_or_in_the_blocks_they_hold_is_the_same_cache():
    """pool_bytes and num_blocks size one pool two ways: a CreateCache giving the other
    for the same pool asks for the cache that exists; another size is another cache,
    named in blocks."""
    e = Engine()
    cfg = config(codec="fp16")
    e.create_cache(cfg)
    in_bytes = replace(cfg, num_blocks=0, pool_bytes=cfg.capacity_blocks() * cfg.bytes_per_block())
    assert e.create_cache(in_bytes, exist_ok=True).cfg == cfg
    with pytest.raises(AlreadyExists, match=f"num_blocks {cfg.capacity_blocks()} \\(existing\\) vs "
                                            f"{cfg.capacity_blocks() - 1} \\(requested\\)$"):
        e.create_cache(replace(in_bytes, pool_bytes=in_bytes.pool_bytes - 1), exist_ok=True)


def test_retrieve_to_the_end(client):
    client.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, residual=8, num_blocks=64)
    client.allocate("c", "a", list(range(21)))
    k, v = kv(L, 21, HKV, D)
    client.append("c", ["a"], k, v, token_ids=[list(range(21))])
    k2, v2 = client.retrieve("c", "a", 5)                     # end 0: to the end
    assert torch.equal(k2, k[:, 5:]) and torch.equal(v2, v[:, 5:])
    k3, _ = client.retrieve("c", "a", 0, 0, layer_start=1)
    assert torch.equal(k3, k[1:])
    with pytest.raises(grpc.RpcError) as e:
        client.retrieve("c", "a", 21)                         # nothing after the end
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("start")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_retrieve_past_one_call_s_bytes_comes_in_calls_of_whole_layers(client, monkeypatch, dtype):
    client.create_cache("c", "m", num_layers=5, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, residual=8, num_blocks=128, dtype=dtype)
    client.allocate("c", "a", list(range(21)))
    k, v = (x.to(getattr(torch, dtype)) for x in kv(5, 21, HKV, D))
    client.append("c", ["a"], k, v, token_ids=[list(range(21))])
    calls = []
    real = client._raw.Retrieve
    monkeypatch.setattr(client._raw, "Retrieve", lambda r, **kw: calls.append((r.layer_start, r.layer_end)) or
                        real(r, **kw))
    monkeypatch.setattr(client_mod, "RETRIEVE_CALL_BYTES", 2 * 2 * 21 * HKV * D * 2)    # K, V of two layers of 21 tokens
    k2, v2 = client.retrieve("c", "a", 5, layer_start=0)
    assert calls == [(0, 2), (2, 4), (4, 5)]
    assert k2.dtype == k.dtype and torch.equal(k2, k[:, 5:]) and torch.equal(v2, v[:, 5:])
    calls.clear()
    k3, v3 = client.retrieve("c", "a", 0, 0, layer_start=1, layer_end=3)
    assert calls == [(1, 3)] and torch.equal(k3, k[1:3]) and torch.equal(v3, v[1:3])
    with pytest.raises(grpc.RpcError) as e:
        client.retrieve("c", "a", 3, 21, layer_start=4, layer_end=9)       # refused whole, by the daemon
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "layer_end" in e.value.details()


def test_allocate_reports_this_requests_hit(client):
    client.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, residual=8, num_blocks=64)
    prompt = list(range(30))
    assert client.allocate("c", "a", prompt) == 0
    k, v = kv(L, 30, HKV, D)
    client.append("c", ["a"], k, v, token_ids=[prompt])
    from kvstore.v1 import kvstore_pb2 as pb
    r = client.stub.Allocate(pb.AllocateRequest(cache="c", sequence_id="b", prompt_token_ids=prompt), timeout=10)
    assert (r.cached_tokens, r.hit_blocks) == (24, 3)         # three full blocks of the 30 tokens
    st = client.stats("c").caches[0]
    assert (st.prefix_hit_tokens, st.prefix_query_tokens) == (24, 60)


def test_idle_lapses_are_debug_and_lapses_that_free_are_info(caplog):
    e = Engine()
    e.create_cache(config(codec="fp16"))
    e.allocate("c", "t", "a", [1, 2, 3], owner="busy")
    now = [0.0]
    leases = LeaseManager(e, timeout_s=5, clock=lambda: now[0])
    leases.touch("t", "busy")
    leases.touch("t", "idle")
    now[0] = 6.0
    with caplog.at_level(logging.DEBUG, logger="kvstore.leases"):
        assert sorted(leases.reap()) == [("t", "busy"), ("t", "idle")]
    levels = {r.getMessage().split()[3]: r.levelno for r in caplog.records}
    assert levels == {"idle": logging.DEBUG, "busy": logging.INFO}, levels


def test_build_info_metric():
    body = Metrics().render()
    info = buildinfo.build_info()
    line = next(x for x in body.splitlines() if x.startswith("kvstore_build_info{"))
    assert line.endswith(" 1.0")
    for key in ("version", "commit", "torch", "cuda", "triton", "cupy"):
        assert f'{key}="{info[key]}"' in line
    assert info["torch"] == torch.__version__ and info["version"] == buildinfo.version()


def test_reserved_and_used_bytes_per_pool():
    e = Engine()
    cfg = replace(config(codec="pq", max_sequences=4), host_bytes=1 << 16)
    e.create_cache(cfg)
    g = torch.Generator().manual_seed(0)
    e.train_codebooks("c", torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g), niter=2)
    e.allocate("c", "t", "a", list(range(40)))
    e.append("c", "t", ["a"], *kv(L, 40, HKV, D), [40], token_ids=[list(range(40))])
    s = e.stats("c")["c"]
    fp16_block = cfg.block_size * cfg.fp16_bytes_per_token()
    assert s["tail_reserved_bytes"] == cfg.tail_capacity_blocks() * fp16_block == 4 * 4 * fp16_block
    assert s["tail_used_bytes"] == s["tail"].used * fp16_block == 2 * fp16_block
    assert s["main_reserved_bytes"] == 64 * cfg.bytes_per_block() and s["main_used_bytes"] == 3 * cfg.bytes_per_block()
    host = cfg.host_tier_bytes()                                 # whole block pairs of the 1 << 16 asked
    assert host == s["tiers"]["host_bytes"] and (1 << 16) - cfg.host_pair_bytes() < host <= 1 << 16
    assert s["reserved_bytes"] == s["main_reserved_bytes"] + s["tail_reserved_bytes"] + host
    assert s["used_bytes"] == s["main_used_bytes"] + s["tail_used_bytes"]
    c = e.cache("c")
    assert c.tiering.to_host(c.seqs[("t", "a")])              # the sequence moves down whole
    s = e.stats("c")["c"]
    assert s["host_used_bytes"] > 0 and s["main_used_bytes"] == s["tail_used_bytes"] == 0


def test_delete_cache_logs_what_it_dropped(client, caplog):
    """Other workers' sequences go with a deleted cache: their next call is NOT_FOUND,
    and the daemon's log says which cache took them and how many."""
    client.create_cache("gone", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, num_blocks=16)
    client.allocate("gone", "a", [], pinned=True)
    client.allocate("gone", "b", [])
    with caplog.at_level(logging.INFO, "kvstore.servicer"):
        client.delete_cache("gone", force=True)
    assert "DeleteCache 'gone' (force): dropped 2 sequences (2 of live sessions, 1 pinned, 0 with a disk copy)" \
        in caplog.text, caplog.text
