"""Each cache has its own lock: a long request in one cache stalls no call on
another, nor a Stats of it, nor any session's Heartbeat, and neither does a
cache allocating its pools; the lease reaper waits for the busy cache only.
Requests are held inside a cache by a hook (an Event in a patched method),
never by timing; the waits below are only there so that a regression fails
instead of hanging."""
import dataclasses
import random
import sys
import threading

import pytest
import torch

from kvstore.client import KVStoreClient
import kvstore.engine.cache
import kvstore.engine.engine
from kvstore.engine.engine import Engine
from kvstore.service.daemon import create_server
from kvstore.service.leases import LeaseManager

from helpers import config, kv

L, HQ, HKV, D = 2, 4, 2, 16
TENANT = "default"
WAIT = 30      # seconds: generous, only so that a stall fails rather than hangs


class Held:
    """Wraps a function: the call made while armed signals `entered` and waits for `release`."""

    def __init__(self, fn):
        self.fn, self.armed = fn, True
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *a, **kw):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(WAIT), "never released"
        return self.fn(*a, **kw)


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    target = f"unix://{sock}"
    clients = [KVStoreClient(target, heartbeat=False) for _ in range(3)]
    for name in ("a", "b"):
        clients[0].create_cache(name, "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                codec="fp16", block_size=8, residual=8, num_blocks=4096)
        clients[0].allocate(name, "s", list(range(16)))
    yield clients, server.kvstore_engine
    for c in clients:
        c.close()
    server.stop(0)


def test_calls_on_another_cache_and_its_stats_run_while_one_cache_is_busy(live, monkeypatch):
    (kv_a, kv_b, _), engine = live
    held = Held(engine.cache("a").retrieve)
    monkeypatch.setattr(engine.cache("a"), "retrieve", held)      # runs under cache a's lock
    k, v = kv(L, 16, HKV, D)
    kv_a.append("a", ["s"], k, v)
    busy, busy_out = in_thread(lambda: kv_a.retrieve("a", "s", 0, 16))
    try:
        assert held.entered.wait(WAIT)

        def other():
            kv_b.append("b", ["s"], k, v)
            kv_b.allocate("b", "t", [1, 2, 3])
            q = torch.randn(1, HQ, D).half()
            return (kv_b.stats("b").caches[0], kv_b.sequence_info("b", "s").length,
                    kv_b.attend("b", 0, ["s"], q).shape, kv_b.get_cache("b").spec.name)
        th, out = in_thread(other)
        th.join(WAIT)
        assert not th.is_alive(), "a call on cache b waited for cache a's request"
        assert "error" not in out, out
        stats, length, shape, name = out["result"]
        assert (stats.cache, stats.sequences, stats.tokens, length, tuple(shape), name) == ("b", 2, 16, 16,
                                                                                            (1, HQ, D), "b")
        assert busy.is_alive()          # cache a's request is still held
    finally:
        held.release.set()
    busy.join(WAIT)
    assert "error" not in busy_out and busy_out["result"][0].shape == (L, 16, HKV, D)


def test_stats_of_every_cache_runs_while_a_long_prompt_is_hashed(live, monkeypatch):
    """Checking, copying and hashing a prompt take its cache's lock only at
    the start and end: Stats of every cache goes through in between."""
    (kv_a, kv_b, _), engine = live
    held = Held(kvstore.engine.cache.chain_hashes)
    monkeypatch.setattr(kvstore.engine.cache, "chain_hashes", held)
    prompt = list(range(20_000))
    busy, busy_out = in_thread(lambda: kv_a.allocate("a", "long", prompt))
    try:
        assert held.entered.wait(WAIT)
        th, out = in_thread(lambda: {c.cache: c.sequences for c in kv_b.stats().caches})
        th.join(WAIT)
        assert not th.is_alive(), "Stats waited for a prompt being hashed"
        assert out.get("result") == {"a": 1, "b": 1}, out
    finally:
        held.release.set()
    busy.join(WAIT)
    assert busy_out.get("result") == 0, busy_out
    info = kv_b.sequence_info("a", "long")
    assert info.known_token_ids == len(prompt) and len(info.block_hashes) == len(prompt) // 8


def test_the_lease_reaper_waits_for_the_busy_cache_only():
    """A lapsed session owns sequences in caches a and b while a request holds
    a: calls on b go on; the reaper frees the session's sequences once the
    request is done, and keeps what other sessions hold."""
    e = Engine()
    for name in ("a", "b"):
        e.create_cache(config("fp16", name=name, num_blocks=64))
        e.allocate(name, TENANT, "lapsed", [1, 2, 3], owner="s1")
    now = [0.0]
    leases = LeaseManager(e, timeout_s=10, clock=lambda: now[0])
    leases.touch(TENANT, "s1")
    held = Held(e.cache("a").retrieve)
    e.cache("a").retrieve = held
    k, v = kv(L, 4, HKV, D)
    e.append("a", TENANT, ["lapsed"], k, v, [4])
    busy, busy_out = in_thread(lambda: e.retrieve("a", TENANT, "lapsed", 0, 4))
    try:
        assert held.entered.wait(WAIT)
        now[0] += 11
        reaper, reaped = in_thread(leases.reap)
        th, out = in_thread(lambda: (e.allocate("b", TENANT, "other", [7], owner="s2"),
                                     e.append("b", TENANT, ["other"], k, v, [4]), e.stats("b")["b"]["sequences"]))
        th.join(WAIT)
        assert not th.is_alive(), "a call on cache b waited for the reaper"
        assert out.get("result", (None,))[-1] == 2, out
        assert reaper.is_alive()        # it needs cache a, which the request holds
    finally:
        held.release.set()
    busy.join(WAIT)
    reaper.join(WAIT)
    assert "error" not in busy_out and reaped.get("result") == [(TENANT, "s1")], reaped
    assert sorted(e.cache("a").seqs) == [] and sorted(e.cache("b").seqs) == [(TENANT, "other")]
    e.check_invariants()


def test_caches_in_parallel_keep_the_shared_disk_tier_exact(tmp_path):
    """Four caches on one LMDB store under a byte bound, each driven by its
    own thread (offloads, page-ins, frees, prefix spills at once): the shared
    books and every sequence's data come out exact."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb"), lmdb_max_bytes=1 << 20)
    names = [f"c{i}" for i in range(4)]
    for name in names:     # a model each: sequence keys on disk carry the fingerprint, not the cache name
        e.create_cache(dataclasses.replace(config("fp16", name=name, num_blocks=24, max_sequences=8),
                                           model_id=f"model-{name}"))
    errors = []

    def drive(name: str, seed: int) -> None:
        rng = random.Random(seed)
        live = {}
        try:
            for step in range(60):
                sid = f"s{step}"
                prompt = [rng.randrange(4) for _ in range(rng.choice([8, 16, 24]))]   # shared prefixes spill
                if len(live) < 6:
                    e.allocate(name, TENANT, sid, prompt)
                    k, v = kv(L, len(prompt), HKV, D, seed=seed * 1000 + step)
                    e.append(name, TENANT, [sid], k, v, [len(prompt)], token_ids=[prompt])
                    live[sid] = k
                victim = rng.choice(sorted(live))
                op = rng.random()
                if op < 0.4:
                    e.offload(name, TENANT, [victim])
                elif op < 0.7:
                    got, _ = e.retrieve(name, TENANT, victim, 0, live[victim].shape[1])
                    assert torch.equal(got, live[victim]), f"{name}/{victim} came back different"
                else:
                    e.free(name, TENANT, [victim])
                    del live[victim]
        except BaseException as x:  # noqa: BLE001 - reported by the test
            errors.append(f"{name}: {type(x).__name__}: {x}")

    threads = [threading.Thread(target=drive, args=(name, i)) for i, name in enumerate(names)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)      # switch threads often, inside the books' updates too
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    e.check_invariants()
    e.cold_store.books.check_invariants()


def test_the_shared_disk_tier_changes_its_books_for_one_cache_at_a_time(tmp_path, monkeypatch):
    """Caches share one DiskTier per store: while one cache's Offload is
    between the books' check and its write (held in _victims), another
    cache's Offload does not get there, and both end exact."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb"), lmdb_max_bytes=1 << 20)
    data = {}
    for i, name in enumerate(("a", "b")):
        e.create_cache(dataclasses.replace(config("fp16", name=name, num_blocks=24), model_id=f"model-{name}"))
        e.allocate(name, TENANT, "s", [])
        data[name] = kv(L, 16, HKV, D, seed=i)
        e.append(name, TENANT, ["s"], *data[name], [16])
    books = e.cold_store.books
    held, second = Held(books._victims), threading.Event()

    def victims(*a, **kw):
        if not held.armed:
            second.set()
        return held(*a, **kw)
    monkeypatch.setattr(books, "_victims", victims)
    first, first_out = in_thread(lambda: e.offload("a", TENANT, ["s"]))
    try:
        assert held.entered.wait(WAIT)
        other, other_out = in_thread(lambda: e.offload("b", TENANT, ["s"]))
        assert not second.wait(1.0), "two caches changed the disk tier's books at once"
    finally:
        held.release.set()
    first.join(WAIT)
    other.join(WAIT)
    assert "error" not in first_out and "error" not in other_out, (first_out, other_out)
    books.check_invariants()
    e.check_invariants()
    for name in ("a", "b"):
        assert e.sequence_info(name, TENANT, "s").tier == "disk"
        k, v = e.retrieve(name, TENANT, "s", 0, 16)
        assert torch.equal(k, data[name][0]) and torch.equal(v, data[name][1])


def test_a_heartbeat_counts_the_sessions_sequences_while_a_cache_is_busy(live, monkeypatch):
    """Every client heartbeats: a beat that queued behind a long request in one cache
    would hold a server thread for as long. It counts without waiting, and counts right."""
    (kv_a, kv_b, _), engine = live
    kv_b.allocate("b", "t", [5, 6])
    kv_b.allocate("a", "u", [5, 6], pinned=True)       # pinned: outlives the lease, not counted
    held = Held(engine.cache("a").retrieve)
    monkeypatch.setattr(engine.cache("a"), "retrieve", held)
    k, v = kv(L, 16, HKV, D)
    kv_a.append("a", ["s"], k, v)
    busy, busy_out = in_thread(lambda: kv_a.retrieve("a", "s", 0, 16))
    try:
        assert held.entered.wait(WAIT)
        th, out = in_thread(lambda: (kv_a.heartbeat().sequences, kv_b.heartbeat().sequences))
        th.join(WAIT)
        assert not th.is_alive(), "a Heartbeat waited for cache a's request"
        assert out.get("result") == (2, 1), out
        assert busy.is_alive()
    finally:
        held.release.set()
    busy.join(WAIT)
    assert "error" not in busy_out


def test_heartbeats_and_stats_go_on_while_a_new_cache_allocates_its_pools(live, monkeypatch):
    """A large pool takes seconds to allocate; the lock that keeps the pool budget is not
    the one that every Heartbeat, Stats and lease sweep takes."""
    (kv_a, kv_b, kv_c), engine = live
    held = Held(kvstore.engine.engine.Cache)
    monkeypatch.setattr(kvstore.engine.engine, "Cache", held)
    busy, busy_out = in_thread(lambda: kv_c.create_cache("c", "m", num_layers=L, num_q_heads=HQ,
                                                         num_kv_heads=HKV, head_dim=D, codec="fp16",
                                                         block_size=8, residual=8, num_blocks=64))
    try:
        assert held.entered.wait(WAIT)
        th, out = in_thread(lambda: (kv_a.heartbeat().sequences, sorted(c.cache for c in kv_b.stats().caches),
                                     kv_b.allocate("b", "t", [1, 2])))
        th.join(WAIT)
        assert not th.is_alive(), "a Heartbeat or Stats waited for a cache being created"
        assert out.get("result", (None,))[:2] == (2, ["a", "b"]), out
        assert busy.is_alive()
    finally:
        held.release.set()
    busy.join(WAIT)
    assert "error" not in busy_out, busy_out
    assert sorted(c.cache for c in kv_b.stats().caches) == ["a", "b", "c"]
