"""Attention sinks (CacheConfig.sink_tokens = S): the first S tokens of every
sequence stay in fp16 sink blocks at the front of its tail and are never
sealed. Checked on CPU against an fp64 reference over exact sinks,
dequantized sealed tokens and the exact tail, for lengths around S and the
sealing threshold; Retrieve order; prefix hits, fork, free, tiers and the
mapped-attend plan (sink blocks first in Reserve's tail_blocks)."""
import dataclasses
import hashlib
import json
import math

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.hashing import fp16_key
from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument
from kvstore.kernels import reference as ref
from tests.helpers import config, kv, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

T = "t"
L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
M = D // 2
SCALE = 1 / math.sqrt(D)
TOL = 1e-3        # fp32 kernels, fp16 output


def engine(sinks: int, codec: str = "pq", lmdb: str | None = None, host_bytes: int = 0, device: str = "cpu",
           **kw) -> Engine:
    """device cuda: head_dim 64 (one the GPU kernels take), else D."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    d = 64 if device == "cuda" else D
    e = Engine(device, lmdb_path=lmdb)
    cfg = config(codec, block_size=BS, residual=R, sink_tokens=sinks, head_dim=d, **kw)
    e.create_cache(dataclasses.replace(cfg, host_bytes=host_bytes, device=device))
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, d // 2, 256, 2, generator=g),
                                       v=torch.randn(L, HKV, d // 2, 256, 2, generator=g)))
    return e


def fill(e: Engine, sid: str, n: int, seed: int, prompt: list[int] | None = None):
    k, v = (t.to(e.device) for t in kv(L, n, HKV, e.cache("c").cfg.geometry.head_dim, seed=seed))
    e.allocate("c", T, sid, prompt or [])
    e.append("c", T, [sid], k, v, [n], token_ids=[prompt] if prompt else None)
    return k, v


def expected(e: Engine, sid: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K, V [L, n, Hkv, d] the cache must hold for what was appended
    (k, v [L, n, Hkv, d] fp16): sinks and tail exact, the sealed tokens
    [S, S + sealed) encoded and decoded with the cache's codebooks."""
    c = e.cache("c")
    a = c.sinks
    b = a + len(c.seq(T, sid).sealed) * BS
    ek, ev = k.float(), v.float()
    for layer in range(L):
        for x, out, cb in ((k, ek, c.codebooks.k[layer]), (v, ev, c.codebooks.v[layer])):
            if b > a:
                out[layer, a:b] = ref.pq_dequantize(ref.pq_encode(x[layer, a:b], cb), cb)
    return ek, ev


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, d], k/v [n, Hkv, d] -> fp64 [Hq, d]."""
    return ref.attention_dense(q.double(), k.double(), v.double(), SCALE)[0]


def sealed_blocks(n: int, sinks: int) -> int:
    return max(0, math.ceil((n - sinks - R - BS) / BS))


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("sinks", [-8, 12, 4, 65536 + 8, "16"])
def test_sink_tokens_must_be_a_whole_number_of_blocks(sinks):
    with pytest.raises(InvalidArgument) as err:
        config("pq", block_size=BS, sink_tokens=sinks)
    assert err.value.field == "sink_tokens"


def test_fp16_codec_accepts_sinks_and_needs_nothing():
    """Every fp16 token is exact already: sink_tokens is kept in the spec and
    changes neither the layout nor the fingerprint."""
    e0, e16 = engine(0, "fp16"), engine(16, "fp16")
    c16 = e16.cache("c")
    assert c16.cfg.sink_tokens == 16 and c16.sinks == 0
    assert c16.fingerprint == e0.cache("c").fingerprint
    for e in (e0, e16):
        k, v = fill(e, "a", 50, seed=1)
        info = e.sequence_info("c", T, "a")
        assert info.sink_blocks == 0 and len(info.sealed_blocks) == sealed_blocks(50, 0)
        got = e.retrieve("c", T, "a", 0, 50)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)


def test_sinks_change_the_pq_fingerprint_and_block_hashes():
    engines = {s: engine(s) for s in (0, 16, 32)}
    assert len({e.cache("c").fingerprint for e in engines.values()}) == 3
    hashes = []
    for e in engines.values():
        e.allocate("c", T, "a", list(range(40)))
        hashes.append(tuple(e.sequence_info("c", T, "a").block_hashes))
    assert len(set(hashes)) == 3
    # Caches without sinks keep the fingerprint they had before sinks existed,
    # so what they left in LMDB is found again.
    c0 = engines[0].cache("c")
    g = c0.cfg.geometry
    before = {"model_id": c0.cfg.model_id, "geometry": [g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.dtype],
              "codec": ["pq", M, BS], "codebooks": c0.codebooks.sha256()}
    assert c0.fingerprint == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).digest()


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("sinks", [16, 32])
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_attention_matches_fp64_reference(sinks, path):
    """Ragged batch: below S, exactly S, around the first seal (S + R + bs),
    long. prefill: one all-layer append; decode: half of it, then one token
    per layer at a time; then one AppendAttend step of the whole batch."""
    e = engine(sinks)
    c = e.cache("c")
    lens = [1, 5, sinks, sinks + R + BS - 1, sinks + R + BS, sinks + R + BS + 1, sinks + 97]
    data = {}
    for i, n in enumerate(lens):
        sid = f"s{i}"
        k, v = kv(L, n + 1, HKV, D, seed=10 + i)          # the last token is for AppendAttend
        e.allocate("c", T, sid, [])
        head = n if path == "prefill" else n // 2
        if head:
            e.append("c", T, [sid], k[:, :head], v[:, :head], [head])
        for p in range(head, n):
            for layer in range(L):
                e.append("c", T, [sid], k[layer, p:p + 1], v[layer, p:p + 1], [1], layer=layer)
        assert len(c.seq(T, sid).sealed) == sealed_blocks(n, sinks), (sid, n)
        data[sid] = (k, v)
    e.check_invariants()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(lens), HQ, D, generator=g).half()
    for layer in range(L):
        out = e.attend("c", T, layer, list(data), q)
        for b, (sid, (k, v)) in enumerate(data.items()):
            n = lens[b]
            ek, ev = expected(e, sid, k[:, :n], v[:, :n])
            assert torch.allclose(out[b].double(), dense(q[b], ek[layer], ev[layer]), rtol=TOL, atol=TOL), (sid, n)
    for layer in range(L):                                  # decode step: seals where the threshold is crossed
        k1 = torch.stack([k[layer, -1] for k, _ in data.values()])
        v1 = torch.stack([v[layer, -1] for _, v in data.values()])
        out = e.append_attend("c", T, layer, list(data), k1, v1, q)
        for b, (sid, (k, v)) in enumerate(data.items()):
            ek, ev = expected(e, sid, k, v)
            assert torch.allclose(out[b].double(), dense(q[b], ek[layer], ev[layer]), rtol=TOL, atol=TOL), sid
    for b, sid in enumerate(data):
        assert len(c.seq(T, sid).sealed) == sealed_blocks(lens[b] + 1, sinks)
    e.check_invariants()


@pytest.mark.parametrize("sinks", [16, 32])
def test_retrieve_is_in_position_order_with_bit_exact_sinks(sinks):
    e = engine(sinks)
    n = sinks + R + 5 * BS + 3
    k, v = kv(L, n, HKV, D, seed=3)
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], k[:, :5], v[:, :5], [5])              # a partial sink block, then one
    e.append("c", T, ["a"], k[:, 5:], v[:, 5:], [n - 5])          # append that completes it and seals
    info = e.sequence_info("c", T, "a")
    assert info.sink_blocks == sinks // BS and len(info.sealed_blocks) == sealed_blocks(n, sinks) == 5
    end = sinks + 5 * BS                                    # sealed tokens are [sinks, end)
    rk, rv = e.retrieve("c", T, "a", 0, n)
    assert torch.equal(rk[:, :sinks], k[:, :sinks]) and torch.equal(rv[:, :sinks], v[:, :sinks])
    assert torch.equal(rk[:, end:], k[:, end:]) and torch.equal(rv[:, end:], v[:, end:])
    ek, ev = expected(e, "a", k, v)
    assert torch.equal(rk, ek.half()) and torch.equal(rv, ev.half())
    assert not torch.equal(rk[:, sinks:end], k[:, sinks:end])           # quantized, not the input
    for a, b in ((0, 1), (sinks - 3, sinks + 5), (sinks, end), (end - 2, n), (3, n - 1), (sinks + 1, sinks + 2)):
        pk, pv = e.retrieve("c", T, "a", a, b, 1, 2)
        assert torch.equal(pk, rk[1:2, a:b]) and torch.equal(pv, rv[1:2, a:b]), (a, b)


# ------------------------------------------------------ sharing and freeing
def test_prefix_hit_shares_sink_blocks():
    S = 16
    e = engine(S)
    c = e.cache("c")
    prompt = list(range(100, 100 + S + R + 3 * BS + 5))    # 61 tokens: 7 full blocks
    k, v = fill(e, "a", len(prompt), seed=4, prompt=prompt)
    a = e.sequence_info("c", T, "a")
    hit = e.allocate("c", T, "b", prompt).cached_tokens
    assert hit == len(prompt) // BS * BS
    b = e.sequence_info("c", T, "b")
    assert b.sink_blocks == S // BS and b.tail_blocks[:2] == a.tail_blocks[:2] and b.sealed_blocks == a.sealed_blocks
    assert [c.tail_pool.blocks[x].ref_cnt for x in a.tail_blocks[:2]] == [2, 2]
    e.append("c", T, ["b"], k[:, hit:], v[:, hit:], [len(prompt) - hit], token_ids=[prompt[hit:]])
    ra, rb = e.retrieve("c", T, "a", 0, len(prompt)), e.retrieve("c", T, "b", 0, len(prompt))
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    e.check_invariants()
    # Freed sink blocks stay findable by hash, like freed tail blocks.
    e.free("c", T, ["a", "b"])
    assert e.stats()["c"]["tail"].used == 0
    assert e.allocate("c", T, "d", prompt[:S + 3]).cached_tokens == S
    assert e.sequence_info("c", T, "d").tail_blocks == a.tail_blocks[:2]
    e.append("c", T, ["d"], k[:, S:S + 3], v[:, S:S + 3], [3], token_ids=[prompt[S:S + 3]])
    rd = e.retrieve("c", T, "d", 0, S + 3)
    assert torch.equal(rd[0], k[:, :S + 3]) and torch.equal(rd[1], v[:, :S + 3])
    e.check_invariants()


@pytest.mark.parametrize("n", [5, 16 + R + 2 * BS + 3])
def test_fork_shares_full_sink_blocks_and_copies_a_partial_one(n):
    S = 16
    e = engine(S)
    k, v = fill(e, "a", n, seed=6)
    e.fork("c", T, "a", "b")
    a, b = e.sequence_info("c", T, "a"), e.sequence_info("c", T, "b")
    full = min(n, S) // BS
    assert b.tail_blocks[:full] == a.tail_blocks[:full] and b.sealed_blocks == a.sealed_blocks
    assert b.tail_blocks[-1] != a.tail_blocks[-1]                     # n is not a whole number of blocks
    k2, v2 = kv(L, 2 * S, HKV, D, seed=7)
    e.append("c", T, ["b"], k2, v2, [2 * S])
    ea, eb = expected(e, "a", k, v), expected(e, "b", torch.cat([k, k2], 1), torch.cat([v, v2], 1))
    ra, rb = e.retrieve("c", T, "a", 0, n), e.retrieve("c", T, "b", 0, n + 2 * S)
    assert torch.equal(ra[0], ea[0].half()) and torch.equal(ra[1], ea[1].half())
    assert torch.equal(rb[0], eb[0].half()) and torch.equal(rb[1], eb[1].half())
    e.check_invariants()


def test_free_returns_both_pools_to_the_start():
    e = engine(16)
    start = e.stats()["c"]
    prompt = list(range(50))
    k, v = fill(e, "a", 50, seed=8, prompt=prompt)
    hit = e.allocate("c", T, "b", prompt).cached_tokens
    e.append("c", T, ["b"], k[:, hit:], v[:, hit:], [50 - hit], token_ids=[prompt[hit:]])
    e.fork("c", T, "a", "f")
    e.reserve("c", T, "b", 3)
    fill(e, "short", 5, seed=9)
    e.append("c", T, ["f"], k[0, :2], v[0, :2], [2], layer=0)     # pending at layer 0
    e.check_invariants()
    assert e.stats()["c"]["tail"].used > 0
    e.free("c", T, ["a", "b", "f", "short"])
    end = e.stats()["c"]
    for pool in ("main", "tail"):
        s0, s1 = start[pool], end[pool]
        assert s1.used == s0.used == 0 and s1.free + s1.cached == s0.capacity, pool
    assert end["tail"].cached > 0                                        # full sink blocks stay findable
    e.check_invariants()


# -------------------------------------------------------------------- tiers
@pytest.mark.parametrize("via", ["host", "disk", "restart"])
def test_offload_page_in_is_bit_exact_with_sinks(tmp_path, via):
    S = 16
    lmdb = str(tmp_path / "lmdb")
    e = engine(S, lmdb=lmdb, host_bytes=1 << 20 if via == "host" else 0)
    prompt = list(range(200, 277))
    fill(e, "a", 77, seed=1, prompt=prompt)
    fill(e, "b", 5, seed=2)                                  # a partial sink block only
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3)).half()
    want = {s: e.retrieve("c", T, s, 0, n) for s, n in (("a", 77), ("b", 5))}
    out = e.attend("c", T, 1, ["a", "b"], q)
    c = e.cache("c")
    if via == "host":
        for s in ("a", "b"):
            c.tiering.to_host(c.seq(T, s))
    else:
        e.offload("c", T, ["a", "b"])
    assert {e.sequence_info("c", T, s).tier for s in ("a", "b")} == {"host" if via == "host" else "disk"}
    assert e.stats()["c"]["tail"].used == 0                  # the sink blocks went down with their sequences
    e.check_invariants()
    if via == "restart":                                     # a new daemon on the same LMDB finds them again
        e.cold_store.close()
        e = engine(S, lmdb=lmdb)
    e.prefetch("c", T, ["a", "b"])
    for s, n in (("a", 77), ("b", 5)):
        got = e.retrieve("c", T, s, 0, n)
        assert torch.equal(got[0], want[s][0]) and torch.equal(got[1], want[s][1]), s
    assert torch.equal(e.attend("c", T, 1, ["a", "b"], q), out)
    a = e.sequence_info("c", T, "a")
    assert a.sink_blocks == S // BS and len(a.sealed_blocks) == sealed_blocks(77, S)
    # The sink blocks are findable by hash again (the paged-in copies, or the
    # cached originals the index found first).
    assert e.allocate("c", T, "x", prompt[:S + 1]).cached_tokens == S
    e.append("c", T, ["x"], want["a"][0][:, S:S + 1], want["a"][1][:, S:S + 1], [1], token_ids=[prompt[S:S + 1]])
    got = e.retrieve("c", T, "x", 0, S + 1)
    assert torch.equal(got[0], want["a"][0][:, :S + 1]) and torch.equal(got[1], want["a"][1][:, :S + 1])
    e.append("c", T, ["a"], *kv(L, 9, HKV, D, seed=4), [9])  # decode goes on, sealing after the sinks
    assert len(e.sequence_info("c", T, "a").sealed_blocks) == sealed_blocks(86, S)
    e.check_invariants()


# -------------------------------------------- fp16 blocks below the GPU
def _churn_until_fp16_blocks_leave(e: Engine, hashes: list[bytes], host: bool = False) -> None:
    """Fill and free other prompts until the GPU tail pool (and the host's: host)
    holds none of the given fp16 blocks."""
    c = e.cache("c")
    held = [(c.tail_pool, h) for h in hashes] + ([(c.tiering.host.tail_pool, fp16_key(h)) for h in hashes] if host else [])
    for i in range(60):
        if all(pool.lookup(h) is None for pool, h in held):
            return
        fill(e, f"x{i}", 61, seed=50 + i, prompt=[10_000 * (i + 1) + t for t in range(61)])
        e.free("c", T, [f"x{i}"])
    raise AssertionError("the fp16 blocks never left the tail pools")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("below", ["host", "disk", "host-then-disk"])
def test_fp16_blocks_spill_below_and_serve_prefix_hits(tmp_path, below, device):
    """A freed prompt's fp16 blocks (sinks, and the full tail block), evicted
    from the GPU tail pool, are kept below it like its sealed blocks: the same
    prompt then hits every full block, the fp16 ones bit-exact."""
    S = 16
    e = engine(S, device=device)
    pair = e.cache("c").cfg.host_pair_bytes()
    host = {"host": 64 * pair, "disk": 0, "host-then-disk": 4 * pair}[below]
    e = engine(S, lmdb=str(tmp_path / "lmdb") if below != "host" else None, host_bytes=host, max_sequences=4,
               device=device)
    prompt = list(range(100, 161))                         # 7 full blocks: 2 sinks, 4 sealed, 1 tail
    k, v = fill(e, "a", len(prompt), seed=4, prompt=prompt)
    want = e.retrieve("c", T, "a", 0, len(prompt))
    hashes = e.sequence_info("c", T, "a").block_hashes
    e.free("c", T, ["a"])
    _churn_until_fp16_blocks_leave(e, hashes[:S // BS] + hashes[6:7], host=below == "host-then-disk")
    e.check_invariants()
    st = e.stats()["c"]["tiers"]
    before = st["prefix_hits_host"] + st["prefix_hits_disk"]
    hit = e.allocate("c", T, "b", prompt).cached_tokens
    assert hit == 7 * BS                                   # every full block: sinks, sealed and the tail one
    st = e.stats()["c"]["tiers"]
    assert st["prefix_hits_host"] + st["prefix_hits_disk"] - before >= S // BS + 1
    if below == "host-then-disk":
        assert st["prefix_hits_disk"] >= S // BS + 1       # they went on from the host to disk
    e.append("c", T, ["b"], k[:, hit:], v[:, hit:], [len(prompt) - hit], token_ids=[prompt[hit:]])
    got = e.retrieve("c", T, "b", 0, len(prompt))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][:, :S], k[:, :S]) and torch.equal(got[1][:, :S], v[:, :S])
    assert torch.equal(got[0][:, 6 * BS:], k[:, 6 * BS:]) and torch.equal(got[1][:, 6 * BS:], v[:, 6 * BS:])
    e.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_hits_with_sinks_survive_a_restart(tmp_path, device):
    """Offloaded to LMDB, a pq sequence with sinks gives a new prompt every full
    block after a restart, whether it is still listed or was freed."""
    S = 16
    lmdb = str(tmp_path / "lmdb")
    e = engine(S, lmdb=lmdb, device=device)
    prompt = list(range(300, 361))
    k, v = fill(e, "a", len(prompt), seed=5, prompt=prompt)
    want = e.retrieve("c", T, "a", 0, len(prompt))
    e.offload("c", T, ["a"])
    e.cold_store.close()
    e = engine(S, lmdb=lmdb, device=device)
    assert e.sequence_info("c", T, "a").tier == "disk"
    for step in ("a listed", "a freed"):
        hit = e.allocate("c", T, "b", prompt).cached_tokens
        assert hit == 7 * BS, step                          # sinks, sealed blocks and the full tail one, from disk
        assert e.stats()["c"]["tiers"]["prefix_hits_disk"] == 7, step
        e.append("c", T, ["b"], k[:, hit:], v[:, hit:], [len(prompt) - hit], token_ids=[prompt[hit:]])
        got = e.retrieve("c", T, "b", 0, len(prompt))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        e.free("c", T, ["b", "a"] if step == "a listed" else ["b"])    # a's blocks stay on disk, unpinned
        e.check_invariants()
        e.cold_store.close()
        e = engine(S, lmdb=lmdb, device=device)
    assert e.allocate("c", T, "d", prompt).cached_tokens == 7 * BS
    e.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_a_prompt_hits_whole_after_a_restart_though_generation_sealed_its_tail(tmp_path, device):
    """Tokens generated after a prompt seal what was its fp16 tail; the GPU tail
    pool still holds those blocks' fp16 forms, and Offload writes them to disk
    too: after a restart the same prompt hits every full block, exact."""
    S = 16
    lmdb = str(tmp_path / "lmdb")
    e = engine(S, lmdb=lmdb, device=device)
    prompt = list(range(700, 761))                         # 7 full blocks: block 6 the fp16 tail
    k, v = fill(e, "a", len(prompt), seed=8, prompt=prompt)
    want = e.retrieve("c", T, "a", 0, 7 * BS)
    for t in range(16):                                    # generated tokens: block 6 seals
        x, y = (z.to(e.device) for z in kv(L, 1, HKV, k.shape[-1], seed=20 + t))
        e.append("c", T, ["a"], x, y, [1], token_ids=[[9000 + t]])
    assert len(e.sequence_info("c", T, "a").sealed_blocks) == 6
    e.offload("c", T, ["a"])
    e.cold_store.close()
    e = engine(S, lmdb=lmdb, device=device)
    assert e.allocate("c", T, "b", prompt).cached_tokens == 7 * BS
    got = e.retrieve("c", T, "b", 0, 7 * BS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    e.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_a_longer_prompt_seals_fp16_blocks_from_below(tmp_path, device):
    """After a restart, a sequence's fp16 tail blocks on disk serve a longer
    prompt (a chat's next turn): where it seals them they are encoded from
    their fp16 form, as from a copy on the GPU, and it holds what a sequence
    given all its K/V afresh holds, bit for bit."""
    S = 16
    lmdb = str(tmp_path / "lmdb")
    e = engine(S, lmdb=lmdb, device=device)
    prompt = list(range(500, 561))                         # 7 full blocks: 2 sinks, 4 sealed, 1 fp16 tail
    k, v = fill(e, "a", len(prompt), seed=6, prompt=prompt)
    e.offload("c", T, ["a"])
    e.cold_store.close()
    e = engine(S, lmdb=lmdb, device=device)
    longer = prompt + list(range(900, 940))                # 101 tokens: blocks 2-10 sealed, block 6 among them
    k2, v2 = (torch.cat([x, y.to(x.device)], 1) for x, y in zip((k, v), kv(L, 40, HKV, k.shape[-1], seed=7)))
    hit = e.allocate("c", T, "b", longer).cached_tokens
    assert hit == 7 * BS and e.stats()["c"]["tiers"]["prefix_hits_disk"] == 7
    e.append("c", T, ["b"], k2[:, hit:], v2[:, hit:], [len(longer) - hit], token_ids=[longer[hit:]])
    e.allocate("c", T, "fresh", [])
    e.append("c", T, ["fresh"], k2, v2, [len(longer)])
    got, want = e.retrieve("c", T, "b", 0, len(longer)), e.retrieve("c", T, "fresh", 0, len(longer))
    assert len(e.sequence_info("c", T, "b").sealed_blocks) == sealed_blocks(len(longer), S) == 9
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    e.check_invariants()


# ----------------------------------------------------------- mapped attend
def test_mapped_attend_plan_with_sinks_first_in_tail_blocks():
    """The plan MappedCache.step builds from a Reserve reply: a PQ part
    (sealed_blocks, len * bs tokens) and an fp16 part (tail_blocks, length -
    that). Built the same way on CPU, with the client writing its reserved
    slots itself, it equals the fp64 reference across the first seal."""
    S = 16
    e = engine(S)
    c = e.cache("c")
    n0 = S + R + BS - 3
    steps = 2 * BS
    k, v = kv(L, n0 + steps, HKV, D, seed=11)
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], k[:, :n0], v[:, :n0], [n0])
    g = torch.Generator().manual_seed(12)
    for step in range(steps):
        pos = n0 + step
        r = e.reserve("c", T, "a", 1)                       # commits the previous step's token
        info = e.sequence_info("c", T, "a")
        assert r.length == pos + 1 and r.tail_blocks == info.tail_blocks
        assert r.tail_blocks[:S // BS] == info.tail_blocks[:info.sink_blocks]
        blocks, offs = torch.tensor(r.slot_mapping) // BS, torch.tensor(r.slot_mapping) % BS
        assert blocks[0].item() not in r.tail_blocks[:S // BS]            # new tokens never land in a sink
        c.tail.write(slice(None), blocks, offs, k[:, pos:pos + 1], v[:, pos:pos + 1])    # MappedCache.write
        sealed_lens = [len(r.sealed_blocks) * BS]
        tail_lens = [r.length - sealed_lens[0]]
        sealed = torch.tensor([r.sealed_blocks], dtype=torch.int32).reshape(1, -1)
        tail = torch.tensor([r.tail_blocks], dtype=torch.int32)
        ek, ev = expected(e, "a", k[:, :pos + 1], v[:, :pos + 1])
        q = torch.randn(1, HQ, D, generator=g).half()
        for layer in range(L):
            out, _ = ref.pq_decode_attention(q, c.main.k_codes[layer], c.main.v_codes[layer], c.main.k_cb[layer],
                                             c.main.v_cb[layer], sealed, sealed_lens, c.tail.k[layer],
                                             c.tail.v[layer], tail, tail_lens, SCALE)
            assert torch.allclose(out[0].double(), dense(q[0], ek[layer], ev[layer]), rtol=TOL, atol=TOL), step
    assert len(e.sequence_info("c", T, "a").sealed_blocks) == sealed_blocks(n0 + steps - 1, S) > 0
    e.check_invariants()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_reserve_hands_out_the_same_slots_for_a_few_tokens_and_for_many(codec):
    """Reserve computes a few tokens' slots in Python and many with index tensors
    (write_path.SMALL_SLOTS): twin sequences (sinks, sealed blocks, a part-filled tail)
    get the same (tail block index, offset) for the tokens both reserve."""
    from kvstore.engine.write_path import SMALL_SLOTS
    S, n0, few, many = 16, 16 + R + 3 * BS + 5, 3, SMALL_SLOTS + 11
    e = engine(S, codec, num_blocks=256, max_sequences=16)
    for sid in ("few", "many"):
        fill(e, sid, n0, seed=4)
    got = {}
    for sid, n in (("few", few), ("many", many)):
        r = e.reserve("c", T, sid, n)
        assert len(r.slot_mapping) == n and r.length == n0 + n
        got[sid] = [(r.tail_blocks.index(x // BS), x % BS) for x in r.slot_mapping]
    assert got["few"] == got["many"][:few]
    # the many tokens fill their blocks in order, from the offset the few start at
    first = got["many"][0]
    assert got["many"] == [(first[0] + (first[1] + i) // BS, (first[1] + i) % BS) for i in range(many)]
    e.check_invariants()


def test_blocks_a_prefix_hit_encodes_count_as_sealed():
    """A prompt whose prefix ends in another sequence's full fp16 tail block encodes that
    block into a new main block at Allocate: it counts in sealed_blocks as a write's seal
    does (every main block in use was sealed once, none found cached: dedup 0)."""
    e = engine(0)
    prompt = list(range(100, 140))
    fill(e, "a", 40, 1, prompt)                  # 3 sealed, the rest in the fp16 tail
    before = e.stats("c")["c"]["sealed_blocks"]
    hit = e.allocate("c", T, "b", prompt + [1, 2, 3])
    c = e.cache("c")
    assert hit.cached_tokens == 40 and len(c.seq(T, "b").sealed) == 4     # its 4th block encoded from a's tail
    s = e.stats("c")["c"]
    assert s["sealed_blocks"] == before + 1 == c.main_pool.stats().used and s["dedup_blocks"] == 0
