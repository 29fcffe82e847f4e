"""Operating it: Prometheus metrics (tiers discovered from engine.stats()),
RPC latency and codes, kvstore-admin, the debug invariant check, malformed
bytes, the pool memory budget."""
import json
import os
import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvstore.client import KVStoreClient
from kvstore.core.block_pool import PoolStats
from kvstore.service.daemon import create_server
from kvstore.service.metrics import EngineCollector, Metrics
from kvstore.tools import admin

L, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "kv.sock")
    metrics = Metrics()
    server, _, _ = create_server(socket_path=sock, metrics=metrics)
    kv = KVStoreClient(f"unix://{sock}", heartbeat=False)
    kv.create_cache("pq", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="pq",
                    block_size=8, residual=8, num_blocks=64)
    g = torch.Generator().manual_seed(0)
    kv.train_codebooks("pq", torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g),
                       niter=2)
    prompt = list(range(40))
    for sid in ("a", "b"):
        cached = kv.allocate("pq", sid, prompt)
        k = torch.randn(L, 40 - cached, HKV, D).half()
        kv.append("pq", [sid], k, k, token_ids=[prompt[cached:]])
    kv.attend("pq", 0, ["a", "b"], torch.randn(2, HQ, D).half())
    yield sock, kv, metrics
    kv.close()
    server.stop(0)


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_metrics_follow_stats_and_rpcs(live):
    sock, kv, metrics = live
    with pytest.raises(grpc.RpcError):
        kv.sequence_info("pq", "missing")
    s = samples(metrics.render())
    st = kv.stats("pq").caches[0]
    for tier in ("main", "tail"):
        pool = getattr(st, tier)
        for state in ("used", "cached", "free"):
            assert s[f'kvstore_blocks{{cache="pq",state="{state}",tier="{tier}"}}'] == getattr(pool, state)
        assert s[f'kvstore_capacity_blocks{{cache="pq",tier="{tier}"}}'] == pool.capacity
        assert f'kvstore_evictions_total{{cache="pq",tier="{tier}"}}' in s
    assert s['kvstore_prefix_hit_tokens_total{cache="pq"}'] == st.prefix_hit_tokens > 0
    assert s['kvstore_prefix_hit_rate{cache="pq"}'] == pytest.approx(st.prefix_hit_rate)
    assert s['kvstore_used_bytes{cache="pq"}'] == st.used_bytes
    assert s['kvstore_rpc_total{code="OK",method="Allocate"}'] == 2
    assert s['kvstore_rpc_total{code="NOT_FOUND",method="SequenceInfo"}'] == 1
    assert s['kvstore_rpc_duration_seconds_count{method="Append"}'] == 2
    assert s['kvstore_rpc_duration_seconds_bucket{le="+Inf",method="Attend"}'] == 1


def test_new_tiers_appear_without_code_changes():
    class FakeEngine:
        def stats(self):
            return {"c": dict(main=PoolStats(10, 4, 2, 4, 1), tail=None, sequences=3, prefix_query_tokens=100,
                              prefix_hit_tokens=40, tiers=dict(host_main=PoolStats(20, 5, 0, 15, 2),
                                                               page_ins_host=7, prefix_hits_disk=2,
                                                               disk=dict(bytes=4096, entries=3)))}

        def disk_stats(self):
            return dict(bytes=4096, entries=3)

        def config(self, name):
            return type("Cfg", (), {"block_size": 8})()

    reg = CollectorRegistry()
    reg.register(EngineCollector(FakeEngine()))
    s = samples(generate_latest(reg).decode())
    assert s['kvstore_blocks{cache="c",state="used",tier="host_main"}'] == 5
    assert s['kvstore_evictions_total{cache="c",tier="host_main"}'] == 2
    assert s['kvstore_tier_page_ins_total{cache="c",tier="host"}'] == 7
    assert s['kvstore_disk_bytes'] == 4096
    assert s['kvstore_tier_hit_rate{cache="c",tier="disk"}'] == pytest.approx(2 * 8 / 100)
    assert s['kvstore_sequences{cache="c"}'] == 3
    assert not any("tail" in k for k in s)        # a tier that is None is absent


def test_the_shared_disk_store_is_one_series_and_each_cache_its_own_share(tmp_path):
    """The disk tier is one LMDB store under every cache: its figures are daemon-wide
    series without a cache label, so sum() over caches does not multiply them; what a
    cache did with it (sequences there, offloads) is that cache's own."""
    from kvstore.engine.engine import Engine
    from helpers import config, kv
    e = Engine("cpu", str(tmp_path / "lmdb"))

    def scrape():
        reg = CollectorRegistry()
        reg.register(EngineCollector(e))
        return samples(generate_latest(reg).decode())
    assert scrape()["kvstore_disk_entries"] == 0      # the store's series exist before any cache
    for name in ("a", "b"):
        e.create_cache(config(codec="fp16", name=name, num_blocks=32))
    k, v = kv(2, 40, 2, 16)
    e.allocate("b", "t", "s", list(range(40)))
    e.append("b", "t", ["s"], k, v, [40], token_ids=[list(range(40))])
    e.offload("b", "t", ["s"])
    s = scrape()
    disk = e.stats()["b"]["tiers"]["disk"]
    assert s["kvstore_disk_used_bytes"] == disk["used_bytes"] > 0
    assert s["kvstore_disk_held_bytes"] == disk["held_bytes"] > 0
    assert s["kvstore_disk_entries"] == disk["entries"] > 0
    assert "kvstore_disk_evictions_total" in s and "kvstore_disk_refused_values_total" in s
    assert not [n for n in s if n.startswith("kvstore_disk_") and "{" in n]       # no cache label
    per_cache = {n for n in s if 'tier="disk"' in n}
    assert {n.split("{")[0] for n in per_cache} == {
        "kvstore_tier_sequences", "kvstore_tier_offloads_total", "kvstore_tier_page_ins_total",
        "kvstore_tier_prefix_hits_total", "kvstore_tier_hit_rate", "kvstore_tier_bytes_down_total",
        "kvstore_tier_bytes_up_total"}
    assert s['kvstore_tier_sequences{cache="a",tier="disk"}'] == 0
    assert s['kvstore_tier_sequences{cache="b",tier="disk"}'] == 1
    assert s['kvstore_tier_offloads_total{cache="a",tier="disk"}'] == 0
    assert s['kvstore_tier_offloads_total{cache="b",tier="disk"}'] == 1
    for name in ("a", "b"):
        e.delete_cache(name, force=True)
    after = scrape()
    # still there without a cache: the store and its blocks outlive it
    assert after["kvstore_disk_used_bytes"] == e.disk_stats()["used_bytes"] > 0
    e.close()


def test_metrics_over_http_and_unauthenticated_calls_counted(tmp_path):
    from kvstore.service.auth import Authenticator
    metrics = Metrics()
    server, port, _ = create_server(socket_path=str(tmp_path / "kv.sock"), port=0, metrics=metrics,
                                    auth=Authenticator({"t" * 20: "t"}))
    try:
        http_port = metrics.serve(0)
        with pytest.raises(grpc.RpcError):
            KVStoreClient(f"127.0.0.1:{port}", heartbeat=False).stats()
        body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
        assert 'kvstore_rpc_total{code="UNAUTHENTICATED",method="Stats"} 1.0' in body
        assert "kvstore_sessions" in body and "kvstore_registered_buffers" in body
    finally:
        metrics.stop()
        server.stop(0)


def test_malformed_bytes_are_invalid_argument_not_internal(live):
    sock, _, metrics = live
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        for method in ("Allocate", "Append", "Stats"):
            call = ch.unary_unary(f"/kvstore.v1.KVStore/{method}", request_serializer=None,
                                  response_deserializer=None)
            with pytest.raises(grpc.RpcError) as e:
                call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)   # a length prefix far past the end
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("request: malformed")
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/kvstore.v1.KVStore/Nope")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Nope" not in metrics.render()       # unknown paths add no label values


def test_a_call_whose_client_stopped_waiting_counts_as_its_status_not_ok(tmp_path):
    """The handler returns a reply after the client's deadline passed (or it cancelled):
    the client saw DEADLINE_EXCEEDED, and so does kvstore_rpc_total."""
    import time
    from kvstore.engine.engine import Engine
    engine, metrics = Engine(), Metrics()
    server, _, _ = create_server(engine, socket_path=str(tmp_path / "kv.sock"), metrics=metrics)
    stats = engine.stats
    engine.stats = lambda *a, **kw: (time.sleep(0.6), stats(*a, **kw))[1]      # a call that outlives 0.2 s
    try:
        with KVStoreClient(f"unix://{tmp_path}/kv.sock", heartbeat=False, timeout=0.2) as kv:
            with pytest.raises(grpc.RpcError) as e:
                kv.stats()
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.8)                                              # the handler returns meanwhile
        s = samples(metrics.render())
        assert s['kvstore_rpc_total{code="DEADLINE_EXCEEDED",method="Stats"}'] == 1
        assert 'kvstore_rpc_total{code="OK",method="Stats"}' not in s
    finally:
        server.stop(0)


def test_debug_invariants_turn_a_broken_pool_into_internal(tmp_path, monkeypatch):
    from kvstore.engine.engine import Engine
    monkeypatch.setenv("KVSTORE_DEBUG_INVARIANTS", "1")
    engine = Engine()
    server, _, _ = create_server(engine, socket_path=str(tmp_path / "kv.sock"))
    try:
        kv = KVStoreClient(f"unix://{tmp_path}/kv.sock", heartbeat=False)
        kv.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, num_blocks=16)
        kv.stats()
        engine.cache("c").main_pool.blocks[3].ref_cnt = 2        # a leak the pool cannot explain
        kv.stats()                       # a call that changes nothing is not checked (it would wait on every lock)
        with pytest.raises(grpc.RpcError) as e:
            kv.allocate("c", "x", [1, 2, 3])
        assert e.value.code() == grpc.StatusCode.INTERNAL and "invariant broken after Allocate" in e.value.details()
    finally:
        server.stop(0)


def test_pool_budget_refuses_a_cache_past_it(tmp_path):
    server, _, _ = create_server(socket_path=str(tmp_path / "kv.sock"), max_pool_bytes=1 << 20)
    try:
        kv = KVStoreClient(f"unix://{tmp_path}/kv.sock", heartbeat=False)
        spec = dict(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16", block_size=8)
        kv.create_cache("small", "m", num_blocks=16, **spec)
        with pytest.raises(grpc.RpcError) as e:
            kv.create_cache("huge", "m", num_blocks=1 << 20, **spec)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details().startswith("spec.num_blocks")
        with pytest.raises(grpc.RpcError) as e:     # named: the part of the spec that does not fit
            kv.create_cache("huge", "m", pool_bytes=1 << 30, **spec)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details().startswith("spec.pool_bytes")
        with pytest.raises(grpc.RpcError) as e:
            kv.create_cache("huge", "m", num_blocks=16, host_bytes=1 << 30, **spec)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details().startswith("spec.host_bytes")
        assert "for its host tier" in e.value.details()
        kv.create_cache("small", "m", num_blocks=16, exist_ok=True, **spec)   # an existing cache costs nothing
    finally:
        server.stop(0)


# ------------------------------------------------------------------- admin
def run_admin(capsys, *argv):
    admin.main(list(argv))
    return capsys.readouterr().out


def test_admin_commands(live, capsys):
    sock, kv, _ = live
    kv.fork("pq", "a", "a2")
    base = ["--socket", sock]
    out = run_admin(capsys, *base, "stats")
    assert "cache pq: 3 sequences" in out and "tier" in out and "main" in out and "tail" in out
    js = json.loads(run_admin(capsys, *base, "--json", "stats"))
    assert js["caches"][0]["cache"] == "pq" and int(js["caches"][0]["sequences"]) == 3
    out = run_admin(capsys, *base, "seqs")
    assert "a2" in out and "sequence" in out
    js = json.loads(run_admin(capsys, *base, "seqs", "--cache", "pq", "--json"))
    assert sorted(s["sequence_id"] for s in js["pq"]) == ["a", "a2", "b"]
    out = run_admin(capsys, *base, "seq", "a")
    assert "cache pq" in out and "length: 40" in out
    js = json.loads(run_admin(capsys, *base, "blocks", "--json"))
    assert js["pq"]["refs_histogram"]          # blocks shared by a, b and the fork
    assert "3" in js["pq"]["refs_histogram"]
    out = run_admin(capsys, *base, "watch", "--count", "2", "--interval", "0.05")
    assert out.count("cache pq:") == 2
    assert run_admin(capsys, *base, "health").strip() == "SERVING"
    with pytest.raises(SystemExit, match="no sequence"):
        admin.main([*base, "seq", "missing"])


def test_admin_stats_reads_the_disk_as_entries_and_bytes_not_as_a_pool():
    """The disk tier is no pool of blocks: its line gives entries (blocks and
    manifests) and bytes against its bound, none of them in the blocks table, once for
    the one store every cache reports; a cache whose tokens are all below the GPU says
    so instead of an effective x0.00."""
    from kvstore.v1 import kvstore_pb2 as pb
    c = [pb.CacheStats(cache=name, tokens=80, bytes_per_token=64, fp16_bytes_per_token=256, compression_ratio=4.0,
                       main=pb.PoolStats(capacity=16, free=16), disk_entries=12, disk_bytes=16384,
                       disk_used_bytes=14438, disk_max_bytes=1 << 30, disk_held_bytes=14438) for name in "cd"]
    out = admin.render_stats(pb.StatsReply(caches=c))
    assert out.count("disk (shared by every cache)") == 1
    assert out.splitlines()[-1].startswith("disk (shared by every cache): 12 entries (blocks and manifests), "
                                           "14.1 KiB used of a 1.0 GiB bound")
    assert not any(line.split()[:2] == ["disk", "-"] for line in out.splitlines())      # no table row
    assert "effective: no tokens in the main and tail pools (80 tokens below them)" in out and "x0.00" not in out


def test_admin_console_script(live):
    sock, _, _ = live
    exe = os.path.join(os.path.dirname(sys.executable), "kvstore-admin")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "kvstore.tools.admin"]
    r = subprocess.run(cmd + ["--socket", sock, "stats"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cache pq: 2 sequences" in r.stdout
    r = subprocess.run(cmd + ["--socket", os.path.basename(sock), "health"], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(sock))          # a path relative to where it runs
    assert r.returncode == 0 and r.stdout.strip() == "SERVING", r.stderr
