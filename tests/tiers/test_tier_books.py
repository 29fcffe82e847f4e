"""Every tier keeps exact books (docs/design.md, Tiers): moves onto shared blocks, room
made on every path, the disk's byte bound, and what Offload made durable
(CPU engine, small pools, a host tier and a real LMDB in tmp_path)."""
import hashlib
import random

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument, ResourceExhausted
from tests.helpers import config

T = "default"
L, HKV, D = 2, 2, 16
PQ_BLOCK, FP16_BLOCK = 512, 2048       # bytes of one block of 8 tokens (geometry above, M = 8)


def engine(tmp_path, codec="pq", num_blocks=64, host_blocks=0, lmdb=True, lmdb_max_bytes=0, windows=(), spec=None,
           **kw):
    """host_blocks: host pools of that many blocks each (main and fp16 tail); windows: layer_windows;
    spec: other CacheConfig fields."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb") if lmdb else None, lmdb_max_bytes=lmdb_max_bytes)
    cfg = config(codec=codec, num_blocks=num_blocks, **kw)
    per = (PQ_BLOCK if codec == "pq" else FP16_BLOCK) * cfg.block_size // 8 + FP16_BLOCK * cfg.block_size // 8
    cfg = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "host_bytes": host_blocks * per,
                         "layer_windows": windows, **(spec or {})})
    e.create_cache(cfg)
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, 8, 256, 2, generator=g),
                                       v=torch.randn(L, HKV, 8, 256, 2, generator=g)))
    return e


def reopen(e, tmp_path, codec="pq", **kw):
    """A new daemon on the same LMDB (the old one's store closed: a restart)."""
    e.cold_store.close()
    return engine(tmp_path, codec, **kw)


def kv_of(tokens):
    """K, V [L, n, Hkv, d] as a model makes them: a function of the token prefix,
    so a prefix hit serves exactly what the caller would have written."""
    ks, vs, h = [], [], b""
    for t in tokens:
        h = hashlib.sha256(h + t.to_bytes(4, "little")).digest()
        x = torch.randn(2, L, HKV, D, generator=torch.Generator().manual_seed(int.from_bytes(h[:7], "little")))
        ks.append(x[0].half())
        vs.append(x[1].half())
    return torch.stack(ks, 1), torch.stack(vs, 1)


def put(e, sid, tokens):
    """Allocate with the prompt, append what was not cached -> cached tokens."""
    cached = e.allocate("c", T, sid, tokens).cached_tokens
    k, v = kv_of(tokens)
    e.append("c", T, [sid], k[:, cached:], v[:, cached:], [len(tokens) - cached], token_ids=[tokens[cached:]])
    return cached


def toks(start, n):
    return list(range(start, start + n))


def read(e, sid):
    n = e.sequence_info("c", T, sid).length
    k, v = e.retrieve("c", T, sid, 0, n)
    return k.clone(), v.clone()


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def used(e):
    """Blocks referenced in every pool of every tier."""
    st = e.stats()["c"]
    pools = [st["main"], st["tail"]] + [st["tiers"].get(p) for p in ("host_main", "host_tail")]
    return [p.used for p in pools if p is not None]


def disk(e):
    return e.stats()["c"]["tiers"]["disk"]


# ---------------------------------------------------------- moves onto shared blocks

def test_move_down_onto_blocks_the_host_caches(tmp_path):
    # Host main pool of 4: 2 cached blocks of a freed sequence, 1 block in use, 1 free.
    e = engine(tmp_path, num_blocks=6, host_blocks=4, residual=0, max_sequences=4)
    c = e.cache("c")
    prompt = toks(0, 24)
    put(e, "a", prompt)
    c.tiering.to_host(c.seq(T, "a"))
    assert e.sequence_info("c", T, "a").tier == "host"
    e.free("c", T, ["a"])
    put(e, "other", toks(100, 16))
    c.tiering.to_host(c.seq(T, "other"))
    assert e.sequence_info("c", T, "other").tier == "host"
    assert put(e, "b", prompt[:16] + toks(500, 24)) == 16     # shares a's two sealed blocks
    want = read(e, "b")
    # "d" needs the GPU room "b" holds: b moves down onto the 2 cached host blocks
    # plus 2 new ones, one more than the host has free once it holds those two.
    put(e, "d", toks(900, 40))
    e.check_invariants()
    assert e.sequence_info("c", T, "b").tier != "gpu"
    assert same(read(e, "b"), want)
    e.free("c", T, ["b", "d", "other"])
    e.check_invariants()
    assert sum(used(e)) == 0


def test_page_in_keeps_the_gpu_hits_it_shares(tmp_path):
    # x on the host shares 4 sealed blocks with y on the GPU; making room for x's
    # other blocks moves y down: the shared blocks must stay x's.
    e = engine(tmp_path, num_blocks=8, host_blocks=8, residual=0, max_sequences=4)
    c = e.cache("c")
    x = toks(0, 56)
    put(e, "x", x)
    want = read(e, "x")
    c.tiering.to_host(c.seq(T, "x"))
    assert e.sequence_info("c", T, "x").tier == "host"
    assert put(e, "y", x[:40]) == 32
    want_y = read(e, "y")
    put(e, "z", toks(1000, 32))                       # newer than y: y is the one to move down
    e.prefetch("c", T, ["x"])
    e.check_invariants()
    assert e.sequence_info("c", T, "x").tier == "gpu"
    assert same(read(e, "x"), want)
    assert same(read(e, "y"), want_y)
    e.free("c", T, ["x", "y", "z"])
    e.check_invariants()
    assert sum(used(e)) == 0


def test_a_move_that_cannot_fit_holds_nothing(tmp_path):
    # No disk tier, a host too small for the victim: the move is refused whole.
    e = engine(tmp_path, num_blocks=8, host_blocks=2, lmdb=False, residual=0, max_sequences=4)
    put(e, "a", toks(0, 48))
    with pytest.raises(ResourceExhausted):
        put(e, "b", toks(100, 48))
    e.check_invariants()
    assert e.sequence_info("c", T, "a").tier == "gpu"
    assert e.stats()["c"]["tiers"]["host_main"].used == 0


# ------------------------------------------------------------- room on every path

def fill_gpu(e, slack=0, first=10**6):
    """Idle sequences (no token ids: nothing to share) until the GPU main pool
    has no block left to give, each with `slack` free slots in its last block."""
    c, ids = e.cache("c"), []
    while c.main_pool.num_allocatable():
        blocks = min(4, c.main_pool.num_allocatable())
        n = blocks * c.bs - slack + (c.cfg.residual + c.bs if c.is_pq else 0)   # pq: the tail stays in fp16
        sid = f"f{len(ids)}"
        e.allocate("c", T, sid, [])
        k, v = kv_of(toks(first + 1000 * len(ids), n))
        e.append("c", T, [sid], k, v, [n])
        ids.append(sid)
    return ids


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_prefix_hits_from_below_make_room(tmp_path, codec):
    e = engine(tmp_path, codec, num_blocks=40, host_blocks=16, block_size=16, residual=16, max_sequences=32)
    prompt = toks(0, 200)
    put(e, "p", prompt)
    want = read(e, "p")
    e.free("c", T, ["p"])
    for i in range(4):                     # churn: the prompt's blocks are spilled below
        put(e, f"x{i}", toks(10000 * (i + 1), 150))
        e.free("c", T, [f"x{i}"])
    fill_gpu(e)
    assert e.allocate("c", T, "q", prompt).cached_tokens == 192
    k, v = kv_of(prompt)
    e.append("c", T, ["q"], k[:, 192:], v[:, 192:], [8], token_ids=[prompt[192:]])
    assert same(read(e, "q"), want)
    e.check_invariants()


def test_prefix_hits_from_below_count_blocks_served_not_looked_up(tmp_path):
    # The GPU pool is full of sequences that cannot move (uncommitted per-layer
    # tokens): the prompt's blocks are found below but none can be served.
    e = engine(tmp_path, "fp16", num_blocks=24, host_blocks=16, residual=8, max_sequences=32)
    prompt = toks(0, 64)
    put(e, "p", prompt)
    e.free("c", T, ["p"])
    for i in range(3):
        put(e, f"x{i}", toks(10000 * (i + 1), 120))
        e.free("c", T, [f"x{i}"])
    busy = fill_gpu(e, slack=1)
    for sid in busy:
        e.append("c", T, [sid], torch.zeros(1, HKV, D).half(), torch.zeros(1, HKV, D).half(), [1], layer=0)
    tiers = e.stats()["c"]["tiers"]
    before = tiers["prefix_hits_host"] + tiers["prefix_hits_disk"]
    assert e.allocate("c", T, "q", prompt).cached_tokens == 0
    tiers = e.stats()["c"]["tiers"]
    assert tiers["prefix_hits_host"] + tiers["prefix_hits_disk"] == before
    e.free("c", T, ["q"])
    # With room, every served block counts once.
    e.free("c", T, busy)
    r = e.allocate("c", T, "q", prompt)
    tiers = e.stats()["c"]["tiers"]
    assert r.cached_tokens == 56
    assert 0 < tiers["prefix_hits_host"] + tiers["prefix_hits_disk"] - before <= r.hit_blocks
    e.check_invariants()


def test_fork_makes_room_like_append(tmp_path):
    e = engine(tmp_path, "fp16", num_blocks=16, host_blocks=32, residual=8, max_sequences=12)
    put(e, "src", toks(0, 21))                       # a partial last block: the fork copies it
    idle = fill_gpu(e)
    e.fork("c", T, "src", "dst")
    assert e.sequence_info("c", T, "dst").length == 21
    assert any(e.sequence_info("c", T, s).tier != "gpu" for s in idle)
    e.check_invariants()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_reserve_makes_room_like_append(tmp_path, codec):
    e = engine(tmp_path, codec, num_blocks=16, host_blocks=32, residual=8, max_sequences=12)
    put(e, "src", toks(0, 21))
    e.reserve("c", T, "src", 8)
    idle = fill_gpu(e)
    # Commits the 8 reserved tokens (pq: seals one more block) and reserves 8
    # more (fp16: a new block).
    assert e.reserve("c", T, "src", 8).length == 37
    assert any(e.sequence_info("c", T, s).tier != "gpu" for s in idle)
    e.check_invariants()


# ------------------------------------------------------------------ the disk's bound

def churn(e, n, first=50_000, length=48):
    """Sequences written and freed: their hashed blocks are spilled down as cache."""
    for i in range(n):
        put(e, f"churn{i}", toks(first + 1000 * i, length))
        e.free("c", T, [f"churn{i}"])


def test_disk_bound_holds_and_evicts_least_recently_used(tmp_path):
    bound = 40 * (PQ_BLOCK + 64)
    e = engine(tmp_path, num_blocks=8, host_blocks=4, lmdb_max_bytes=bound, residual=8, max_sequences=8)
    churn(e, 30)
    d = disk(e)
    assert d["max_bytes"] == bound and 0 < d["used_bytes"] <= bound
    assert d["evictions"] > 0 and d["evicted_bytes"] > 0
    assert d["held_bytes"] == 0                       # nothing but cached prefix blocks
    e.check_invariants()
    # The newest cached prefixes are still found; the oldest are gone.
    assert e.allocate("c", T, "new", toks(50_000 + 29_000, 48)).cached_tokens == 40
    assert e.allocate("c", T, "old", toks(50_000, 48)).cached_tokens == 0


def test_disk_without_bound_keeps_everything(tmp_path):
    e = engine(tmp_path, num_blocks=8, host_blocks=4, residual=8, max_sequences=8)
    churn(e, 30)
    d = disk(e)
    assert d["max_bytes"] == 0 and d["evictions"] == 0 and d["used_bytes"] > 40 * PQ_BLOCK


def offloaded_bytes(path, tokens):
    """Bytes one sequence holds on disk once offloaded (measured on a scratch store)."""
    e = engine(path, num_blocks=32, residual=8)
    put(e, "s", tokens)
    e.offload("c", T, ["s"])
    return disk(e)["held_bytes"]


def test_offload_is_durable_under_the_bound_and_refused_whole_past_it(tmp_path):
    keep, a, b = toks(0, 100), toks(10_000, 100), toks(20_000, 100)
    size = offloaded_bytes(tmp_path / "scratch", a)           # b's is the same
    bound = offloaded_bytes(tmp_path / "scratch2", keep) + size + size // 2
    e = engine(tmp_path, num_blocks=24, host_blocks=4, lmdb_max_bytes=bound, residual=8, max_sequences=8)
    put(e, "keep", keep)
    want = read(e, "keep")
    e.offload("c", T, ["keep"])
    held = disk(e)["held_bytes"]
    churn(e, 30)                                      # pressure spills never evict a durable sequence
    assert disk(e)["evictions"] > 0 and disk(e)["held_bytes"] == held
    put(e, "a", a)
    put(e, "b", b)
    before = disk(e)
    with pytest.raises(ResourceExhausted, match="disk tier"):
        e.offload("c", T, ["a", "b"])                  # one of them would fit, both do not: neither moves
    assert [e.sequence_info("c", T, s).tier for s in ("a", "b")] == ["gpu", "gpu"]
    after = disk(e)
    assert after["used_bytes"] == before["used_bytes"] and after["held_bytes"] == held
    e.check_invariants()
    e.offload("c", T, ["a"])                          # alone it fits, evicting cached prefix blocks
    assert disk(e)["held_bytes"] == held + size
    assert same(read(e, "keep"), want)
    e.check_invariants()


def test_an_append_the_disk_bound_leaves_no_room_for_says_so(tmp_path):
    """The pools would have room if a sequence could move down, but the disk's bound
    takes none: the refusal names that, not only the pools' free blocks."""
    a, b, c = toks(0, 150), toks(10_000, 150), toks(20_000, 150)
    size = offloaded_bytes(tmp_path / "scratch", a)
    e = engine(tmp_path, num_blocks=24, lmdb_max_bytes=size + size // 2, residual=8, max_sequences=8)
    put(e, "a", a)
    e.offload("c", T, ["a"])
    put(e, "b", b)
    e.allocate("c", T, "c", c)
    k, v = kv_of(c)
    before = disk(e)
    with pytest.raises(ResourceExhausted, match=r"^k: no room in cache 'c' .* \(a sequence could not move down: "
                                                r"the disk tier cannot take .* held by sequences\)$"):
        e.append("c", T, ["c"], k, v, [len(c)], token_ids=[c])
    assert e.sequence_info("c", T, "b").tier == "gpu" and e.sequence_info("c", T, "c").length == 0
    assert disk(e)["used_bytes"] == before["used_bytes"]
    e.check_invariants()


def test_restart_rebuilds_the_disk_books(tmp_path):
    bound = 30 * (PQ_BLOCK + 64) + 8 * FP16_BLOCK
    e = engine(tmp_path, num_blocks=8, host_blocks=4, lmdb_max_bytes=bound, residual=8, max_sequences=8)
    put(e, "keep", toks(0, 64))
    want = read(e, "keep")
    e.offload("c", T, ["keep"])
    churn(e, 10)
    d = disk(e)
    e = reopen(e, tmp_path, num_blocks=8, host_blocks=4, lmdb_max_bytes=bound, residual=8, max_sequences=8)
    d2 = disk(e)
    assert (d2["used_bytes"], d2["held_bytes"]) == (d["used_bytes"], d["held_bytes"])
    e.check_invariants()
    churn(e, 30, first=900_000)                       # evicts what is evictable, not the offloaded sequence
    assert disk(e)["held_bytes"] == d["held_bytes"]
    assert same(read(e, "keep"), want)


# ------------------------------------------------------------- durable means durable

@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_offloaded_sequence_read_once_survives_a_restart(tmp_path, codec):
    e = engine(tmp_path, codec, num_blocks=32, residual=8)
    put(e, "s", toks(0, 77))
    want = read(e, "s")
    e.offload("c", T, ["s"])
    assert same(read(e, "s"), want)                   # paged in
    e.fork("c", T, "s", "child")                      # forking from it changes nothing of it
    assert e.sequence_info("c", T, "s").tier == "gpu"
    e = reopen(e, tmp_path, codec, num_blocks=32, residual=8)
    assert [(i.seq_id, i.tier) for i in e.list_sequences("c", T)] == [("s", "disk")]
    assert same(read(e, "s"), want)


def test_what_outlives_a_restart_is_what_was_offloaded(tmp_path, caplog):
    """A restart lists the sequences offloaded (Offload; persist, which the stop
    offloads as a lapsed lease would), not the ones memory pressure happened to move
    to disk: such a copy is dropped, logged, and its sealed blocks stay cached there
    (a prompt that repeats it hits them)."""
    import logging
    caplog.set_level(logging.INFO)
    e = engine(tmp_path, num_blocks=16, residual=8, max_sequences=8)
    put(e, "offloaded", toks(0, 40))
    e.offload("c", T, ["offloaded"])
    want = {"offloaded": read(e, "offloaded")}
    e.allocate("c", T, "persist", toks(1000, 40), owner="session", persist=True)
    k, v = kv_of(toks(1000, 40))
    e.append("c", T, ["persist"], k, v, [40], token_ids=[toks(1000, 40)])
    want["persist"] = read(e, "persist")
    for i in range(6):                                 # pressure: the oldest go to disk
        put(e, f"x{i}", toks(10_000 * (i + 1), 40))
    tiers = {i.seq_id: i.tier for i in e.list_sequences("c", T)}
    moved = [s for s, t in tiers.items() if t == "disk" and s.startswith("x")]
    assert moved, tiers
    e.close()                                          # the daemon's stop
    e = reopen(e, tmp_path, num_blocks=16, residual=8, max_sequences=8)
    assert sorted((i.seq_id, i.tier) for i in e.list_sequences("c", T)) == [("offloaded", "disk"), ("persist", "disk")]
    for sid, kv in want.items():
        assert same(read(e, sid), kv)
    assert any(f"dropped the disk copies of {len(moved)} sequences" in r.getMessage() for r in caplog.records)
    assert put(e, "again", toks(10_000 * (int(moved[0][1:]) + 1), 40)) == 32     # its sealed blocks: still cached
    e.check_invariants()
    info = e.sequence_info("c", T, "persist")            # still persist: it changes, and the next stop offloads it
    assert info.persist and not e.sequence_info("c", T, "offloaded").persist
    one = torch.ones(L, 1, HKV, D).half()
    e.append("c", T, ["persist"], one, one, [1])
    want["persist"] = read(e, "persist")
    e.close()
    e = reopen(e, tmp_path, num_blocks=16, residual=8, max_sequences=8)
    assert e.sequence_info("c", T, "persist").length == 41 and same(read(e, "persist"), want["persist"])


def test_a_refused_append_or_prefetch_moves_no_sequence(tmp_path):
    """An Append past what the pools can ever hold, and a Prefetch of sequences that
    cannot all be on the GPU at once, are refused before anything is paged in: every
    sequence stays in its tier."""
    e = engine(tmp_path, "fp16", num_blocks=12, residual=8, max_sequences=8)
    put(e, "a", toks(0, 56))
    put(e, "b", toks(1000, 48))
    e.offload("c", T, ["a", "b"])
    put(e, "c", toks(2000, 16))

    def state():
        return {i.seq_id: i.tier for i in e.list_sequences("c", T)}, e.stats()["c"]["main"]
    before = state()
    with pytest.raises(ResourceExhausted) as err:
        e.prefetch("c", T, ["a", "b"])                 # 7 + 6 blocks, a pool of 12
    assert err.value.field == "sequence_ids" and err.value.message == \
        "the sequences need 13 blocks on the GPU at once; the pools of cache 'c' hold 12: name fewer"
    assert state() == before
    k = torch.ones(L, 100, HKV, D).half()
    with pytest.raises(InvalidArgument) as err:
        e.append("c", T, ["a"], k, k, [100])            # 156 tokens: the pools hold 96
    assert err.value.field == "counts"
    assert state() == before
    e.prefetch("c", T, ["a"])                          # one fits: it pages in
    assert state()[0]["a"] == "gpu"
    e.check_invariants()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_prefix_blocks_only_memory_held_outlive_a_restart(tmp_path, codec):
    """At the stop, the blocks with a content hash that only the GPU pools or the host
    tier hold (a freed prompt's, cached; a live sequence's) go to disk: prompts after
    a restart hit them, bit for bit what was stored."""
    e = engine(tmp_path, codec, num_blocks=32, host_blocks=4, residual=8, max_sequences=8, sink_tokens=8)
    put(e, "freed", toks(0, 40))
    want = {"freed": read(e, "freed")}
    e.free("c", T, ["freed"])
    put(e, "live", toks(1000, 40))
    want["live"] = read(e, "live")
    before = disk(e)["used_bytes"]
    e.close()
    assert disk(e)["used_bytes"] > before
    e = reopen(e, tmp_path, codec, num_blocks=32, host_blocks=4, residual=8, max_sequences=8, sink_tokens=8)
    assert e.list_sequences("c", T) == []
    for sid, start in (("freed", 0), ("live", 1000)):
        assert put(e, sid, toks(start, 40)) == 32            # every full block but the last, from disk
        assert same(read(e, sid), want[sid])
    assert e.stats()["c"]["tiers"]["prefix_hits_disk"] == 8
    e.check_invariants()


@pytest.mark.parametrize("change", ["append", "decode", "reserve"])
def test_a_changed_sequence_leaves_no_stale_copy(tmp_path, change):
    e = engine(tmp_path, num_blocks=32, residual=8)
    put(e, "s", toks(0, 77))
    e.offload("c", T, ["s"])
    e.prefetch("c", T, ["s"])
    assert disk(e)["held_bytes"] > 0
    one = torch.ones(L, 1, HKV, D).half()
    if change == "append":
        e.append("c", T, ["s"], one, one, [1])
    elif change == "decode":
        e.append("c", T, ["s"], one[0], one[0], [1], layer=0)
        assert disk(e)["held_bytes"] > 0              # not committed yet: the copy still is what s is
        e.append("c", T, ["s"], one[1], one[1], [1], layer=1)
    else:
        e.reserve("c", T, "s", 1)
        assert disk(e)["held_bytes"] > 0
        e.reserve("c", T, "s", 0)                     # commits the reserved token
    assert disk(e)["held_bytes"] == 0
    e.check_invariants()
    e = reopen(e, tmp_path, num_blocks=32, residual=8)
    assert e.list_sequences("c", T) == []


def test_free_deletes_the_durable_copy_and_a_pressure_copy_goes_at_page_in(tmp_path):
    e = engine(tmp_path, num_blocks=6, residual=8, max_sequences=8)
    put(e, "s", toks(0, 40))
    e.offload("c", T, ["s"])
    e.prefetch("c", T, ["s"])
    e.free("c", T, ["s"])
    assert disk(e)["held_bytes"] == 0
    put(e, "a", toks(1000, 48))                       # no host tier: pressure moves "a" to disk
    put(e, "b", toks(2000, 48))
    assert e.sequence_info("c", T, "a").tier == "disk" and disk(e)["held_bytes"] > 0
    e.free("c", T, ["b"])
    e.prefetch("c", T, ["a"])
    assert disk(e)["held_bytes"] == 0
    e.check_invariants()


# ----------------------------------------------------------------- randomized books

@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_random_ops_keep_every_tier_exact(tmp_path, codec):
    """Random allocate / decode / fork / offload / prefetch / read / free on
    pools small enough that every tier is in use; the books are checked after
    every call and every read of the fp16 codec is bit-exact."""
    rng = random.Random(7)
    bound = 60 * (PQ_BLOCK if codec == "pq" else FP16_BLOCK)
    e = engine(tmp_path, codec, num_blocks=14, host_blocks=10, lmdb_max_bytes=bound, residual=8, max_sequences=10)
    prefixes = [toks(10_000 * i, 32) for i in range(3)]
    live: dict[str, list[int]] = {}          # sequence -> its token ids (K/V: kv_of)
    for step in range(300):
        op = rng.choice(["alloc"] * 3 + ["decode", "fork", "offload", "prefetch", "read", "free"])
        if not live or op in ("alloc", "fork") and len(live) >= 8:
            op = "alloc" if not live else "free"
        sid, new = rng.choice(sorted(live)) if live else None, f"s{step}"
        try:
            if op == "alloc":
                live[new] = rng.choice(prefixes) + [rng.randrange(5000) for _ in range(rng.randint(1, 40))]
                put(e, new, live[new])
            elif op == "decode":
                t = rng.randrange(5000)
                k, v = kv_of(live[sid] + [t])
                for layer in range(L):
                    e.append("c", T, [sid], k[layer, -1:], v[layer, -1:], [1], layer=layer)
                live[sid] = live[sid] + [t]
            elif op == "fork":
                e.fork("c", T, sid, new)
                live[new] = list(live[sid])
            elif op == "offload":
                e.offload("c", T, [sid])
            elif op == "prefetch":
                e.prefetch("c", T, [sid])
            elif op == "read":
                got = read(e, sid)
                assert codec == "pq" or same(got, kv_of(live[sid]))
            else:
                e.free("c", T, [sid])
                del live[sid]
        except ResourceExhausted:
            # Refused, nothing changed; but a decode refused at layer 1 left its
            # layer-0 token, and a put may have allocated: drop what it touched.
            for s in {"alloc": [new], "decode": [sid]}.get(op, []):
                if s in live:
                    e.free("c", T, [s])
                    del live[s]
        e.check_invariants()
    st = e.stats()["c"]["tiers"]
    assert st["offloads_host"] and st["offloads_disk"] and st["page_ins_host"] and st["page_ins_disk"]
    e.free("c", T, sorted(live))
    e.check_invariants()
    assert sum(used(e)) == 0
    assert disk(e)["held_bytes"] == 0 and disk(e)["used_bytes"] <= bound


# ------------------------------------------------------------- what operators see

def test_the_bound_in_flag_stats_and_metrics(tmp_path):
    """--lmdb-max-bytes takes sizes as people write them; Stats and Prometheus
    show the disk's bytes, bound and evictions."""
    from kvstore.client import KVStoreClient
    from kvstore.service.metrics import EngineCollector
    from kvstore.core.sizes import parse_bytes
    from tests.service.test_daemon_process import start_daemon, stop_daemon
    from tests.service.test_ops_metrics_admin import samples
    from prometheus_client import CollectorRegistry, generate_latest

    assert [parse_bytes(s) for s in ("1048576", "40GiB", "512MB", "1.5 KiB")] == [1 << 20, 40 << 30, 512 * 10**6, 1536]
    with pytest.raises(ValueError):
        parse_bytes("-1")
    p, target = start_daemon(str(tmp_path / "kv.sock"), extra=["--lmdb", str(tmp_path / "lmdb"),
                                                                "--lmdb-max-bytes", "24KiB"])
    try:
        kv = KVStoreClient(target, heartbeat=False)
        kv.create_cache("c", "m", num_layers=L, num_q_heads=4, num_kv_heads=HKV, head_dim=D, codec="fp16",
                        block_size=8, residual=8, num_blocks=8, max_sequences=8)
        for i in range(12):           # churn: freed prefix blocks spill to disk and age out
            prompt = toks(1000 * i, 40)
            k, v = kv_of(prompt)
            kv.allocate("c", f"s{i}", prompt)
            kv.append("c", [f"s{i}"], k, v, token_ids=[prompt])
            kv.free("c", [f"s{i}"])
        st = kv.stats("c").caches[0]
        assert st.disk_max_bytes == 24 << 10 and 0 < st.disk_used_bytes <= st.disk_max_bytes
        assert st.disk_evictions > 0 and st.disk_evicted_bytes > 0 and st.disk_held_bytes == 0
        kv.close()
    finally:
        stop_daemon(p)
    e = engine(tmp_path / "in-process", "fp16", num_blocks=8, lmdb_max_bytes=24 << 10, residual=8)
    churn(e, 12)
    reg = CollectorRegistry()
    reg.register(EngineCollector(e))
    s = samples(generate_latest(reg).decode())
    d = disk(e)
    assert s['kvstore_disk_max_bytes'] == 24 << 10        # one store under every cache: no cache label
    assert s['kvstore_disk_used_bytes'] == d["used_bytes"] > 0
    assert s['kvstore_disk_evictions_total'] == d["evictions"] > 0
    assert s['kvstore_disk_held_bytes'] == 0


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_two_caches_of_one_fingerprint_keep_their_own_sequences_on_disk(tmp_path, codec):
    """Two caches of the same model and codebooks under two names share a
    fingerprint (and prefix blocks); a sequence id that both use is two
    sequences: offloaded, paged in and restored, each reads its own K/V."""
    e = engine(tmp_path, codec)
    e.create_cache(config(name="d", codec=codec, num_blocks=64))
    if codec == "pq":
        e.set_codebooks("d", e.caches["c"].codebooks)
    assert e.caches["c"].fingerprint == e.caches["d"].fingerprint
    want = {}
    for name, first in (("c", 0), ("d", 5000)):
        tokens = toks(first, 70)
        k, v = kv_of(tokens)
        e.allocate(name, T, "s", tokens)
        e.append(name, T, ["s"], k, v, [70], token_ids=[tokens])
        want[name] = e.retrieve(name, T, "s", 0, 70)
        e.offload(name, T, ["s"])
    for name in ("c", "d"):
        e.prefetch(name, T, ["s"])
        got = e.retrieve(name, T, "s", 0, 70)
        assert torch.equal(got[0], want[name][0]) and torch.equal(got[1], want[name][1]), name
    e.cold_store.close()
    e2 = Engine(lmdb_path=str(tmp_path / "lmdb"))
    for name in ("c", "d"):
        e2.create_cache(config(name=name, codec=codec, num_blocks=64))
        if codec == "pq":
            e2.set_codebooks(name, e.caches["c"].codebooks)
        got = e2.retrieve(name, T, "s", 0, 70)
        assert torch.equal(got[0], want[name][0]) and torch.equal(got[1], want[name][1]), name


# ---------------------------------------------------------- what Stats and SequenceInfo say of lower tiers

@pytest.mark.parametrize("tier", ["host", "disk"])
def test_sealed_tokens_count_every_tier_and_bytes_per_token_the_gpu_s(tmp_path, tier):
    e = engine(tmp_path, host_blocks=8, max_sequences=4)
    put(e, "a", toks(0, 48))                          # 4 sealed blocks, 16 tokens in the fp16 tail
    before = e.stats()["c"]
    assert (before["tokens"], before["sealed_tokens"]) == (48, 32)
    if tier == "host":
        e.cache("c").tiering.to_host(e.cache("c").seq(T, "a"))
    else:
        e.offload("c", T, ["a"])
    assert e.sequence_info("c", T, "a").tier == tier
    s = e.stats()["c"]
    assert (s["tokens"], s["sealed_tokens"]) == (48, 32)
    assert s["used_bytes"] == 0 and s["effective_bytes_per_token"] == 0.0      # nothing of it on the GPU
    put(e, "b", toks(1000, 48))
    s = e.stats()["c"]
    assert (s["tokens"], s["sealed_tokens"]) == (96, 64)
    assert s["effective_bytes_per_token"] == s["used_bytes"] / 48 == before["effective_bytes_per_token"]


def test_a_windowed_sequence_on_disk_lists_refs_as_its_blocks(tmp_path):
    e = engine(tmp_path, windows=(48, 48), max_sequences=4)
    put(e, "a", toks(0, 80))
    gpu = e.sequence_info("c", T, "a")
    assert gpu.window_freed_blocks > 0 and len(gpu.sealed_block_refs) == len(gpu.sealed_blocks)
    e.offload("c", T, ["a"])
    info = e.sequence_info("c", T, "a")
    assert info.tier == "disk" and info.sealed_blocks == info.sealed_block_refs == []
    assert info.window_freed_blocks == gpu.window_freed_blocks
    e.prefetch("c", T, ["a"])
    back = e.sequence_info("c", T, "a")
    assert (back.tier, back.length, back.sealed_block_refs, back.window_freed_blocks) == \
        ("gpu", 80, gpu.sealed_block_refs, gpu.window_freed_blocks)
    assert len(back.sealed_blocks) == len(gpu.sealed_blocks)


def test_the_host_tier_takes_whole_pairs_of_host_bytes_and_says_so(tmp_path):
    cfg = config(max_sequences=4)
    pair = PQ_BLOCK + FP16_BLOCK
    assert cfg.host_pair_bytes() == pair
    e = engine(tmp_path, host_blocks=0, max_sequences=4)
    e.create_cache(type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "name": "h",
                                "host_bytes": 4 * pair + pair - 1}))
    s = e.stats()["h"]
    assert s["tiers"]["host_bytes"] == 4 * pair                   # Stats host_tier_bytes: what it holds
    assert s["reserved_bytes"] == s["main_reserved_bytes"] + s["tail_reserved_bytes"] + 4 * pair
    assert e.delete_cache("h").reserved_bytes == s["reserved_bytes"]
    with pytest.raises(InvalidArgument) as err:
        type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "host_bytes": pair - 1})
    assert err.value.field == "host_bytes" and f"{pair} bytes" in str(err.value)


def test_host_blocks_spilled_to_disk_are_counted(tmp_path):
    e = engine(tmp_path, num_blocks=32, host_blocks=4, residual=0, max_sequences=4)
    c = e.cache("c")
    put(e, "a", toks(0, 24))
    c.tiering.to_host(c.seq(T, "a"))
    e.free("c", T, ["a"])                                 # its hashed blocks stay findable on the host
    cached = e.stats()["c"]["tiers"]["host_main"].cached
    assert cached > 0 and disk(e)["entries"] == 0
    before = dict(e.stats()["c"]["tiers"])
    for i, sid in enumerate(("b", "d")):                  # their moves reuse the host's cached slots
        put(e, sid, toks(1000 * (i + 1), 24))
        c.tiering.to_host(c.seq(T, sid))
    after = e.stats()["c"]["tiers"]
    spilled = after["spilled_blocks"] - before["spilled_blocks"]
    assert spilled == cached == disk(e)["entries"]
    assert after["bytes_down_disk"] - before["bytes_down_disk"] == spilled * PQ_BLOCK
    assert put(e, "again", toks(0, 24)) == 16             # the spilled prefix still hits, from the disk
