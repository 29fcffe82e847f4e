"""The block pool and the engine's allocator, checked after every step.

(a) BlockPool unit tests: allocate / ref / release / lookup / set_hash and the
    eviction order (unhashed freed blocks are reused first, hashed ones are
    evicted least recently freed first; None and no change when out of room),
    plus a seeded run against a list model of the free queue.
(b) A seeded run of 3,000 random operations on kvstore.engine.engine.Engine for
    each codec (and PQ with fp16 sink tokens), against a shadow copy of every token's K/V. After every
    operation: Engine.check_invariants(), and the engine's view of each
    sequence equals the shadow's. A refused operation must leave the engine
    exactly as it was. Periodically, Retrieve equals the shadow (bitwise; PQ
    sealed tokens equal the shadow encoded and decoded) and Attend equals the
    fp64 reference over what Retrieve returns plus the uncommitted tokens.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from kvstore.core.block_pool import BlockPool
from kvstore.engine.engine import Engine
from kvstore.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, KVStoreError, NotFound,
                            ResourceExhausted)
from kvstore.core.hashing import chain_hashes
from kvstore.kernels import reference as ref
from tests.helpers import config, one_thread  # noqa: F401

H = [bytes([i]) * 32 for i in range(16)]     # distinct fake content hashes


# =============================================================== (a) BlockPool
def pool_state(p: BlockPool):
    return (list(p._free), [(b.ref_cnt, b.hash) for b in p.blocks], dict(p._by_hash), p.evictions)


class Held:
    """The references a test holds, to check ref counts against after each step."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.refs: Counter[int] = Counter()

    def check(self) -> None:
        self.pool.check_invariants(dict(self.refs))
        s = self.pool.stats()
        assert s.used == len(+self.refs)
        assert s.cached == sum(1 for b in self.pool.blocks if b.ref_cnt == 0 and b.hash is not None)

    def allocate(self, n: int):
        ids = self.pool.allocate(n)
        if ids is not None:
            self.refs.update(ids)
        self.check()
        return ids

    def ref(self, ids) -> None:
        self.pool.ref(ids)
        self.refs.update(ids)
        self.check()

    def release(self, ids) -> None:
        self.pool.release(ids)
        self.refs.subtract(ids)
        self.check()

    def set_hash(self, bid: int, h: bytes) -> None:
        self.pool.set_hash(bid, h)
        self.check()


def test_allocate_in_order_and_none_without_change_when_out_of_room():
    held = Held(BlockPool(4))
    held.check()
    assert held.pool.num_allocatable() == 4
    assert held.allocate(0) == []
    assert held.allocate(3) == [0, 1, 2]
    assert all(held.pool.blocks[b].ref_cnt == 1 for b in (0, 1, 2))
    before = pool_state(held.pool)
    assert held.allocate(2) is None
    assert pool_state(held.pool) == before
    assert held.allocate(1) == [3]
    assert held.allocate(1) is None and pool_state(held.pool)[0] == []
    s = held.pool.stats()
    assert (s.used, s.free, s.cached, s.evictions) == (4, 0, 0, 0)


def test_unhashed_freed_blocks_are_reused_first_most_recent_first():
    held = Held(BlockPool(6))
    a = held.allocate(4)                     # 0 1 2 3; free: 4 5
    held.release([a[1]])                     # unhashed -> front: 1 4 5
    held.release([a[3]])                     # 3 1 4 5
    assert list(held.pool._free) == [3, 1, 4, 5]
    assert held.allocate(3) == [3, 1, 4]
    assert held.pool.evictions == 0


def test_hashed_blocks_are_evicted_last_and_in_lru_order():
    held = Held(BlockPool(6))
    assert held.allocate(6) == [0, 1, 2, 3, 4, 5]
    for b in (0, 2, 4):                      # sealed blocks with content hashes; 1, 3, 5 have none
        held.set_hash(b, H[b])
    held.release([2])                        # cached: back of the queue
    held.release([0])
    held.release([4])
    held.release([5])                        # unhashed: front, reused before any cached block
    assert list(held.pool._free) == [5, 2, 0, 4]
    s = held.pool.stats()
    assert (s.used, s.cached, s.free) == (2, 3, 1)
    assert [held.pool.lookup(H[i]) for i in range(6)] == [0, None, 2, None, 4, None]
    assert held.allocate(2) == [5, 2]        # the free one, then the least recently freed cached one
    assert held.pool.evictions == 1
    assert held.pool.lookup(H[2]) is None and held.pool.blocks[2].hash is None
    assert held.pool.lookup(H[0]) == 0       # still findable until its slot is needed
    assert held.allocate(1) == [0]
    assert held.pool.evictions == 2 and held.pool.lookup(H[0]) is None
    assert held.allocate(2) is None          # only block 4 is left
    assert held.pool.lookup(H[4]) == 4


def test_ref_revives_a_cached_block_and_release_makes_it_most_recent():
    held = Held(BlockPool(4))
    held.allocate(4)
    for b in range(4):
        held.set_hash(b, H[b])
    held.release([0, 1, 2, 3])               # LRU order 0 1 2 3
    assert held.pool.stats().cached == 4
    hit = held.pool.lookup(H[1])
    held.ref([hit])                          # a prefix hit takes it back out of the queue
    assert list(held.pool._free) == [0, 2, 3] and held.pool.lookup(H[1]) == 1
    held.ref([1])                            # a second sharer
    held.release([1])
    assert 1 not in held.pool._free
    held.release([1])                        # now the most recently freed
    assert list(held.pool._free) == [0, 2, 3, 1]
    assert held.allocate(4) == [0, 2, 3, 1]
    assert held.pool.evictions == 4 and held.pool.stats().cached == 0


def test_set_hash_rules():
    held = Held(BlockPool(3))
    a, b, _ = held.allocate(3)
    held.set_hash(a, H[0])
    held.set_hash(a, H[0])                   # idempotent
    held.set_hash(b, H[0])                   # same content twice: the index keeps the first
    assert held.pool.lookup(H[0]) == a and held.pool.blocks[b].hash == H[0]
    with pytest.raises(AssertionError):
        held.pool.set_hash(a, H[1])          # a sealed block never changes content
    held.release([a])
    with pytest.raises(AssertionError):
        held.pool.set_hash(a, H[0])          # only referenced (live) blocks are hashed
    held.check()
    assert held.allocate(1) == [a]           # evicting a drops the index entry it owned
    assert held.pool.lookup(H[0]) is None and held.pool.blocks[b].hash == H[0]
    held.release([b])                        # the index had no block for H[0]: b takes its place
    assert held.pool.lookup(H[0]) == b and held.pool.stats().cached == 1
    assert held.allocate(1) == [b] and held.pool.lookup(H[0]) is None
    held.check()


def test_a_duplicate_block_is_free_once_released_not_cached():
    """The same content computed twice: only the indexed block is findable, so only
    it is counted cached, and evicted; the other is free once released, reused first."""
    held = Held(BlockPool(3))
    a, b, c = held.allocate(3)
    held.set_hash(a, H[0])
    held.set_hash(b, H[0])
    held.release([a, b])
    s = held.pool.stats()
    assert (s.used, s.cached, s.free) == (1, 1, 1) and held.pool.blocks[b].hash is None
    assert held.allocate(1) == [b] and held.pool.evictions == 0     # the free one first: nothing evicted
    assert held.allocate(1) == [a] and held.pool.evictions == 1
    held.check()


def test_double_free_and_clear_hashes():
    held = Held(BlockPool(3))
    a, b, c = held.allocate(3)
    held.set_hash(a, H[0])
    held.set_hash(b, H[1])
    held.release([a, b])
    with pytest.raises(AssertionError, match="double free"):
        held.pool.release([a])
    held.pool.clear_hashes()
    held.check()
    assert held.pool.lookup(H[0]) is None and held.pool.stats().cached == 0
    assert held.pool.num_allocatable() == 2


def test_pool_against_a_model_of_the_free_queue():
    """Seeded random operations; the free queue order, ref counts, hashes and
    index must equal a plain-list model after every step."""
    rng = random.Random(7)
    n = 12
    held = Held(BlockPool(n))
    free = list(range(n))                    # model: front = next to allocate
    refc = [0] * n
    hashes: list[bytes | None] = [None] * n
    index: dict[bytes, int] = {}
    evictions = 0
    next_hash = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            k = rng.randint(0, 4)
            got = held.allocate(k)
            if k > len(free):
                assert got is None
            else:
                want = free[:k]
                del free[:k]
                for bid in want:
                    if hashes[bid] is not None:
                        if index.get(hashes[bid]) == bid:
                            del index[hashes[bid]]
                        hashes[bid] = None
                        evictions += 1
                    refc[bid] = 1
                assert got == want
        elif op < 0.55:
            live = [b for b in range(n) if refc[b]]
            if live:
                ids = rng.sample(live, rng.randint(1, min(3, len(live))))
                held.release(ids)
                for bid in ids:
                    refc[bid] -= 1
                    if refc[bid] == 0:
                        # a duplicate of an indexed hash is not findable: free; an
                        # unindexed hash (its first block evicted) is indexed here
                        if hashes[bid] is not None and index.setdefault(hashes[bid], bid) != bid:
                            hashes[bid] = None
                        if hashes[bid] is None:
                            free.insert(0, bid)
                        else:
                            free.append(bid)
        elif op < 0.75:
            live = [b for b in range(n) if refc[b] and hashes[b] is None]
            if live:
                bid = rng.choice(live)
                h = H[rng.randrange(len(H))] if rng.random() < 0.3 else next_hash.to_bytes(8, "big") + b"x" * 24
                next_hash += 1
                held.set_hash(bid, h)
                hashes[bid] = h
                index.setdefault(h, bid)
        else:
            known = list(index)
            if known:
                h = rng.choice(known)
                bid = held.pool.lookup(h)
                assert bid == index[h]
                held.ref([bid])
                if refc[bid] == 0:
                    free.remove(bid)
                refc[bid] += 1
        assert list(held.pool._free) == free, step
        assert [b.ref_cnt for b in held.pool.blocks] == refc
        assert [b.hash for b in held.pool.blocks] == hashes
        assert held.pool._by_hash == index
        assert held.pool.evictions == evictions


# =========================================================== (b) the engine
L, HQ, HKV, D, BS, R = 2, 4, 2, 16, 8, 8
TENANT = "t"
VOCAB = 64
MAX_LEN = 160          # sequences longer than this are freed, not grown
N_OPS = 3000
CHECK_EVERY = 50
RTOL = ATOL = 1e-3     # attention: fp32 kernels, fp16 output (half an ulp is < 5e-4 relative)

_G = torch.Generator().manual_seed(1234)
BASE_K, BASE_V = torch.randn(2, VOCAB, L, HKV, D, generator=_G)
POS_K, POS_V = 0.5 * torch.randn(2, MAX_LEN + 8, L, HKV, D, generator=_G)
TOPICS = [[random.Random(100 + t).randrange(VOCAB) for _ in range(MAX_LEN + 8)] for t in range(3)]


def token_rows(ids: list[int], start: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, n, Hkv, d] fp16 for positions [start, start + n). A position
    whose token id is known gets a function of (id, position), as a model
    would compute: sequences that share a prefix share its K/V, which is
    what makes prefix hits and deduplicated blocks correct. Unknown ids get
    random values."""
    k = torch.randn(L, n, HKV, D, generator=gen)
    v = torch.randn(L, n, HKV, D, generator=gen)
    for i in range(n):
        p = start + i
        if p < len(ids):
            k[:, i] = BASE_K[ids[p]] + POS_K[p]
            v[:, i] = BASE_V[ids[p]] + POS_V[p]
    return k.half(), v.half()


@dataclass
class Shadow:
    """What the test appended: per layer, every token visible at that layer
    (committed, then pending, then reserved), exactly as sent."""
    topic: int
    ids: list[int]
    k: list[torch.Tensor] = field(default_factory=lambda: [torch.empty(0, HKV, D, dtype=torch.float16)] * L)
    v: list[torch.Tensor] = field(default_factory=lambda: [torch.empty(0, HKV, D, dtype=torch.float16)] * L)
    length: int = 0
    pending: list[int] = field(default_factory=lambda: [0] * L)
    reserved: int = 0
    # PQ: the shadow's tokens from the sinks on, encoded and decoded, per layer (sealed tokens never change).
    decoded: list[tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=lambda: [(torch.empty(0, HKV, D), torch.empty(0, HKV, D))] * L)

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = torch.cat([self.k[layer], k])
        self.v[layer] = torch.cat([self.v[layer], v])

    def visible(self, layer: int) -> int:
        return self.length + self.pending[layer] + self.reserved

    def max_visible(self) -> int:
        return max(self.visible(layer) for layer in range(L))

    def clone(self) -> "Shadow":
        return Shadow(self.topic, list(self.ids), list(self.k), list(self.v), self.length, list(self.pending),
                      self.reserved, list(self.decoded))


def apply_token_ids(known: list[int], start: int, ids: list[int]) -> list[int]:
    """The engine's rule: ids extend the known prefix only if it reaches `start`."""
    out = list(known)
    if len(out) >= start:
        out.extend(ids[len(out[start:start + len(ids)]):])
    return out


class Fuzz:
    def __init__(self, codec: str, seed: int, sinks: int = 0):
        self.codec = codec
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.e = Engine()
        if codec == "pq":
            cfg = config("pq", name="c", block_size=BS, residual=R, num_blocks=8, max_sequences=5, sink_tokens=sinks)
        else:
            cfg = config("fp16", name="c", block_size=BS, residual=R, num_blocks=16, max_sequences=6)
        self.cfg = cfg
        # The most tokens one sequence can hold: all main blocks sealed, plus the fp16 sinks and tail.
        self.max_tokens = cfg.num_blocks * BS + (sinks + R + BS if codec == "pq" else 0)
        self.e.create_cache(cfg)
        self.c = self.e.cache("c")
        if codec == "pq":
            self.e.train_codebooks("c", torch.randn(L, 512, HKV, D, generator=self.gen),
                                   torch.randn(L, 512, HKV, D, generator=self.gen), niter=2)
        self.sh: dict[str, Shadow] = {}
        self.n_ids = 0
        self.step = 0
        self.outcomes: Counter[str] = Counter()
        self.start_stats = self.e.stats()["c"]

    # ------------------------------------------------------------ plumbing
    def state(self):
        """A deep snapshot of everything a refused operation must not change."""
        pools = [self.c.main_pool] + ([self.c.tail_pool] if self.c.is_pq else [])
        return (repr(self.e.stats()),
                [self.e.sequence_info("c", TENANT, sid) for sid in sorted(self.sh)],
                sorted(self.c.seqs),
                [pool_state(p) for p in pools])

    def run(self, name: str, call, ok, must: type | None = None, may: tuple = ()):
        """call() the engine. `must`: the error it has to raise; `may`: errors
        it is allowed to raise. A raised error must leave state unchanged."""
        before = self.state()
        try:
            result = call()
        except KVStoreError as e:
            allowed = ((must,) if must else ()) + tuple(may)
            assert isinstance(e, allowed), f"op {self.step} {name}: unexpected {type(e).__name__}: {e}"
            after = self.state()
            if after != before:
                what = [w for w, b, a in zip(("stats", "sequences", "ids", "pools"), before, after) if b != a]
                raise AssertionError(f"op {self.step} {name}: {type(e).__name__} ({e}) changed {what}")
            self.outcomes[f"{name}/{type(e).__name__}"] += 1
        else:
            assert must is None, f"op {self.step} {name}: should have raised {must.__name__}"
            ok(result)
            self.outcomes[name] += 1
        self.e.check_invariants()
        self.check_model()

    def check_model(self) -> None:
        assert sorted(sid for _, sid in self.c.seqs) == sorted(self.sh)
        for sid, sh in self.sh.items():
            info = self.e.sequence_info("c", TENANT, sid)
            got = (info.length, info.pending, info.reserved, info.known_token_ids)
            assert got == (sh.length, sh.pending, sh.reserved, len(sh.ids)), (self.step, sid, got)
            assert info.block_hashes == chain_hashes(sh.ids, BS, self.c.fingerprint, self.c._root(TENANT)), (self.step, sid)
            assert all(sh.k[layer].shape[0] == sh.visible(layer) for layer in range(L))

    def tight(self, main: int, tail: int) -> tuple:
        """ResourceExhausted is allowed only if the pools may really lack
        `main` sealed and `tail` fp16 blocks (upper bounds of what is needed)."""
        if self.c.is_pq:
            short = main > self.c.main_pool.num_allocatable() or tail > self.c.tail_pool.num_allocatable()
        else:
            short = main + tail > self.c.main_pool.num_allocatable()
        return (ResourceExhausted,) if short else ()

    def new_id(self) -> str:
        self.n_ids += 1
        return f"s{self.n_ids}"

    def pick(self, pred=lambda sh: True) -> str | None:
        ids = [sid for sid, sh in self.sh.items() if pred(sh)]
        return self.rng.choice(sorted(ids)) if ids else None

    # ---------------------------------------------------------- expectations
    def expected(self, sid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K, V [visible, Hkv, d] the engine must hold: the shadow, with
        PQ-sealed tokens encoded and decoded with the cache's codebooks."""
        sh = self.sh[sid]
        k, v = sh.k[layer].float(), sh.v[layer].float()
        n = len(self.e.sequence_info("c", TENANT, sid).sealed_blocks) * BS
        s0 = self.c.sinks                   # sealed tokens are [s0, s0 + n)
        if self.c.is_pq and n:
            dk, dv = sh.decoded[layer]
            if dk.shape[0] < n:     # encoding is per token: extend the memo with the newly sealed ones
                cbk, cbv = self.c.codebooks.k[layer], self.c.codebooks.v[layer]
                new_k, new_v = sh.k[layer][s0 + dk.shape[0]:s0 + n], sh.v[layer][s0 + dk.shape[0]:s0 + n]
                dk = torch.cat([dk, ref.pq_dequantize(ref.pq_encode(new_k, cbk), cbk)])
                dv = torch.cat([dv, ref.pq_dequantize(ref.pq_encode(new_v, cbv), cbv)])
                sh.decoded[layer] = (dk, dv)
            k[s0:s0 + n], v[s0:s0 + n] = dk[:n], dv[:n]
        return k, v

    def check_retrieved(self, sid: str, start: int, end: int, l0: int, l1: int, k, v) -> None:
        assert k.shape == v.shape == (l1 - l0, end - start, HKV, D)
        for i, layer in enumerate(range(l0, l1)):
            ek, ev = self.expected(sid, layer)
            for got, want, name in ((k[i], ek[start:end], "k"), (v[i], ev[start:end], "v")):
                if not torch.equal(got.view(torch.int16), want.half().view(torch.int16)):
                    bad = (got.float() != want.half().float()).any(-1).any(-1).nonzero().flatten()
                    raise AssertionError(f"op {self.step}: Retrieve {sid} layer {layer} {name} differs from the "
                                         f"shadow at tokens {(bad + start).tolist()[:10]}")

    def check_out(self, sids: list[str], layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        assert out.shape == q.shape and out.dtype == torch.float16
        for b, sid in enumerate(sids):
            k, v = self.expected(sid, layer)
            want = ref.attention_dense(q[b].double(), k.double(), v.double(), 1 / math.sqrt(D))[0]
            assert torch.allclose(out[b].double(), want, rtol=RTOL, atol=ATOL), \
                f"op {self.step}: attend {sid} layer {layer}: max err {(out[b].double() - want).abs().max():.2e}"

    def verify_all(self) -> None:
        """Retrieve of every sequence equals the shadow; Attend of one equals
        the fp64 reference over Retrieve's K/V plus its uncommitted tokens."""
        for sid in sorted(self.sh):
            n = self.sh[sid].length
            if n:
                k, v = self.e.retrieve("c", TENANT, sid, 0, n)
                self.check_retrieved(sid, 0, n, 0, L, k, v)
        sid = self.pick(lambda sh: sh.length > 0)
        if sid is None:
            return
        sh = self.sh[sid]
        rk, rv = self.e.retrieve("c", TENANT, sid, 0, sh.length)
        for layer in range(L):
            q = torch.randn(1, HQ, D, generator=self.gen).half()
            out = self.e.attend("c", TENANT, layer, [sid], q)
            k = torch.cat([rk[layer].double(), sh.k[layer][sh.length:].double()])
            v = torch.cat([rv[layer].double(), sh.v[layer][sh.length:].double()])
            want = ref.attention_dense(q[0].double(), k, v, 1 / math.sqrt(D))[0]
            # PQ: the kernel decodes codes in fp32, Retrieve rounds them to fp16.
            tol = 5e-3 if self.c.is_pq else ATOL
            assert torch.allclose(out[0].double(), want, rtol=tol, atol=tol), \
                f"op {self.step}: attend {sid} layer {layer} vs Retrieve: {(out[0].double() - want).abs().max():.2e}"
        self.e.check_invariants()

    # ------------------------------------------------------------ operations
    def op_allocate(self) -> None:
        sid = self.new_id()
        topic = self.rng.randrange(len(TOPICS))
        if self.rng.random() < 0.15:
            prompt = []
        else:
            cut = self.rng.choice([7, 8, 16, 17, 24, 31, 40, 48, 56, self.rng.randrange(1, 64)])
            prompt = TOPICS[topic][:cut]
            if self.rng.random() < 0.25:    # a private suffix
                prompt = prompt + [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 12))]
        full = len(self.sh) >= self.cfg.max_sequences

        def ok(r):
            c = r.cached_tokens
            assert c % BS == 0 and (c < len(prompt) or c == 0) and r.hit_blocks == c // BS
            sh = Shadow(topic, list(prompt))
            k, v = token_rows(prompt, 0, c, self.gen)
            for layer in range(L):
                sh.add(layer, k[layer], v[layer])
            sh.length = c
            self.sh[sid] = sh
        # A prefix hit may need fresh sealed blocks, but it shortens the hit rather than fail.
        self.run("allocate", lambda: self.e.allocate("c", TENANT, sid, prompt), ok,
                 must=ResourceExhausted if full else None)

    def _grow(self, sh: Shadow, n: int) -> int:
        return max(0, min(n, MAX_LEN - sh.max_visible()))

    def op_append(self) -> None:
        """All layers, one to three sequences, with or without token ids."""
        k_seqs = 1 if self.rng.random() < 0.8 else self.rng.randint(2, 3)
        idle = sorted(s for s, x in self.sh.items() if not any(x.pending) and not x.reserved)
        pool = idle if len(idle) >= k_seqs and self.rng.random() < 0.85 else sorted(self.sh)
        sids = self.rng.sample(pool, min(k_seqs, len(pool)))
        plan = []
        for sid in sids:
            sh = self.sh[sid]
            if sh.length < len(sh.ids) and self.rng.random() < 0.6:
                n = len(sh.ids) - sh.length            # prefill the rest of the prompt
            else:
                n = self.rng.choice([1, 1, 2, 3, 5, 8, 9, 16, 23])
            n = self._grow(sh, n)
            if n == 0:
                return self.op_free(sid)
            if self.rng.random() < 0.6:
                ids = [sh.ids[p] if p < len(sh.ids) else TOPICS[sh.topic][p] if self.rng.random() < 0.95
                       else self.rng.randrange(VOCAB) for p in range(sh.length, sh.length + n)]
                known = apply_token_ids(sh.ids, sh.length, ids)
            else:
                ids, known = [], sh.ids
            plan.append((sid, n, ids, known, *token_rows(known, sh.length, n, self.gen)))
        k = torch.cat([p[4] for p in plan], dim=1)
        v = torch.cat([p[5] for p in plan], dim=1)
        counts = [p[1] for p in plan]
        token_ids = [p[2] for p in plan] if any(p[2] for p in plan) else None
        busy = any(any(self.sh[s].pending) or self.sh[s].reserved for s in sids)
        beyond = any(self.sh[s].length + n > self.max_tokens for s, n in zip(sids, counts))
        bound = sum(math.ceil(n / BS) + 1 for n in counts)

        def ok(_):
            for sid, n, _ids, known, kk, vv in plan:
                sh = self.sh[sid]
                sh.ids = known
                for layer in range(L):
                    sh.add(layer, kk[layer], vv[layer])
                sh.length += n
        # Past max_tokens a sequence never fits: InvalidArgument, whatever the pools hold.
        self.run("append", lambda: self.e.append("c", TENANT, sids, k, v, counts, token_ids=token_ids), ok,
                 must=FailedPrecondition if busy else InvalidArgument if beyond else None,
                 may=self.tight(bound, bound) + ((InvalidArgument,) if beyond else ()))

    def _layer_plan(self, sids: list[str], layer: int, n_of):
        plan = []
        for sid in sids:
            sh = self.sh[sid]
            n = n_of(sh)
            pos = sh.length + sh.pending[layer] + sh.reserved
            k, v = token_rows(sh.ids, pos, n, self.gen)
            plan.append((sid, n, k[layer], v[layer]))
        return plan

    def _apply_layer_plan(self, plan, layer: int) -> None:
        for sid, n, k, v in plan:
            sh = self.sh[sid]
            sh.add(layer, k, v)
            sh.pending[layer] += n
            commit = min(sh.pending)
            sh.length += commit
            sh.pending = [p - commit for p in sh.pending]

    def op_append_layer(self) -> None:
        """Decode style: one layer at a time, usually the next one in order."""
        sids = self.rng.sample(sorted(self.sh), min(1 if self.rng.random() < 0.8 else 2, len(self.sh)))
        first = self.sh[sids[0]]
        layer = first.pending.index(min(first.pending)) if self.rng.random() < 0.8 else self.rng.randrange(L)
        n_each = 1 if self.rng.random() < 0.7 else self.rng.randint(2, 5)
        if any(self._grow(self.sh[s], n_each) < n_each for s in sids):
            return self.op_free(sids[0])
        plan = self._layer_plan(sids, layer, lambda sh: n_each)
        k = torch.cat([p[2] for p in plan])
        v = torch.cat([p[3] for p in plan])
        busy = any(self.sh[s].reserved for s in sids)
        bound = len(sids) * (math.ceil(n_each / BS) + 1)
        self.run("append_layer",
                 lambda: self.e.append("c", TENANT, sids, k, v, [n_each] * len(sids), layer=layer),
                 lambda _: self._apply_layer_plan(plan, layer),
                 must=FailedPrecondition if busy else None, may=self.tight(bound, bound))

    def op_append_attend(self) -> None:
        sids = self.rng.sample(sorted(self.sh), min(self.rng.randint(1, 3), len(self.sh)))
        first = self.sh[sids[0]]
        layer = first.pending.index(min(first.pending)) if self.rng.random() < 0.7 else self.rng.randrange(L)
        if any(self._grow(self.sh[s], 1) < 1 for s in sids):
            return self.op_free(sids[0])
        plan = self._layer_plan(sids, layer, lambda sh: 1)
        k = torch.stack([p[2][0] for p in plan])
        v = torch.stack([p[3][0] for p in plan])
        q = torch.randn(len(sids), HQ, D, generator=self.gen).half()
        busy = any(self.sh[s].reserved for s in sids)

        def ok(out):
            self._apply_layer_plan(plan, layer)
            self.check_out(sids, layer, q, out)
        self.run("append_attend", lambda: self.e.append_attend("c", TENANT, layer, sids, k, v, q), ok,
                 must=FailedPrecondition if busy else None, may=self.tight(2 * len(sids), 2 * len(sids)))

    def op_reserve(self) -> None:
        sid = self.pick(lambda sh: sh.reserved > 0) if self.rng.random() < 0.5 else None
        sid = sid or (self.pick(lambda sh: not any(sh.pending)) if self.rng.random() < 0.8 else None) or self.pick()
        sh = self.sh[sid]
        n = self._grow(sh, self.rng.choice([0, 1, 1, 2, 3, 5, 8, 12]))
        busy = any(sh.pending)

        def ok(r):
            sh.length += sh.reserved      # the last reservation commits (its rows are in the shadow)
            sh.reserved = n
            assert r.length == sh.length + n and len(r.slot_mapping) == n
            info = self.e.sequence_info("c", TENANT, sid)
            assert r.sealed_blocks == info.sealed_blocks and r.tail_blocks == info.tail_blocks
            if not n:
                return
            blocks = torch.tensor(r.slot_mapping) // BS
            for b in set(blocks.tolist()):        # slots are private to the sequence
                assert b in r.tail_blocks and self.c.tail_pool.blocks[b].ref_cnt == 1, (self.step, sid, b)
            # The client writes the reserved slots itself, in every layer (mapped attend).
            k, v = token_rows(sh.ids, sh.length, n, self.gen)
            self.c.tail.write(slice(None), blocks, torch.tensor(r.slot_mapping) % BS, k, v)
            for layer in range(L):
                sh.add(layer, k[layer], v[layer])
        self.run("reserve", lambda: self.e.reserve("c", TENANT, sid, n), ok,
                 must=FailedPrecondition if busy else None,
                 may=self.tight(math.ceil(sh.reserved / BS) + 1, math.ceil(n / BS) + 1))

    def op_attend(self) -> None:
        sids = [self.rng.choice(sorted(self.sh)) for _ in range(self.rng.randint(1, 3))]   # repeats allowed
        layer = self.rng.randrange(L)
        q = torch.randn(len(sids), HQ, D, generator=self.gen).half()
        empty = any(self.sh[s].visible(layer) == 0 for s in sids)
        self.run("attend", lambda: self.e.attend("c", TENANT, layer, sids, q),
                 lambda out: self.check_out(sids, layer, q, out), must=InvalidArgument if empty else None)

    def op_retrieve(self) -> None:
        sid = self.pick(lambda sh: sh.length > 0)
        if sid is None:
            return
        n = self.sh[sid].length
        start = self.rng.randrange(n)
        end = self.rng.randint(start + 1, n)
        l0 = self.rng.randrange(L)
        l1 = self.rng.randint(l0 + 1, L)
        self.run("retrieve", lambda: self.e.retrieve("c", TENANT, sid, start, end, l0, l1),
                 lambda kv: self.check_retrieved(sid, start, end, l0, l1, *kv))

    def op_fork(self) -> None:
        src = self.pick()
        dst = self.new_id()
        sh = self.sh[src]
        info = self.e.sequence_info("c", TENANT, src)
        partial = sh.length % BS != 0 and len(info.tail_blocks) > 0
        if len(self.sh) >= self.cfg.max_sequences:
            must = ResourceExhausted
        elif any(sh.pending) or sh.reserved:
            must = FailedPrecondition
        elif partial and self.c.tail_pool.num_allocatable() == 0:
            must = ResourceExhausted
        else:
            must = None

        def ok(_):
            self.sh[dst] = sh.clone()
        self.run("fork", lambda: self.e.fork("c", TENANT, src, dst), ok, must=must)

    def op_free(self, sid: str | None = None) -> None:
        if sid is None:
            by_len = sorted(self.sh, key=lambda s: -self.sh[s].max_visible())
            sids = [by_len[0]] if self.rng.random() < 0.4 else self.rng.sample(sorted(self.sh),
                                                                               min(self.rng.randint(1, 2), len(self.sh)))
        else:
            sids = [sid]

        def ok(_):
            for s in sids:
                del self.sh[s]
        self.run("free", lambda: self.e.free("c", TENANT, sids), ok)

    def op_bad(self) -> None:
        """Requests that must be refused, each leaving state unchanged."""
        sid = self.pick()
        sh = self.sh[sid]
        kind = self.rng.choice(["nan", "shape", "layer", "range", "ids", "batch_ids", "batch_reserved",
                                "exists", "unknown", "reserve"])
        k, v = token_rows([], 0, 2, self.gen)
        if kind == "nan":
            k[0, 1, 0, 3] = float("nan")
            call, must = lambda: self.e.append("c", TENANT, [sid], k, v, [2]), InvalidArgument
        elif kind == "shape":
            call, must = lambda: self.e.append("c", TENANT, [sid], k[:, :, :1], v[:, :, :1], [2]), InvalidArgument
        elif kind == "layer":
            q = torch.randn(1, HQ, D, generator=self.gen).half()
            call, must = lambda: self.e.attend("c", TENANT, L, [sid], q), InvalidArgument
        elif kind == "range":
            call, must = lambda: self.e.retrieve("c", TENANT, sid, 0, sh.length + 1), InvalidArgument
        elif kind == "ids" and len(sh.ids) > sh.length and not any(sh.pending) and not sh.reserved:
            wrong = [(sh.ids[sh.length] + 1) % VOCAB, 0]
            call, must = lambda: self.e.append("c", TENANT, [sid], k, v, [2], token_ids=[wrong]), InvalidArgument
        elif kind == "batch_ids":
            idle = sorted(s for s, x in self.sh.items() if not any(x.pending) and not x.reserved)
            if len(idle) < 2:
                return
            pair = self.rng.sample(idle, 2)
            call, must = (lambda: self.e.append("c", TENANT, pair, k, v, [1, 1], token_ids=[[], [-1]]),
                          InvalidArgument)
        elif kind == "batch_reserved":
            busy = self.pick(lambda x: x.reserved > 0)
            other = self.pick(lambda x: x.reserved == 0)
            if busy is None or other is None:
                return
            call, must = (lambda: self.e.append("c", TENANT, [other, busy], k[0], v[0], [1, 1], layer=0),
                          FailedPrecondition)
        elif kind == "exists":
            call, must = lambda: self.e.allocate("c", TENANT, sid, []), AlreadyExists
        elif kind == "unknown":
            call, must = lambda: self.e.free("c", TENANT, [sid, "nope"]), NotFound
        else:
            call, must = lambda: self.e.reserve("c", TENANT, sid, (1 << 20) + 1), InvalidArgument
        self.run(f"bad_{kind}", call, lambda _: None, must=must)

    OPS = [("allocate", 10), ("append", 14), ("append_layer", 14), ("append_attend", 8), ("reserve", 6),
           ("attend", 6), ("retrieve", 6), ("fork", 5), ("free", 9), ("bad", 6)]

    def go(self, n_ops: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        while sum(self.outcomes.values()) < n_ops:      # ops that found no candidate do not count
            self.step += 1
            name = self.rng.choices(names, weights)[0] if self.sh else "allocate"
            getattr(self, f"op_{name}")()
            if self.step % CHECK_EVERY == 0:
                self.verify_all()
        self.verify_all()
        if self.sh:
            self.run("free", lambda: self.e.free("c", TENANT, sorted(self.sh)), lambda _: self.sh.clear())



@pytest.mark.parametrize("codec, sinks", [("fp16", 0), ("pq", 0), ("pq", 16)])
def test_engine_randomized_against_shadow(codec, sinks, one_thread):
    fuzz = Fuzz(codec, seed={("fp16", 0): 11, ("pq", 0): 12, ("pq", 16): 13}[codec, sinks], sinks=sinks)
    fuzz.go(N_OPS)
    # Everything freed: nothing is used, cached prefix blocks stay findable.
    s = fuzz.e.stats()["c"]
    assert s["sequences"] == 0 and s["tokens"] == 0
    assert s["main"].used == 0 and s["main"].free + s["main"].cached == s["main"].capacity
    if codec == "pq":
        assert s["tail"].used == 0 and s["tail"].free + s["tail"].cached == s["tail"].capacity
    fuzz.e.check_invariants()
    # The run exercised what it is meant to.
    o = fuzz.outcomes
    assert sum(o.values()) >= N_OPS
    assert s["prefix_hit_tokens"] > 0
    writes = ("append", "append_layer", "append_attend", "reserve")
    assert sum(o[f"{w}/ResourceExhausted"] for w in writes) > 0, o      # the pool ran out, not just max_sequences
    assert sum(v for k, v in o.items() if k.endswith("FailedPrecondition")) > 0, o
    assert all(o[name] > 0 for name in ("allocate", "append", "append_layer", "append_attend", "reserve",
                                        "attend", "retrieve", "fork", "free")), o
    if codec == "pq":                        # sealing (encode) and shared sealed blocks happened
        assert s["sealed_blocks"] > 0 and s["dedup_blocks"] > 0
    counts = {k: v for k, v in s.items() if "token" in k or "block" in k}
    tag = f"{codec} S={sinks}"
    print(f"\n{tag}: outcomes {dict(sorted(o.items()))}\n{tag}: stats {counts}")   # shown with -s


def test_a_prompt_run_again_counts_its_blocks_cached_once():
    """The same 40-token prompt (5 full blocks of 8) run four times, each request
    recomputing the last block the hit leaves out, then all freed: 5 blocks are
    cached (findable), not one more per request, and reusing their slots counts 5
    evictions."""
    from kvstore.engine.engine import Engine
    from tests.helpers import config, kv
    e = Engine("cpu")
    e.create_cache(config(codec="fp16", num_blocks=16))
    k, v = kv(2, 40, 2, 16)
    ids = list(range(100, 140))
    for i in range(4):
        hit = e.allocate("c", "t", f"s{i}", ids).cached_tokens
        e.append("c", "t", [f"s{i}"], k[:, hit:], v[:, hit:], [40 - hit], token_ids=[ids[hit:]])
    e.free("c", "t", [f"s{i}" for i in range(4)])
    s = e.stats()["c"]["main"]
    assert (s.used, s.cached) == (0, 5), s
    e.allocate("c", "t", "x", [])
    e.append("c", "t", ["x"], *kv(2, 16 * 8, 2, 16, seed=1), [16 * 8])      # every slot
    assert e.stats()["c"]["main"].evictions == 5
    e.check_invariants()
