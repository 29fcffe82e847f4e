"""The shared Redis tier against a real redis-server (tests/tiers/redis_server.py):
blocks cross daemons bit-identical, values that do not check out are refused,
Redis down or slow never fails or holds up a request, hits resume after its
restart, the put queue is bounded."""
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.hashing import fp16_key
from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument
from kvstore.service.metrics import Metrics
from kvstore.tiers.redis_format import HEADER_BYTES, KEY_PREFIX, block_key, pack_value
from kvstore.tiers.redis_store import CredentialsRefused, RedisConfig
from tests.helpers import ROOT, config
from tests.tiers.netns import hosts  # noqa: F401 (fixture)
from tests.tiers.redis_server import redis_server, two_hosts  # noqa: F401 (fixtures)

T = "default"
L, HKV, D, BS = 2, 2, 16, 16
N = 200                  # prompt tokens: 12 full blocks, the first 11 sealed (residual 8)
SEALED = 11


def codebooks(d: int = D) -> Codebooks:
    g = torch.Generator().manual_seed(0)
    return Codebooks(k=torch.randn(L, HKV, d // 2, 256, 2, generator=g), v=torch.randn(L, HKV, d // 2, 256, 2, generator=g))


def engine(url, lmdb=None, num_blocks=64, codec="pq", sink_tokens=0, max_sequences=16, device="cpu", **kw) -> Engine:
    """device cuda: head_dim 64 (one the GPU kernels take), else D."""
    d = 64 if device == "cuda" else D
    e = Engine(device, lmdb_path=lmdb, redis=RedisConfig(url, **kw))
    e.create_cache(dataclasses.replace(config(block_size=BS, num_blocks=num_blocks, codec=codec, sink_tokens=sink_tokens,
                                              max_sequences=max_sequences, head_dim=d), device=device))
    if codec == "pq":
        e.set_codebooks("c", codebooks(d))
    return e


def prompt(i: int) -> list[int]:
    return [i * 100_000 + t for t in range(N)]


def fill(e, sid, tokens, seed=1, lookup=True, cache="c"):
    """Allocate with the prompt (lookup: its cached prefix is used), append the rest with ids."""
    g, d = torch.Generator().manual_seed(seed), e.cache(cache).cfg.geometry.head_dim
    k, v = (torch.randn(L, len(tokens), HKV, d, generator=g).half().to(e.device) for _ in range(2))
    cached = e.allocate(cache, T, sid, tokens if lookup else []).cached_tokens
    e.append(cache, T, [sid], k[:, cached:], v[:, cached:], [len(tokens) - cached], token_ids=[tokens[cached:]])


def rstats(e) -> dict:
    return e.stats()["c"]["redis"]


def wait_for(cond, timeout=10.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_blocks_cross_engines_and_bad_values_are_refused(redis_server):
    a, b = engine(redis_server.url), engine(redis_server.url)
    fill(a, "a", prompt(1))
    wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="A's puts")
    assert rstats(a)["bytes_out"] == SEALED * a.cache("c").main.block_bytes()
    fp = a.cache("c").fingerprint
    hashes = list(a.sequence_info("c", T, "a").block_hashes)
    r = redis_server.client()
    keys = [block_key(fp, h) for h in hashes[:SEALED]]
    good = [r.get(k) for k in keys]
    assert all(v is not None for v in good) and r.dbsize() == SEALED

    j = 3
    payload = good[j][HEADER_BYTES:]
    flipped = bytearray(good[j])
    flipped[-1] ^= 1
    older = bytearray(good[j])
    older[4:6] = (2).to_bytes(2, "little")               # the format version before this one
    bad = {"garbage": b"not a block",
           "another fingerprint": pack_value(bytes(32), hashes[j], payload),
           "another block's value": good[j + 1],
           "short payload": pack_value(fp, hashes[j], payload[:-1]),
           "bad checksum": bytes(flipped),
           "another format version": bytes(older)}
    for n, (what, value) in enumerate(bad.items(), 1):
        r.set(keys[j], value)
        res = b.allocate("c", T, f"b{n}", prompt(1))
        assert res.cached_tokens == j * BS, what          # stops before the block: never served
        assert rstats(b)["refused"] == n, what
    r.delete(keys[j])
    r.rpush(keys[j], b"a list")                           # a value of another type (WRONGTYPE)
    assert b.allocate("c", T, "b-list", prompt(1)).cached_tokens == j * BS
    assert rstats(b)["refused"] == len(bad) + 1
    r.delete(keys[j])
    assert b.allocate("c", T, "b-miss", prompt(1)).cached_tokens == j * BS
    assert rstats(b)["misses"] == 1

    r.set(keys[j], good[j])
    assert b.allocate("c", T, "b", prompt(1)).cached_tokens == SEALED * BS
    for x, y in zip(a.retrieve("c", T, "a", 0, SEALED * BS), b.retrieve("c", T, "b", 0, SEALED * BS)):
        assert torch.equal(x, y)                          # the same codes, bit for bit
    s = rstats(b)
    assert s["prefix_hits"] == SEALED and s["bytes_in"] == SEALED * a.cache("c").main.block_bytes()
    time.sleep(0.2)
    assert rstats(b)["blocks_out"] == 0, "blocks that came from Redis are not put back"
    b.check_invariants()


def test_sink_blocks_cross_engines_with_the_sealed_ones(redis_server):
    """A pq cache with sink tokens: its fp16 sink blocks go up beside the PQ
    blocks (under fp16_key), and another engine's prompt hits both,
    bit-identical. A value of the other kind's length under a sink key is refused."""
    sinks, sealed = 2, 9                  # S = 32: blocks 0-1 sinks, 9 sealed (residual 8), 1 tail
    a, b = engine(redis_server.url, sink_tokens=sinks * BS), engine(redis_server.url, sink_tokens=sinks * BS)
    fill(a, "a", prompt(1))
    main_w, tail_w = a.cache("c").main.block_bytes(), a.cache("c").tail.block_bytes()
    wait_for(lambda: rstats(a)["blocks_out"] == sinks + sealed, what="A's puts")
    assert rstats(a)["bytes_out"] == sinks * tail_w + sealed * main_w
    hashes = list(a.sequence_info("c", T, "a").block_hashes)
    r, fp = redis_server.client(), a.cache("c").fingerprint
    key = fp16_key(hashes[1])
    assert r.get(block_key(fp, hashes[1])) is None                              # its fp16 form, not under its hash
    good = r.get(block_key(fp, key))
    assert len(good) == HEADER_BYTES + tail_w
    r.set(block_key(fp, key), pack_value(fp, key, bytes(main_w)))              # right key, a sealed block's length
    assert b.allocate("c", T, "b0", prompt(1)).cached_tokens == BS             # the first sink only
    assert rstats(b)["refused"] == 1
    r.set(block_key(fp, key), good)
    n = (sinks + sealed) * BS
    assert b.allocate("c", T, "b", prompt(1)).cached_tokens == n
    for x, y in zip(a.retrieve("c", T, "a", 0, n), b.retrieve("c", T, "b", 0, n)):
        assert torch.equal(x, y)
    s = rstats(b)      # b0's first sink block, then b's second (its first is b0's, on b's GPU) and the sealed ones
    assert s["prefix_hits"] == sinks + sealed and s["bytes_in"] == sinks * tail_w + sealed * main_w
    time.sleep(0.2)
    assert rstats(b)["blocks_out"] == 0, "blocks that came from Redis are not put back"
    b.check_invariants()


@pytest.mark.parametrize("codec", ["fp16", "pq"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_blocks_a_decode_step_fills_go_up_with_its_tokens(redis_server, codec, device):
    """AppendAttend writes its tokens with the attention (the last layer's after the
    block has its hash): the put of a block the step filled (codec fp16: any; pq: a
    sink block) packs it after that write, so another engine is served the step's K/V,
    not zeros where its newest row was."""
    sinks = 2 * BS if codec == "pq" else 0
    a, b = (engine(redis_server.url, codec=codec, sink_tokens=sinks, device=device) for _ in range(2))
    ids, d = prompt(4)[:2 * BS + 3], a.cache("c").cfg.geometry.head_dim
    a.allocate("c", T, "a", [])
    g = torch.Generator().manual_seed(5)
    for t in ids:                                 # a decode loop: one token a step, layer by layer
        for layer in range(L):
            k, v, q = (torch.randn(1, n * HKV, d, generator=g).half().to(device) for n in (1, 1, 2))
            out = torch.empty_like(q)             # on a GPU: the decode graph writes the tokens
            a.append_attend("c", T, layer, ["a"], k, v, q, out=out, token_ids=[t])
    wait_for(lambda: rstats(a)["blocks_out"] == 2, what="the two full blocks' puts")
    assert b.allocate("c", T, "b", ids).cached_tokens == 2 * BS
    for x, y in zip(a.retrieve("c", T, "a", 0, 2 * BS), b.retrieve("c", T, "b", 0, 2 * BS)):
        assert torch.equal(x, y)
    b.check_invariants()


@pytest.mark.parametrize("below", ["lmdb", "none"])
def test_fp16_tail_blocks_go_up_when_their_sequence_is_freed(tmp_path, redis_server, below):
    """A pq prompt's full fp16 tail block is not put when it fills (a live sequence
    seals it as it grows, and its PQ codes go up then) but when its sequence is freed,
    with or without a tier below the GPU and before anything is evicted: then another
    engine (a chat's next turn on another host) hits every full block of the prompt."""
    a = engine(redis_server.url, lmdb=str(tmp_path / "lmdb") if below == "lmdb" else None, sink_tokens=2 * BS,
               max_sequences=2)
    fill(a, "a", prompt(1))
    n = N // BS * BS                                  # 12 full blocks: 2 sinks, 9 sealed, 1 tail
    want = a.retrieve("c", T, "a", 0, n)
    tail_hash = a.sequence_info("c", T, "a").block_hashes[n // BS - 1]
    r, fp = redis_server.client(), a.cache("c").fingerprint
    wait_for(lambda: rstats(a)["blocks_out"] == 11, what="the sinks' and the sealed blocks' puts")
    assert r.get(block_key(fp, fp16_key(tail_hash))) is None
    a.free("c", T, ["a"])
    wait_for(lambda: rstats(a)["blocks_out"] == 12, what="the freed tail block's put")
    assert a.cache("c").tail_pool.lookup(tail_hash) is not None, "still cached here: nothing was evicted"
    assert rstats(a)["bytes_out"] == 3 * a.cache("c").tail_io.block_bytes() + 9 * a.cache("c").main_io.block_bytes()
    b = engine(redis_server.url, sink_tokens=2 * BS)
    assert b.allocate("c", T, "b", prompt(1)).cached_tokens == n
    for x, y in zip(want, b.retrieve("c", T, "b", 0, n)):
        assert torch.equal(x, y)
    b.check_invariants()
    for i in range(30):                               # evicted later: not put again
        if a.cache("c").tail_pool.lookup(tail_hash) is None:
            break
        fill(a, f"x{i}", prompt(10 + i), lookup=False)
        a.free("c", T, [f"x{i}"])
    assert a.cache("c").tail_pool.lookup(tail_hash) is None
    time.sleep(0.2)
    assert rstats(a)["blocks_out"] == 12 * (i + 1)    # each prompt's 12 blocks, once


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_longer_prompt_on_another_engine_seals_an_fp16_block_from_redis(tmp_path, redis_server, device):
    """A prompt's fp16 tail block that went up to Redis when it spilled, before it
    sealed anywhere, serves a longer prompt on another engine (a chat's next turn
    on another host): that prompt seals it, so its fp16 form is read and encoded
    there, and the sequence holds what one given all its K/V afresh holds."""
    a = engine(redis_server.url, lmdb=str(tmp_path / "lmdb"), sink_tokens=2 * BS, max_sequences=2, device=device)
    fill(a, "a", prompt(1))
    n = N // BS * BS                                  # 12 full blocks: 2 sinks, 9 sealed, 1 tail
    tail_hash = a.sequence_info("c", T, "a").block_hashes[n // BS - 1]
    a.free("c", T, ["a"])
    for i in range(30):
        if a.cache("c").tail_pool.lookup(tail_hash) is None:
            break
        fill(a, f"x{i}", prompt(10 + i), lookup=False)
        a.free("c", T, [f"x{i}"])
    r, fp = redis_server.client(), a.cache("c").fingerprint
    wait_for(lambda: r.get(block_key(fp, fp16_key(tail_hash))) is not None, what="the spilled block's put")
    assert r.get(block_key(fp, tail_hash)) is None, "no PQ form of it anywhere"

    b = engine(redis_server.url, sink_tokens=2 * BS, device=device)
    longer = prompt(1) + [7_000_000 + t for t in range(3 * BS)]
    d = b.cache("c").cfg.geometry.head_dim
    g = torch.Generator().manual_seed(1)              # fill()'s K/V of prompt(1), then the new tokens'
    k, v = torch.randn(L, N, HKV, d, generator=g).half(), torch.randn(L, N, HKV, d, generator=g).half()
    g = torch.Generator().manual_seed(2)
    more = torch.randn(2, L, 3 * BS, HKV, d, generator=g).half()
    k, v = (torch.cat([x, y], 1).to(device) for x, y in zip((k, v), more))
    hit = b.allocate("c", T, "b", longer).cached_tokens
    assert hit == n and len(b.sequence_info("c", T, "b").sealed_blocks) == n // BS - 2
    c = b.cache("c")
    s = rstats(b)
    assert s["prefix_hits"] == n // BS and s["misses"] == 1, s       # the block after: one miss, two forms asked
    assert s["bytes_in"] == 3 * c.tail_io.block_bytes() + 9 * c.main_io.block_bytes()
    b.append("c", T, ["b"], k[:, hit:], v[:, hit:], [len(longer) - hit], token_ids=[longer[hit:]])
    b.allocate("c", T, "fresh", [])
    b.append("c", T, ["fresh"], k, v, [len(longer)])
    got, want = b.retrieve("c", T, "b", 0, len(longer)), b.retrieve("c", T, "fresh", 0, len(longer))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    wait_for(lambda: r.get(block_key(fp, tail_hash)) is not None, what="its PQ form's put, once encoded")
    b.check_invariants()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_reserve_completing_a_client_written_block_puts_it_in_the_clients_cuda_order(redis_server, codec):
    """A mapped client writes reserved slots on its own stream; the commit at its
    next Reserve may complete a block that goes up to Redis (a pq sink block;
    codec fp16, any block). Its put packs the block, so that Reserve runs in the
    client's CUDA order (gpu_scope), not a later call of anyone's."""
    e = engine(redis_server.url, codec=codec, sink_tokens=2 * BS if codec == "pq" else 0)
    c = e.cache("c")
    ids = prompt(3)[:2 * BS + 8]                  # two full blocks (the sinks, for pq) and half a third
    e.allocate("c", T, "a", ids)
    e.reserve("c", T, "a", len(ids))              # the client writes these slots, then reserves the next one
    entered = []

    def scope():
        entered.append(True)
        return contextlib.nullcontext()
    assert c.reserve_touches_gpu(c.seq(T, "a"), 1)
    e.reserve_batch("c", T, ["a"], 1, gpu_scope=scope)
    assert entered and not c.redis.pending, "packed in the client's order, at once"
    wait_for(lambda: rstats(e)["blocks_out"] == 2, what="the two blocks' puts")
    e.reserve_batch("c", T, ["a"], 1, gpu_scope=scope)       # a step that completes nothing: no GPU work
    assert len(entered) == 1


def test_down_or_slow_redis_never_holds_up_a_request(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.redis")
    a = engine(redis_server.url, timeout_s=0.2, backoff_s=0.5)
    b = engine(redis_server.url, timeout_s=0.2, backoff_s=0.5)
    metrics = Metrics()
    metrics.bind(engine=b)
    fill(a, "a", prompt(1))
    wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="A's puts")

    redis_server.kill()
    for i in range(5):
        t0 = time.monotonic()
        assert b.allocate("c", T, f"down{i}", prompt(1)).cached_tokens == 0
        assert time.monotonic() - t0 < 0.1               # a refused connection: no wait
        b.free("c", T, [f"down{i}"])
        fill(a, f"a-down{i}", prompt(10 + i))            # seals and puts: dropped
        a.free("c", T, [f"a-down{i}"])
    a.attend("c", T, 0, ["a"], torch.randn(1, 4, D).half())
    wait_for(lambda: rstats(a)["state"] == "down", what="A down")
    assert rstats(b)["state"] == "down" and rstats(b)["errors"] >= 1 and rstats(b)["last_error"]
    assert rstats(a)["dropped_puts"] > 0
    assert "kvstore_redis_up 0.0" in metrics.render()
    # (engines of earlier tests, whose Redis is gone, log too: only this Redis's lines count)
    mine = lambda level, text: sum(1 for r in caplog.records if r.levelno == level and text in r.getMessage()  # noqa: E731
                                   and redis_server.url in r.getMessage())
    assert mine(logging.WARNING, "down") == 2, "one warning per outage per daemon"

    redis_server.start()       # same port; its AOF kept what A put
    n = 0

    def b_hits():
        nonlocal n
        n += 1
        if b.allocate("c", T, f"up{n}", prompt(1)).cached_tokens == SEALED * BS:
            return True
        b.free("c", T, [f"up{n}"])
        return False
    wait_for(b_hits, timeout=5, what="hits after the restart")
    assert rstats(b)["state"] == "up" and rstats(b)["prefix_hits"] == SEALED
    wait_for(lambda: rstats(a)["state"] == "up", timeout=5, what="A up again: its writer asks")
    assert mine(logging.INFO, "back") == 2, "one recovery per outage per daemon"
    out = metrics.render()
    assert "kvstore_redis_up 1.0" in out and 'kvstore_tier_prefix_hits_total{cache="c",tier="redis"} 11.0' in out

    redis_server.pause()       # slow: accepts, never answers
    t0 = time.monotonic()
    assert b.allocate("c", T, "slow0", prompt(2)).cached_tokens == 0
    assert time.monotonic() - t0 < 0.2 + 0.3           # one socket timeout, once
    t0 = time.monotonic()
    for i in range(1, 4):
        assert b.allocate("c", T, f"slow{i}", prompt(2 + i)).cached_tokens == 0
    assert time.monotonic() - t0 < 0.1                 # skipped while the breaker is open
    assert rstats(b)["state"] == "down"
    redis_server.resume()


@pytest.mark.parametrize("below", ["lmdb", "none"])
def test_blocks_missed_at_seal_go_up_when_they_spill(tmp_path, redis_server, below):
    a = engine(redis_server.url, lmdb=str(tmp_path / "lmdb") if below == "lmdb" else None, num_blocks=24,
               backoff_s=0.5)
    redis_server.kill()
    fill(a, "a", prompt(1), lookup=False)       # sealed while Redis is down: not put
    wait_for(lambda: rstats(a)["dropped_puts"] == SEALED, what="the writer to give up")
    assert rstats(a)["blocks_out"] == 0 and rstats(a)["state"] == "down"
    a.free("c", T, ["a"])                       # its blocks stay cached on the GPU
    redis_server.start()
    wait_for(a.redis.ping, what="Redis back")
    for i in range(3):                          # pressure: the cached blocks spill to LMDB, and to Redis
        fill(a, f"x{i}", prompt(10 + i), lookup=False)
        a.free("c", T, [f"x{i}"])
    if below == "lmdb":
        assert a.stats()["c"]["tiers"]["spilled_blocks"] >= SEALED
    b = engine(redis_server.url)
    wait_for(lambda: rstats(a)["blocks_out"] >= 3 * SEALED, what="A's puts")
    assert b.allocate("c", T, "b", prompt(1)).cached_tokens == SEALED * BS
    assert rstats(b)["prefix_hits"] == SEALED


def test_a_block_redis_evicted_goes_up_again_when_a_prompt_seals_it(redis_server):
    """Redis drops keys (maxmemory under allkeys-lru, a TTL) behind the engine's
    record of what it put: a lookup that misses such a block puts it, and the
    prefix after it, again as the prompt seals them, so the hole closes instead
    of stopping every later lookup of the prefix there."""
    a = engine(redis_server.url, num_blocks=24)
    fill(a, "a", prompt(1))
    wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="A's puts")
    hashes = list(a.sequence_info("c", T, "a").block_hashes)
    r, fp, j = redis_server.client(), a.cache("c").fingerprint, 4
    r.delete(block_key(fp, hashes[j]))                  # evicted by Redis
    a.free("c", T, ["a"])
    for i in range(30):                                 # and by this engine's own pool
        if all(a.cache("c").main_pool.lookup(h) is None for h in hashes[:SEALED]):
            break
        fill(a, f"x{i}", prompt(10 + i), lookup=False)
        a.free("c", T, [f"x{i}"])
    out = 12 * (i + 1)                                  # each prompt's sealed blocks and, once freed, its tail's
    wait_for(lambda: rstats(a)["blocks_out"] == out, what="the puts of the prompts so far")
    misses = rstats(a)["misses"]
    assert a.allocate("c", T, "again", prompt(1)).cached_tokens == j * BS      # Redis's blocks up to the hole
    assert rstats(a)["misses"] == misses + 1
    g = torch.Generator().manual_seed(1)                # the K/V fill gave the prompt
    k, v = (torch.randn(L, N, HKV, D, generator=g).half()[:, j * BS:] for _ in range(2))
    a.append("c", T, ["again"], k, v, [N - j * BS], token_ids=[prompt(1)[j * BS:]])    # seals the rest here
    wait_for(lambda: r.get(block_key(fp, hashes[j])) is not None, what="the missed block's put")
    wait_for(lambda: rstats(a)["blocks_out"] == out + SEALED - j, what="the prefix's puts from the hole on")
    b = engine(redis_server.url)
    n = N // BS * BS                                    # the sealed blocks and the first prompt's full tail block
    assert b.allocate("c", T, "b", prompt(1)).cached_tokens == n
    for x, y in zip(a.retrieve("c", T, "again", 0, n), b.retrieve("c", T, "b", 0, n)):
        assert torch.equal(x, y)


def test_blocks_back_from_this_hosts_disk_are_not_put_again(tmp_path, redis_server):
    e = engine(redis_server.url, lmdb=str(tmp_path / "lmdb"))
    fill(e, "a", prompt(1), lookup=False)
    wait_for(lambda: rstats(e)["blocks_out"] == SEALED, what="the puts at seal")
    e.offload("c", T, ["a"])
    e.free("c", T, ["a"])
    e.create_cache(config(name="d", block_size=BS))        # same fingerprint, its own pools and Redis view
    e.set_codebooks("d", codebooks())
    assert e.allocate("d", T, "b", prompt(1)).cached_tokens == N // BS * BS     # the sealed and the full tail block
    assert e.stats()["d"]["tiers"]["prefix_hits_disk"] == N // BS
    # Two fresh sealed blocks after the hit: the one writer puts in order, so once they
    # are counted, a put of the restored blocks (queued before them) would be too.
    fill(e, "m", [7_000_000 + t for t in range(48)], lookup=False, cache="d")
    wait_for(lambda: e.stats()["d"]["redis"]["blocks_out"] >= 2, what="the marker's puts")
    assert e.stats()["d"]["redis"]["blocks_out"] == 2 and e.stats()["d"]["redis"]["dropped_puts"] == 0


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_sequence_paged_in_from_disk_after_a_restart_is_not_put_again(tmp_path, redis_server, codec):
    # pq puts its sealed blocks; fp16 every full block, the tail's too (its one pool)
    puts, marker = (SEALED, 2) if codec == "pq" else (N // BS, 3)
    a = engine(redis_server.url, lmdb=str(tmp_path / "lmdb"), codec=codec)
    fill(a, "a", prompt(1), lookup=False)
    wait_for(lambda: rstats(a)["blocks_out"] == puts, what="the puts at seal")
    a.offload("c", T, ["a"])
    a.redis.close()
    a.cold_store.close()                   # a restart: the new engine knows nothing of what Redis holds
    b = engine(redis_server.url, lmdb=str(tmp_path / "lmdb"), codec=codec)
    assert b.cache("c").seq(T, "a").tier == "disk"
    b.prefetch("c", T, ["a"])
    assert b.cache("c").seq(T, "a").tier == "gpu"
    fill(b, "m", [7_000_000 + t for t in range(48)], lookup=False)     # fresh blocks: put after any others
    wait_for(lambda: rstats(b)["blocks_out"] >= marker, what="the marker's puts")
    assert rstats(b)["blocks_out"] == marker and rstats(b)["dropped_puts"] == 0


def test_put_queue_is_bounded_and_every_block_accounted(redis_server):
    # A put waits up to 30 s for the paused server: appends that waited on the
    # writer would take that long, far past any CPU time they need (a bound with
    # a wide margin, so a loaded machine cannot fail it).
    e = engine(redis_server.url, timeout_s=30.0, queue_bytes=2 * 1024)
    assert e.cache("c").main.block_bytes() == 1024
    redis_server.pause()
    t0 = time.monotonic()
    for i in range(5):        # 48 tokens: 2 sealed blocks each
        fill(e, f"s{i}", [i * 1000 + t for t in range(48)], lookup=False)     # puts only
    assert time.monotonic() - t0 < 15, "the writer is stuck on Redis; appends must not be"
    assert rstats(e)["dropped_puts"] >= 6
    redis_server.resume()
    wait_for(lambda: rstats(e)["blocks_out"] + rstats(e)["dropped_puts"] == 10, what="every block put or dropped")
    e.redis.close()


@pytest.mark.parametrize("url, field", [
    ("http://127.0.0.1:6379/0", "redis"), ("redis:///0", "redis"), ("redis://h:99999/0", "redis"),
    ("redis://h:6379/db0", "redis"), ("redis://h:6379/0?socket_timeout=9", "redis")])
def test_bad_config_names_the_flag(url, field):
    with pytest.raises(InvalidArgument) as e:
        RedisConfig(url)
    assert e.value.field == field
    with pytest.raises(InvalidArgument, match="redis-ttl"):
        RedisConfig("redis://h:1/0", ttl_s=-1)
    assert RedisConfig("rediss://kv:s3cret@h:6380/2").redacted() == "rediss://kv:***@h:6380/2"
    RedisConfig("rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=false")
    with pytest.raises(InvalidArgument, match="TLS"):
        RedisConfig("redis://h:6379/0?ssl_ca_certs=/etc/ca.pem")       # TLS files without TLS


def test_daemon_refuses_a_bad_url_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "server.py"),
                        "--socket", str(tmp_path / "kv.sock"), "--device", "cpu",
                        "--redis", "http://kv:s3cret@127.0.0.1:6379/0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore-server: ") and "--redis: " in lines[0] \
        and "redis://" in lines[0], r.stderr
    assert "s3cret" not in r.stderr


# ------------------------------------------------------- two daemons, two "hosts"
def test_two_daemons_share_prefix_blocks_through_redis(tmp_path, two_hosts, capsys):
    """Two daemons, each with its own socket, host tier and LMDB, as separate
    processes or on hosts of their own (network namespaces): B gets A's prefix
    blocks through Redis; Redis killed, both go on serving; Redis restarted
    (AOF), hits resume with no action on the daemons."""
    from kvstore.tools import admin
    from kvstore.client import KVStoreClient
    from tests.service.test_daemon_process import start_daemon, stop_daemon
    redis_server, daemon_hosts = two_hosts
    procs, kvs = [], []
    try:
        for name in ("a", "b"):
            run_in, url = daemon_hosts[name]
            p, target = start_daemon(str(tmp_path / name / "kv.sock"), run_in=run_in, extra=[
                "--lmdb", str(tmp_path / name / "lmdb"), "--redis", url, "--redis-backoff", "0.5"])
            procs.append(p)
            kv = KVStoreClient(target)
            kv.create_cache("c", "m", num_layers=L, num_q_heads=4, num_kv_heads=HKV, head_dim=D, block_size=BS,
                            residual=8, num_blocks=256, host_bytes=1 << 20)
            kv.set_codebooks("c", codebooks().to_bytes())
            kvs.append(kv)
        a, b = kvs

        def put(kv, sid, tokens, seed=1, cached=None):
            """The K/V of a prompt is a function of its seed: recomputing it gives the same values."""
            g = torch.Generator().manual_seed(seed)
            k = torch.randn(L, len(tokens), HKV, D, generator=g).half()
            if cached is None:
                cached = kv.allocate("c", sid, tokens)
            kv.append("c", [sid], k[:, cached:], -k[:, cached:], token_ids=[tokens[cached:]])

        def st(kv):
            return kv.stats("c").caches[0]
        for i in (1, 2, 3):
            put(a, f"a{i}", prompt(i), seed=i)
        wait_for(lambda: st(a).redis_blocks_out == 3 * SEALED, what="A's puts")
        assert st(a).redis_state == "up"

        # B: A's blocks, bit for bit.
        assert b.allocate("c", "b1", prompt(1)) == SEALED * BS
        assert st(b).prefix_hit_blocks_redis == SEALED
        for x, y in zip(a.retrieve("c", "a1", 0, SEALED * BS), b.retrieve("c", "b1", 0, SEALED * BS)):
            assert torch.equal(x, y)

        # A value that does not check out: refused, and B computes from there.
        r = redis_server.client()
        h = a.sequence_info("c", "a3").block_hashes[4]
        (key,) = list(r.scan_iter(match=KEY_PREFIX + b"*:" + h.hex().encode()))
        r.set(key, b"garbage")
        assert b.allocate("c", "b3", prompt(3)) == 4 * BS
        assert st(b).redis_refused == 1 and st(b).prefix_hit_blocks_redis == SEALED + 4
        put(b, "b3", prompt(3), seed=3, cached=4 * BS)     # recomputed: the same codes as A's
        wait_for(lambda: r.get(key) != b"garbage", what="B's put to replace the garbage")
        for x, y in zip(a.retrieve("c", "a3", 0, N), b.retrieve("c", "b3", 0, N)):
            assert torch.equal(x, y)

        # Redis killed: every call still succeeds on both daemons.
        keys = r.dbsize()
        redis_server.kill()
        assert b.allocate("c", "b-down", prompt(2)) == 0
        b.free("c", ["b-down"])
        put(a, "a4", prompt(4), seed=4)
        a.attend("c", 0, ["a1", "a4"], torch.randn(2, 4, D).half())
        b.attend("c", 1, ["b1", "b3"], torch.randn(2, 4, D).half())
        wait_for(lambda: st(a).redis_state == "down" and st(b).redis_state == "down", what="both see it down")
        assert st(a).redis_dropped_puts > 0 and st(b).redis_errors > 0 and st(b).redis_last_error
        admin.main(["--socket", str(tmp_path / "b" / "kv.sock"), "stats"])
        assert "redis down:" in capsys.readouterr().out

        # Restarted with its AOF: B's hits resume, no daemon restarted.
        redis_server.start()
        assert redis_server.client().dbsize() == keys, "the AOF brought back every block"
        n = [0]

        def b_hits():
            n[0] += 1
            if b.allocate("c", f"b2-{n[0]}", prompt(2)) == SEALED * BS:
                return True
            b.free("c", [f"b2-{n[0]}"])
            return False
        wait_for(b_hits, timeout=10, what="hits after Redis restarted")
        assert st(b).redis_state == "up" and st(b).prefix_hit_blocks_redis == 2 * SEALED + 4
        for x, y in zip(a.retrieve("c", "a2", 0, SEALED * BS), b.retrieve("c", f"b2-{n[0]}", 0, SEALED * BS)):
            assert torch.equal(x, y)
        admin.main(["--socket", str(tmp_path / "b" / "kv.sock"), "stats"])
        assert f"redis up: {2 * SEALED + 4} blocks in" in capsys.readouterr().out
    finally:
        for kv in kvs:
            kv.close()
        for p in procs:
            stop_daemon(p)


def test_acl_user_from_the_url_and_puts_the_server_refuses(redis_server, caplog):
    import logging
    caplog.set_level(logging.WARNING, logger="kvstore.redis")
    r = redis_server.client()
    # A user of its own that may touch only kvstore keys (what the module docstring advises).
    r.acl_setuser("kv", enabled=True, passwords=["+s3cret"], keys=["kvstore:*"], commands=["+@all"])
    port = redis_server.port
    # Refused credentials stop the start (no retry mends them), naming the URL without its password;
    # a password for the default user, which has none here, too.
    for url in (f"redis://kv:nope@127.0.0.1:{port}/0", f"redis://nobody:nope@127.0.0.1:{port}/0",
                f"redis://:nope@127.0.0.1:{port}/0"):
        with pytest.raises(CredentialsRefused, match="refused the URL's credentials") as e:
            engine(url)
        assert "nope" not in str(e.value) and ":***@" in str(e.value)
    e = engine(f"redis://kv:s3cret@127.0.0.1:{port}/0")
    fill(e, "a", prompt(1), lookup=False)
    wait_for(lambda: rstats(e)["blocks_out"] == SEALED, what="puts as user kv")
    assert r.dbsize() == SEALED
    r.config_set("maxmemory-policy", "noeviction")     # a full Redis that may not evict refuses writes
    r.config_set("maxmemory", "1")
    fill(e, "b", prompt(2), lookup=False)
    wait_for(lambda: rstats(e)["dropped_puts"] == SEALED, what="refused puts")
    s = rstats(e)
    assert s["state"] == "up" and s["blocks_out"] == SEALED and s["errors"] == SEALED and "OutOfMemoryError" in s["last_error"]
    # Up but refusing is no outage: a WARNING says so, once for the burst.
    said = [m for rec in caplog.records if "Redis refused" in (m := rec.getMessage())]
    assert len(said) == 1 and "block puts" in said[0] and "OutOfMemoryError" in said[0], said


def test_ttl_is_set_by_puts_and_renewed_by_hits(redis_server):
    a = engine(redis_server.url, ttl_s=100)
    fill(a, "a", prompt(1), lookup=False)
    wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="puts")
    r = redis_server.client()
    keys = sorted(r.scan_iter(match=KEY_PREFIX + b"*"))
    assert len(keys) == SEALED and all(0 < r.ttl(k) <= 100 for k in keys)
    for k in keys:
        r.expire(k, 5)
    b = engine(redis_server.url, ttl_s=100)
    assert b.allocate("c", T, "b", prompt(1)).cached_tokens == SEALED * BS
    assert all(r.ttl(k) > 5 for k in keys)            # GETEX renewed them


def test_a_restarted_redis_is_read_at_once_not_taken_for_down(tmp_path):
    """Redis restarts (AOF: it comes back with its blocks) while an engine's read
    connections sit idle: the next lookup reads on fresh connections, hits, and
    counts no error, rather than fail on a dead one and skip Redis (and drop the
    puts) for a back-off."""
    from tests.tiers.redis_server import RedisServer
    srv = RedisServer(str(tmp_path), appendonly=True)
    try:
        a = engine(srv.url, backoff_s=5.0)
        fill(a, "a", prompt(1), lookup=False)
        wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="puts")
        b = engine(srv.url, backoff_s=5.0)
        assert b.allocate("c", T, "warm", prompt(3)).cached_tokens == 0     # a lookup: read connections, idle now
        srv.kill()
        srv.start()
        assert b.allocate("c", T, "b", prompt(1)).cached_tokens == SEALED * BS     # from the restarted Redis
        fill(b, "new", prompt(2))
        s = rstats(b)
        assert (s["state"], s["errors"], s["dropped_puts"]) == ("up", 0, 0), s
        wait_for(lambda: rstats(b)["blocks_out"] == SEALED, what="B's puts after the restart")
    finally:
        srv.kill()


def test_blocks_go_up_again_after_redis_restarted_empty_between_calls(tmp_path):
    """Redis restarts without its data while no call of the engine's is in flight, so
    none fails: the writer's check finds another run_id within a second, and the
    blocks the engine had put go up again when they spill, rather than being taken
    as still there."""
    from tests.tiers.redis_server import RedisServer
    srv = RedisServer(str(tmp_path), appendonly=False)
    try:
        a = engine(srv.url, num_blocks=24)
        fill(a, "a", prompt(1), lookup=False)
        first = a.sequence_info("c", T, "a").block_hashes[0]
        wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="puts")
        a.free("c", T, ["a"])
        wait_for(lambda: rstats(a)["blocks_out"] == SEALED + 1, what="the freed tail block's put")
        before = a.cache("c").redis.store.epoch
        srv.kill()
        srv.start()
        assert srv.client().dbsize() == 0
        wait_for(lambda: a.cache("c").redis.store.epoch != before, timeout=5, what="the restart found")
        for i in range(3):            # pressure: A's cached blocks are evicted (no tier below: to Redis)
            fill(a, f"x{i}", prompt(10 + i), lookup=False)
            a.free("c", T, [f"x{i}"])
        assert a.cache("c").main_pool.lookup(first) is None
        b = engine(srv.url)

        def b_hits() -> bool:
            hit = b.allocate("c", T, "b", prompt(1)).cached_tokens
            b.free("c", T, ["b"])
            return hit == SEALED * BS
        wait_for(b_hits, what="A's sealed blocks back in Redis")
        s = rstats(a)
        assert (s["state"], s["errors"], s["dropped_puts"]) == ("up", 0, 0), s
    finally:
        srv.kill()


def test_a_down_redis_is_found_up_again_without_a_request(tmp_path):
    """An idle engine's books say Redis is up again once its back-off is over,
    without a request to try it."""
    from tests.tiers.redis_server import RedisServer
    srv = RedisServer(str(tmp_path), appendonly=False)
    try:
        a = engine(srv.url, backoff_s=0.5)
        srv.kill()
        assert a.allocate("c", T, "probe", prompt(2)).cached_tokens == 0    # sees the outage
        assert rstats(a)["state"] == "down"
        srv.start()
        wait_for(lambda: rstats(a)["state"] == "up", timeout=5, what="the writer's probe")
        assert rstats(a)["up"] == 1
    finally:
        srv.kill()


def test_blocks_go_up_again_after_redis_came_back_empty(tmp_path):
    from tests.tiers.redis_server import RedisServer
    srv = RedisServer(str(tmp_path), appendonly=False)          # a restart loses everything
    try:
        a = engine(srv.url, lmdb=str(tmp_path / "lmdb"), num_blocks=24, backoff_s=0.5)
        fill(a, "a", prompt(1), lookup=False)
        wait_for(lambda: rstats(a)["blocks_out"] == SEALED, what="puts")
        a.free("c", T, ["a"])
        wait_for(lambda: rstats(a)["blocks_out"] == SEALED + 1, what="the freed tail block's put")
        srv.kill()
        assert a.allocate("c", T, "probe", prompt(2)).cached_tokens == 0    # sees the outage
        a.free("c", T, ["probe"])
        srv.start()
        assert srv.client().dbsize() == 0
        wait_for(a.redis.ping, what="Redis back")
        for i in range(3):            # pressure: A's cached blocks spill, and go up again
            fill(a, f"x{i}", prompt(10 + i), lookup=False)
            a.free("c", T, [f"x{i}"])
        assert a.stats()["c"]["tiers"]["spilled_blocks"] >= SEALED
        # A's sealed blocks again (its tail block stays cached on the GPU), and each x's
        # sealed blocks and, once freed, its tail block
        wait_for(lambda: rstats(a)["blocks_out"] == (SEALED + 1) + SEALED + 3 * (SEALED + 1), what="A's puts")
        b = engine(srv.url)
        assert b.allocate("c", T, "b", prompt(1)).cached_tokens == SEALED * BS
    finally:
        srv.kill()


def test_blocks_this_hosts_disk_keeps_go_up_again_after_redis_came_back_empty(tmp_path):
    """Blocks that A's disk holds from an earlier spill, read back by a prefix hit after
    Redis restarted empty: when they spill again they go up again too, or another host
    would miss them for as long as A's disk keeps them."""
    from tests.tiers.redis_server import RedisServer
    srv = RedisServer(str(tmp_path), appendonly=False)
    try:
        a = engine(srv.url, lmdb=str(tmp_path / "lmdb"), num_blocks=24)
        fill(a, "a", prompt(1), lookup=False)
        first = a.sequence_info("c", T, "a").block_hashes[0]
        a.free("c", T, ["a"])
        for i in range(3):            # pressure: A's blocks spill to its disk
            fill(a, f"x{i}", prompt(10 + i), lookup=False)
            a.free("c", T, [f"x{i}"])
        c = a.cache("c")
        assert c.main_pool.lookup(first) is None and c.tiering.disk.has_block(c.fingerprint, first)
        before = c.redis.store.epoch
        srv.kill()
        srv.start()
        assert srv.client().dbsize() == 0
        wait_for(lambda: c.redis.store.epoch != before, timeout=5, what="the restart found")
        assert a.allocate("c", T, "a", prompt(1)).cached_tokens >= SEALED * BS      # from A's disk
        a.free("c", T, ["a"])
        for i in range(3):            # pressure again: A's sealed blocks spill, and go up
            fill(a, f"y{i}", prompt(20 + i), lookup=False)
            a.free("c", T, [f"y{i}"])
        assert c.main_pool.lookup(first) is None
        b = engine(srv.url)

        def b_hits() -> bool:
            hit = b.allocate("c", T, "b", prompt(1)).cached_tokens
            b.free("c", T, ["b"])
            return hit >= SEALED * BS
        wait_for(b_hits, what="A's sealed blocks back in Redis")
    finally:
        srv.kill()


def test_blocks_this_hosts_disk_keeps_are_not_put_again_while_redis_holds_them(tmp_path, monkeypatch):
    """Without a Redis restart, a block this host keeps below went up when it sealed: its
    later spills from the GPU (read back by a prefix hit, evicted again) put it no more,
    though the list of blocks known to be in Redis has long forgotten it (a host with more
    blocks than the list holds)."""
    from kvstore.tiers import redis as redis_tier
    from tests.tiers.redis_server import RedisServer
    monkeypatch.setattr(redis_tier, "KNOWN_HASHES", 2)
    srv = RedisServer(str(tmp_path), appendonly=False)
    try:
        a = engine(srv.url, lmdb=str(tmp_path / "lmdb"), num_blocks=24)
        c = a.cache("c")
        puts = []
        real = c.redis.put
        c.redis.put = lambda hashes, payload: (puts.extend(hashes), real(hashes, payload))[1]
        fill(a, "a", prompt(1), lookup=False)
        sealed = a.sequence_info("c", T, "a").block_hashes[:SEALED]
        a.free("c", T, ["a"])
        for round_ in range(3):
            for i in range(3):            # pressure: A's blocks spill to its disk
                fill(a, f"x{round_}{i}", prompt(10 + 3 * round_ + i), lookup=False)
                a.free("c", T, [f"x{round_}{i}"])
            assert c.main_pool.lookup(sealed[0]) is None and c.tiering.disk.has_block(c.fingerprint, sealed[0])
            assert a.allocate("c", T, "a", prompt(1)).cached_tokens >= SEALED * BS      # from A's disk
            a.free("c", T, ["a"])
        assert not c.redis.lost_since_start()
        # at its seal, and at its first spill (to the disk, which did not hold it yet; the
        # list had forgotten it): not at every later one
        assert all(puts.count(h) <= 2 for h in sealed), [puts.count(h) for h in sealed]
    finally:
        srv.kill()
