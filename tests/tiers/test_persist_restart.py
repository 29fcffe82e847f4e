"""What of a persist sequence outlives the daemon: a stop or a lease's lapse in
the middle of a decode step (the step dropped, the committed tokens kept), a
kill after memory pressure moved it to disk; and disk copies whose manifests
predate the layout field, adopted only into a cache they fit."""
import json
import logging
import re

import pytest
import torch

from kvstore.engine.engine import Engine
from kvstore.errors import KVStoreError
from kvstore.service.leases import LeaseManager
from kvstore.tiers.lmdb_store import LMDBStore
from tests.tiers.test_tier_books import D, HKV, T, engine, kv_of, put, read, reopen, same, toks


def half_a_step(e, sid):
    """Layer 0 of the next token appended, layer 1 not: the step the daemon stops in."""
    k, v = torch.randn(1, HKV, D).half(), torch.randn(1, HKV, D).half()
    e.append("c", T, [sid], k, v, [1], layer=0)
    assert e.cache("c").seqs[(T, sid)].pending[0] == 1


@pytest.mark.parametrize("codec", ["pq", "fp16"])
@pytest.mark.parametrize("cut_by", ["stop", "lapse"])
def test_a_persist_sequence_cut_off_mid_step_keeps_its_committed_tokens(tmp_path, caplog, codec, cut_by):
    e = engine(tmp_path, codec, num_blocks=32, residual=8)
    tokens = toks(0, 47)           # the step's token would start a new block
    e.allocate("c", T, "chat", tokens, owner="w", persist=True)
    k, v = kv_of(tokens)
    e.append("c", T, ["chat"], k, v, [len(tokens)], token_ids=[tokens])
    want = read(e, "chat")
    half_a_step(e, "chat")
    caplog.set_level(logging.INFO)
    if cut_by == "stop":
        e.close()
        assert "without the 1 tokens of its unfinished step" in caplog.text
    else:
        leases = LeaseManager(e, timeout_s=1, clock=lambda: 0.0)
        leases.touch(T, "w")
        leases.clock = lambda: 5.0
        leases.reap()
        assert leases.counters["offload_failed"] == 0
        assert e.sequence_info("c", T, "chat").tier == "disk"
        e.check_invariants()
    e = reopen(e, tmp_path, codec, num_blocks=32, residual=8)
    info = e.sequence_info("c", T, "chat")
    assert (info.length, info.tier, info.persist) == (47, "disk", True)
    assert same(read(e, "chat"), want)
    k, v = kv_of(toks(0, 48))
    e.append("c", T, ["chat"], k[:, 47:], v[:, 47:], [1], token_ids=[[47]])     # the step again, whole
    e.check_invariants()
    ref = engine(tmp_path / "ref", codec, num_blocks=32, residual=8)     # the same 48 tokens, never cut off
    put(ref, "chat", toks(0, 48))
    assert same(read(e, "chat"), read(ref, "chat"))


def test_a_kill_keeps_a_persist_sequence_that_memory_pressure_moved_to_disk(tmp_path, caplog):
    """Its pressure copy is its only copy: kept and listed after a kill (no stop ran),
    while other sequences' pressure copies are dropped as before; kept when the
    sequence is read back, until it changes."""
    e = engine(tmp_path, num_blocks=16, residual=8, max_sequences=8)
    e.allocate("c", T, "p", toks(0, 40), owner="w", persist=True)
    k, v = kv_of(toks(0, 40))
    e.append("c", T, ["p"], k, v, [40], token_ids=[toks(0, 40)])
    want = read(e, "p")
    for i in range(6):
        put(e, f"x{i}", toks(10_000 * (i + 1), 40))
    tiers = {i.seq_id: i.tier for i in e.list_sequences("c", T)}
    assert tiers["p"] == "disk", tiers
    caplog.set_level(logging.INFO)
    e = reopen(e, tmp_path, num_blocks=16, residual=8, max_sequences=8)      # killed: no stop
    listed = {i.seq_id: i for i in e.list_sequences("c", T)}
    assert list(listed) == ["p"] and listed["p"].persist
    assert same(read(e, "p"), want)
    spilled = sorted(s for s, t in tiers.items() if t == "disk" and s.startswith("x"))
    line = next(r.getMessage() for r in caplog.records if "dropped the disk copies of" in r.getMessage())
    named = re.findall(rf"'c'/{T!r}/'(x\d)'", line)       # reading "off" and "p" back spilled more
    assert f"of {len(named)} sequences" in line and set(spilled) <= set(named), line
    e.check_invariants()
    # Read back, unchanged: it keeps that copy, and comes back from a second kill too.
    assert e.sequence_info("c", T, "p").tier == "gpu"
    e = reopen(e, tmp_path, num_blocks=16, residual=8, max_sequences=8)
    assert [i.seq_id for i in e.list_sequences("c", T)] == ["p"] and same(read(e, "p"), want)
    # Changed: the copy no longer is the sequence and goes; a kill then loses it, as documented.
    k1, v1 = kv_of(toks(0, 41))
    e.append("c", T, ["p"], k1[:, 40:], v1[:, 40:], [1], token_ids=[[40]])
    e = reopen(e, tmp_path, num_blocks=16, residual=8, max_sequences=8)
    assert e.list_sequences("c", T) == []
    e.check_invariants()


def test_pressure_copies_go_when_the_store_opens_not_when_their_cache_comes_back(tmp_path, caplog):
    """Copies memory pressure moved to disk are no sequence's after a restart: they go at
    the start, whichever caches are created, so that they neither count as held nor make
    the disk bound refuse an Offload of a sequence that exists (their blocks stay cached)."""
    e = engine(tmp_path, num_blocks=16, residual=8, max_sequences=8)
    put(e, "off", toks(0, 40))
    e.offload("c", T, ["off"])
    e.allocate("c", T, "p", toks(500, 40), owner="w", persist=True)
    k, v = kv_of(toks(500, 40))
    e.append("c", T, ["p"], k, v, [40], token_ids=[toks(500, 40)])
    for i in range(6):
        put(e, f"x{i}", toks(10_000 * (i + 1), 40))
    tiers = {i.seq_id: i.tier for i in e.list_sequences("c", T)}
    assert tiers["p"] == "disk" and "disk" in {t for s, t in tiers.items() if s.startswith("x")}, tiers
    kept = {s: read(e, s) for s in ("off", "p")}
    held = e.disk.held_bytes()
    blocks = e.disk.stats()["entries"]
    e.cold_store.close()                                     # killed: no stop
    caplog.set_level(logging.INFO)
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))             # no cache of that name comes back
    spilled = sorted(s for s, t in tiers.items() if t == "disk" and s.startswith("x"))
    line = next(r.getMessage() for r in caplog.records if "dropped the disk copies of" in r.getMessage())
    named = re.findall(rf"'c'/{T!r}/'(x\d)'", line)       # reading "off" and "p" back spilled more
    assert f"of {len(named)} sequences" in line and set(spilled) <= set(named), line
    assert 0 < e.disk.held_bytes() < held and len(e.disk.store.keys(b"M")) == 2     # Offload's and persist's
    assert 0 < e.disk.stats()["entries"] < blocks           # the hashed blocks stay, cached
    e.cold_store.close()
    e = engine(tmp_path, num_blocks=16, residual=8, max_sequences=8)
    assert sorted(i.seq_id for i in e.list_sequences("c", T)) == ["off", "p"]
    assert all(same(read(e, s), want) for s, want in kept.items())
    e.check_invariants()


def strip_layouts(tmp_path):
    """Every manifest as one written before manifests named their layout."""
    store = LMDBStore(str(tmp_path / "lmdb"))
    puts = []
    for key, v in store.scan(b"M"):
        m = json.loads(bytes(v))
        del m["layout"]
        puts.append((key, json.dumps(m).encode()))
    assert puts
    store.put_many(puts, sync=True)
    store.close()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_manifest_without_its_layout_is_adopted_where_it_fits(tmp_path, codec):
    e = engine(tmp_path, codec, num_blocks=32, residual=8)
    put(e, "s", toks(0, 77))
    want = read(e, "s")
    e.offload("c", T, ["s"])
    e.cold_store.close()
    strip_layouts(tmp_path)
    e = engine(tmp_path, codec, num_blocks=32, residual=8)
    assert [(i.seq_id, i.tier) for i in e.list_sequences("c", T)] == [("s", "disk")]
    assert same(read(e, "s"), want)
    e.check_invariants()


@pytest.mark.parametrize("differs", ["layer_windows", "residual", "share_prefixes_across_tenants"])
def test_a_manifest_without_its_layout_is_left_on_disk_where_it_does_not_fit(tmp_path, caplog, differs):
    """Written by a cache whose window freed blocks, or with another residual, or
    hashed for another tenant sharing: not listed here, left on disk (a WARNING
    names the field), and listed again by a cache of the spec it was written with."""
    first = dict(windows=(16, 16)) if differs == "layer_windows" else dict(residual=16) if differs == "residual" \
        else dict(spec=dict(share_prefixes_across_tenants=True))
    e = engine(tmp_path, "fp16", num_blocks=32, **{"residual": 8, **first})
    put(e, "s", toks(0, 80))
    if differs == "layer_windows":
        assert e.cache("c").seqs[(T, "s")].freed > 0
    e.offload("c", T, ["s"])
    e.cold_store.close()
    strip_layouts(tmp_path)
    caplog.set_level(logging.WARNING)
    e = engine(tmp_path, "fp16", num_blocks=32, residual=8)
    assert e.list_sequences("c", T) == []
    assert f"{differs}=" in caplog.text and "not listed here" in caplog.text
    e = reopen(e, tmp_path, "fp16", num_blocks=32, **{"residual": 8, **first})
    assert [i.seq_id for i in e.list_sequences("c", T)] == ["s"]
    e.check_invariants()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_a_persist_sequence_the_disk_bound_refuses_is_kept(tmp_path, caplog, codec):
    """The disk bound too small for it: its session's lapse keeps it in memory (counted,
    as a pinned one would stay), and the daemon's stop offloads it past the bound
    (logged) rather than drop it; after the restart it is listed with its tokens, and
    the store, over its bound, takes no other sequence until that one is freed."""
    e = engine(tmp_path, codec, num_blocks=32, residual=8, lmdb_max_bytes=4096)
    tokens = toks(0, 40)
    e.allocate("c", T, "keep", tokens, owner="w", persist=True)
    k, v = kv_of(tokens)
    e.append("c", T, ["keep"], k, v, [len(tokens)], token_ids=[tokens])
    put(e, "other", toks(100, 40))
    want = read(e, "keep")
    leases = LeaseManager(e, timeout_s=1, clock=lambda: 0.0)
    leases.touch(T, "w")
    leases.clock = lambda: 5.0
    leases.reap()
    assert leases.counters["offload_failed"] == 1
    assert e.sequence_info("c", T, "keep").tier == "gpu" and same(read(e, "keep"), want)
    e.check_invariants()
    caplog.set_level(logging.INFO)
    e.close()
    assert "offloaded at the stop past the disk tier's bound" in caplog.text and "it is gone" not in caplog.text
    e = reopen(e, tmp_path, codec, num_blocks=32, residual=8, lmdb_max_bytes=4096)
    assert [(s.seq_id, s.tier, s.persist) for s in e.list_sequences("c", T)] == [("keep", "disk", True)]
    assert same(read(e, "keep"), want)
    put(e, "more", toks(200, 40))
    with pytest.raises(KVStoreError) as err:
        e.offload("c", T, ["more"])
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert e.sequence_info("c", T, "more").tier == "gpu"
    e.free("c", T, ["keep"])
    e.check_invariants()


def test_a_restart_into_fewer_max_sequences_lists_every_sequence_and_frees_them_in_one_call(tmp_path):
    """Four offloaded sequences come back in a cache of max_sequences 2 (pool sizes may
    differ): all listed, Allocate refused until enough are freed, and a Free or Offload
    may name all four at once; other calls keep the max_sequences row bound."""
    from kvstore.errors import InvalidArgument, ResourceExhausted
    e = engine(tmp_path, "fp16", max_sequences=8)
    for i in range(4):
        put(e, f"s{i}", toks(1000 * i, 20))
    e.offload("c", T, [f"s{i}" for i in range(4)])
    e = reopen(e, tmp_path, "fp16", max_sequences=2)
    ids = [f"s{i}" for i in range(4)]
    assert sorted(i.seq_id for i in e.list_sequences("c", T)) == ids
    with pytest.raises(ResourceExhausted, match="max_sequences=2"):
        e.allocate("c", T, "new", [])
    with pytest.raises(InvalidArgument, match="^sequence_ids: 3 rows, more than the cache's max_sequences=2$"):
        e.prefetch("c", T, ids[:3])
    e.offload("c", T, ids)                      # already on disk: nothing to write, and not refused
    with pytest.raises(InvalidArgument, match="^sequence_ids: 5 rows, .* and the 4 sequences it holds$"):
        e.free("c", T, ids + ["s0"])
    assert len(e.list_sequences("c", T)) == 4
    e.free("c", T, ids)
    assert e.list_sequences("c", T) == [] and e.cold_store.keys(b"M") == []     # their disk copies went too
    e.allocate("c", T, "new", [])
    e.check_invariants()
