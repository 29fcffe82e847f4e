"""Host and LMDB tiers: bit-exact round trips, pressure, restarts, crashes (CPU, real LMDB)."""
import logging
import math
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import ResourceExhausted
from kvstore.kernels import reference as ref
from tests.helpers import config

T = "default"
HKV, D, L = 2, 16, 2


def make_engine(tmp_path, codec="pq", num_blocks=64, host_bytes=0, lmdb=True, share=False, **kw):
    e = Engine(lmdb_path=str(tmp_path / "lmdb") if lmdb else None)
    cfg = config(codec=codec, num_blocks=num_blocks, **kw)
    cfg = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "host_bytes": host_bytes,
                       "share_prefixes_across_tenants": share})
    e.create_cache(cfg)
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, 8, 256, 2, generator=g),
                                       v=torch.randn(L, HKV, 8, 256, 2, generator=g)))
    return e


def fill(e, sid, n, seed, prompt=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, n, HKV, D, generator=g).half()
    v = torch.randn(L, n, HKV, D, generator=g).half()
    e.allocate("c", T, sid, prompt or [])
    e.append("c", T, [sid], k, v, [n], token_ids=[prompt] if prompt else None)
    return k, v


def snapshot(e, sid):
    info = e.sequence_info("c", T, sid)
    k, v = e.retrieve("c", T, sid, 0, info.length)
    return k.clone(), v.clone()


@pytest.mark.parametrize("codec", ["pq", "fp16"])
@pytest.mark.parametrize("via", ["host", "disk"])
def test_offload_page_in_is_bit_exact(tmp_path, codec, via):
    # block_size 16 != M 8: K and V code blocks have different shapes
    e = make_engine(tmp_path, codec, host_bytes=1 << 20 if via == "host" else 0, block_size=16)
    fill(e, "a", 77, 1)
    fill(e, "b", 40, 2)
    q = torch.randn(2, 4, D).half()
    before = snapshot(e, "a")
    out_before = e.attend("c", T, 1, ["a", "b"], q)
    cache = e.cache("c")
    if via == "host":
        cache.tiering.to_host(cache.seq(T, "a"))
    else:
        e.offload("c", T, ["a"])
    assert e.sequence_info("c", T, "a").tier == via
    e.check_invariants()
    assert e.stats()["c"]["main"].used < 77 // 8 + 40 // 8 + 4
    e.prefetch("c", T, ["a"])
    assert e.sequence_info("c", T, "a").tier == "gpu"
    after = snapshot(e, "a")
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert torch.equal(e.attend("c", T, 1, ["a", "b"], q), out_before)
    # decode continues on the paged-in sequence
    e.append("c", T, ["a"], torch.randn(L, 5, HKV, D).half(), torch.randn(L, 5, HKV, D).half(), [5])
    assert e.sequence_info("c", T, "a").length == 82
    e.check_invariants()


def test_bytes_moved_are_counted_per_tier(tmp_path):
    from kvstore.service.metrics import Metrics
    e = make_engine(tmp_path, host_bytes=1 << 20, block_size=16)
    fill(e, "a", 77, 1)
    cache = e.cache("c")
    s = cache.seq(T, "a")
    main, tail = cache.main_io.block_bytes(), cache.tail_io.block_bytes()
    size = len(s.sealed) * main + len(s.tail) * tail
    cache.tiering.to_host(s)
    e.prefetch("c", T, ["a"])            # host -> GPU
    e.offload("c", T, ["a"])             # GPU -> disk
    e.prefetch("c", T, ["a"])            # disk -> GPU
    t = e.stats()["c"]["tiers"]
    assert (t["bytes_down_host"], t["bytes_up_host"], t["bytes_down_disk"], t["bytes_up_disk"]) == (size,) * 4
    assert t["bytes_down"] == 2 * size and t["bytes_up"] == 2 * size
    m = Metrics()
    m.bind(engine=e)
    out = m.render()
    for way in ("down", "up"):
        for tier in ("host", "disk"):
            assert f'kvstore_tier_bytes_{way}_total{{cache="c",tier="{tier}"}} {float(size)}' in out


@pytest.mark.parametrize("codec", ["pq", "fp16"])
def test_pressure_serves_four_times_the_pool(tmp_path, codec):
    # 16 GPU blocks; 8 sequences of 64 tokens need 8 blocks each = 64 blocks = 4N.
    e = make_engine(tmp_path, codec, num_blocks=16, host_bytes=20 * 2048, residual=0, max_sequences=8)
    shadow = {}
    for i in range(8):
        shadow[f"s{i}"] = fill(e, f"s{i}", 64, i)
        e.check_invariants()
    st = e.stats()["c"]
    assert st["tiers"]["offloads_host"] + st["tiers"]["offloads_disk"] >= 6
    assert st["tiers"]["offloads_disk"] >= 1          # the host tier overflowed to LMDB
    rng = random.Random(0)
    for step in range(24):                            # random access pages sequences back in
        sid = f"s{rng.randrange(8)}"
        q = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(step)).half()
        out = e.attend("c", T, 0, [sid], q)
        k, v = e.retrieve("c", T, sid, 0, 64, 0, 1)
        want, _ = ref.attention_dense(q[0].double(), k[0].double(), v[0].double(), 1 / math.sqrt(D))
        assert (out[0].double() - want).abs().max() < 1e-3
        if codec == "fp16":                           # exact data after any number of moves
            assert torch.equal(k[0], shadow[sid][0][0]) and torch.equal(v[0], shadow[sid][1][0])
        e.check_invariants()
    st = e.stats()["c"]["tiers"]
    assert st["page_ins_host"] + st["page_ins_disk"] >= 10
    e.free("c", T, [f"s{i}" for i in range(8)])
    e.check_invariants()
    assert e.stats()["c"]["main"].used == 0


def test_prefix_blocks_spill_and_hit_from_lower_tiers(tmp_path):
    e = make_engine(tmp_path, "pq", num_blocks=12, host_bytes=4 * 2048, residual=0, max_sequences=4)
    prompt = list(range(64))
    k, v = fill(e, "a", 64, 1, prompt)
    want = snapshot(e, "a")
    e.free("c", T, ["a"])
    for i in range(3):                                # churn: the cached prefix blocks are reused
        fill(e, f"x{i}", 64, 10 + i)
        e.free("c", T, [f"x{i}"])
    assert e.stats()["c"]["tiers"]["spilled_blocks"] > 0
    assert e.allocate("c", T, "b", prompt).cached_tokens == 56     # all but the last block: logits
    e.append("c", T, ["b"], k[:, 56:], v[:, 56:], [8], token_ids=[prompt[56:]])
    got = snapshot(e, "b")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    st = e.stats()["c"]["tiers"]
    assert st["prefix_hits_host"] + st["prefix_hits_disk"] >= 1


def test_a_spill_larger_than_the_host_tiers_room_fills_it_and_the_rest_goes_to_disk(tmp_path):
    """One allocate evicts more cached GPU blocks than the host tier has room for:
    the newest fill the host tier and the older ones go to disk (none is dropped,
    and the host tier is not skipped), and the prompt hits them from both."""
    e = make_engine(tmp_path, "pq", num_blocks=8, host_bytes=4 * 2048, residual=0, max_sequences=4)
    c = e.cache("c")
    room = c.tiering.host.main_pool.num_allocatable()
    prompt = list(range(64))
    k, v = fill(e, "a", 64, 1, prompt)
    want = snapshot(e, "a")
    e.free("c", T, ["a"])
    fill(e, "x", 64, 10)                              # its one allocate evicts every cached block of "a"
    e.free("c", T, ["x"])
    st = e.stats()["c"]["tiers"]
    spilled = st["spilled_blocks"]
    assert spilled > room == 3
    assert st["host_main"].cached == room and st["disk"]["entries"] == spilled - room
    assert st["bytes_down_host"] == room * c.main_io.block_bytes()
    assert e.allocate("c", T, "b", prompt).cached_tokens == 56
    st = e.stats()["c"]["tiers"]
    assert (st["prefix_hits_host"], st["prefix_hits_disk"]) == (room, spilled - room)
    e.append("c", T, ["b"], k[:, 56:], v[:, 56:], [8], token_ids=[prompt[56:]])
    got = snapshot(e, "b")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    e.check_invariants()


def test_no_room_to_page_in_names_the_requests_own_field(tmp_path):
    """A host-tier sequence with no GPU room to page it into (the other one is mid
    step, so it cannot move down): RESOURCE_EXHAUSTED names the field of the
    request that asked (Retrieve and Fork take sequence_id, Prefetch sequence_ids)
    and nothing moves."""
    e = make_engine(tmp_path, "pq", num_blocks=4, host_bytes=20 * 2048, residual=0, max_sequences=3, lmdb=False)
    for sid, seed in (("a", 1), ("b", 2)):
        fill(e, sid, 28, seed)
    assert e.sequence_info("c", T, "a").tier == "host"
    g = torch.Generator().manual_seed(3)
    e.append_attend("c", T, 0, ["b"], torch.randn(1, HKV, D, generator=g).half(), torch.randn(1, HKV, D, generator=g).half(),
                    torch.randn(1, 4, D, generator=g).half())      # b mid-step: layer 0 of a token appended
    for call, field in ((lambda: e.retrieve("c", T, "a", 0, 0), "sequence_id"),
                        (lambda: e.fork("c", T, "a", "a2"), "sequence_id"),
                        (lambda: e.prefetch("c", T, ["a"]), "sequence_ids")):
        with pytest.raises(ResourceExhausted, match=f"^{field}: no GPU room to page in sequence 'a'"):
            call()
        assert e.sequence_info("c", T, "a").tier == "host" and [s.seq_id for s in e.list_sequences("c", T)] == ["a", "b"]
    e.check_invariants()


def test_no_room_to_page_in_because_the_disk_is_full_says_so(tmp_path, monkeypatch):
    """A disk sequence to page in, whose room needs the other sequence moved down, on a
    full filesystem: RESOURCE_EXHAUSTED says why nothing could move (the disk's refusal),
    not only that there was no GPU room; nothing moves."""
    import errno

    from kvstore.tiers.lmdb_file import DataFile
    e = make_engine(tmp_path, "pq", num_blocks=4, residual=0, max_sequences=3)
    fill(e, "a", 28, 1)
    e.offload("c", T, ["a"])
    fill(e, "b", 28, 2)

    def full(self, fn, nbytes, touch):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(DataFile, "write", full)
    with pytest.raises(ResourceExhausted, match=r"^sequence_ids: no GPU room to page in sequence 'a'.*"
                                                r"filesystem is full .*No space left on device"):
        e.prefetch("c", T, ["a"])
    assert {i.seq_id: i.tier for i in e.list_sequences("c", T)} == {"a": "disk", "b": "gpu"}
    e.check_invariants()


@pytest.mark.parametrize("codec, never, after_moving", [("pq", [72, 64], [64, 56]), ("fp16", [56, 48], [48, 40])])
def test_a_batch_that_can_never_fit_moves_nothing_down(tmp_path, codec, never, after_moving):
    """A batch Append larger than the pool could hold with every other sequence moved
    out is refused before anything moves: a refused call changes nothing. One that
    fits once they move still moves them."""
    e = make_engine(tmp_path, codec, num_blocks=12, residual=8, max_sequences=4)
    fill(e, "t", 40, 1)          # 3 of the 12 main-pool blocks (pq: sealed), 5 (fp16)
    moved = dict(e.stats("c")["c"]["tiers"])
    for sid in ("f1", "f2"):
        e.allocate("c", T, sid, [])
    k = torch.randn(L, sum(never), HKV, D).half()      # 13 main-pool blocks of 12
    with pytest.raises(ResourceExhausted, match="^k: no room in cache .c. for what the call writes: need 13 blocks"):
        e.append("c", T, ["f1", "f2"], k, k, never)
    assert e.sequence_info("c", T, "t").tier == "gpu"
    assert [e.sequence_info("c", T, s).length for s in ("t", "f1", "f2")] == [40, 0, 0]
    assert dict(e.stats("c")["c"]["tiers"]) == moved
    k = torch.randn(L, sum(after_moving), HKV, D).half()
    e.append("c", T, ["f1", "f2"], k, k, after_moving)
    assert e.sequence_info("c", T, "t").tier == "disk"
    e.check_invariants()


# ------------------------------------------------------------ restarts, crashes

WRITER = r"""
import sys, torch
from kvstore.client import KVStoreClient
target, n_seqs, n_tok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kv = KVStoreClient(target)
print("ready", flush=True)
for i in range(n_seqs):
    sid = f"s{i}"
    g = torch.Generator().manual_seed(i)
    prompt = [i * 100000 + t for t in range(n_tok)]
    cached = kv.allocate("c", sid, prompt)      # an earlier trial's blocks, on disk: a prefix hit
    k = torch.randn(2, n_tok, 2, 16, generator=g).half()[:, cached:]
    kv.append("c", [sid], k, -k, token_ids=[prompt[cached:]])
    kv.offload("c", [sid])
    print("offloaded", sid, flush=True)
"""


def start(sock, lmdb):
    from tests.service.test_daemon_process import start_daemon
    return start_daemon(sock, extra=["--lmdb", lmdb])


def create(kv):
    kv.create_cache("c", "m", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, codec="fp16",
                    block_size=16, residual=16, num_blocks=4096, max_sequences=64, exist_ok=True)


def test_restart_resumes_offloaded_sequences_and_prefix_hits_from_disk(tmp_path):
    from kvstore.client import KVStoreClient
    from tests.service.test_daemon_process import stop_daemon
    sock, lmdb = str(tmp_path / "kv.sock"), str(tmp_path / "lmdb")
    p, target = start(sock, lmdb)
    try:
        kv = KVStoreClient(target)
        create(kv)
        subprocess.run([sys.executable, "-c", WRITER, target, "2", "200"], check=True, capture_output=True)
        want = {s: kv.retrieve("c", s, 0, 200) for s in ("s0", "s1")}   # pages back in ...
        kv.offload("c", ["s0", "s1"])                                   # ... and down again
        kv.close()
    finally:
        stop_daemon(p)
    p, target = start(sock, lmdb)
    try:
        kv = KVStoreClient(target)
        create(kv)                                   # same spec -> same fingerprint -> found again
        assert {i.sequence_id: i.tier for i in kv.list_sequences("c")} == {"s0": "disk", "s1": "disk"}
        for s in ("s0", "s1"):
            k, v = kv.retrieve("c", s, 0, 200)
            assert torch.equal(k, want[s][0]) and torch.equal(v, want[s][1])
        kv.free("c", ["s0"])
        # A new sequence with s1's prompt: s1 paged in, so its full blocks are hits.
        prompt = [100000 + t for t in range(200)]
        assert kv.allocate("c", "new", prompt) == 192
        kv.free("c", ["s1", "new"])
        st = kv.stats("c").caches[0]
        assert st.sequences == 0 and st.main.used == 0
        kv.close()
    finally:
        stop_daemon(p)


@pytest.mark.parametrize("spec", [{"residual": 16}, {"share": True}])
def test_restart_lists_a_disk_sequence_only_in_a_cache_of_its_spec(tmp_path, caplog, spec):
    """A restarted daemon's cache of the same name and fingerprint but another
    residual (its blocks would lie otherwise) or prefix sharing (its hashes are
    its tenant's; a shared cache would open them to every tenant) does not take
    the offloaded sequences: they stay on disk, named in a warning, and a cache
    created with their spec lists them again, bit for bit."""
    e = make_engine(tmp_path, "pq", residual=8)
    fill(e, "a", 61, 1, list(range(61)))
    want = snapshot(e, "a")
    e.offload("c", T, ["a"])
    e.cold_store.close()
    caplog.set_level(logging.WARNING, logger="kvstore.tiers")
    e = make_engine(tmp_path, "pq", **{"residual": 8, **spec})
    assert e.list_sequences("c", T) == []
    field = "share_prefixes_across_tenants" if "share" in spec else "residual"
    assert f"1 sequences on disk ('a') were written by a cache with {field}=" in caplog.text
    e.check_invariants()
    e.cold_store.close()
    e = make_engine(tmp_path, "pq", residual=8)
    assert [(s.seq_id, s.tier) for s in e.list_sequences("c", T)] == [("a", "disk")]
    got = snapshot(e, "a")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    e.check_invariants()


@pytest.mark.parametrize("change", ["block_size", "codebooks", "codec"])
def test_restart_into_another_fingerprint_names_the_field_its_disk_sequences_differ_in(tmp_path, caplog, change):
    """A restarted daemon's cache of the same name with another block size, codebooks
    or codec (another fingerprint: its blocks hash otherwise) lists none of the offloaded
    sequences: a WARNING names them and the field, once, where they were unlisted in
    silence; a cache created as theirs was lists them again."""
    e = make_engine(tmp_path, "pq", block_size=8, residual=8)
    fill(e, "a", 61, 1, list(range(61)))
    e.offload("c", T, ["a"])
    e.cold_store.close()
    caplog.set_level(logging.WARNING, logger="kvstore.tiers")
    if change == "codebooks":
        e = Engine(lmdb_path=str(tmp_path / "lmdb"))
        e.create_cache(config(codec="pq", block_size=8, residual=8))
        g = torch.Generator().manual_seed(1)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, 8, 256, 2, generator=g),
                                       v=torch.randn(L, HKV, 8, 256, 2, generator=g)))
    else:
        e = make_engine(tmp_path, "fp16" if change == "codec" else "pq", block_size=16 if change == "block_size" else 8,
                        residual=16 if change == "block_size" else 8)
    assert e.list_sequences("c", T) == []
    field = {"block_size": "block_size=8, this one has 16", "codec": "codec='pq', this one has 'fp16'",
             "codebooks": "codebooks_sha256="}[change]
    lines = [r.getMessage() for r in caplog.records if "sequences on disk" in r.getMessage()]
    assert len(lines) == 1 and f"1 sequences on disk ('a') were written by a cache with {field}" in lines[0], lines
    e.check_invariants()
    e.cold_store.close()
    e = make_engine(tmp_path, "pq", block_size=8, residual=8)
    assert [(s.seq_id, s.tier) for s in e.list_sequences("c", T)] == [("a", "disk")]
    e.cold_store.close()


def test_prefix_hit_from_disk_after_restart(tmp_path):
    from kvstore.client import KVStoreClient
    from tests.service.test_daemon_process import stop_daemon
    sock, lmdb = str(tmp_path / "kv.sock"), str(tmp_path / "lmdb")
    p, target = start(sock, lmdb)
    try:
        kv = KVStoreClient(target)
        create(kv)
        subprocess.run([sys.executable, "-c", WRITER, target, "1", "200"], check=True, capture_output=True)
        kv.close()
    finally:
        stop_daemon(p)
    p, target = start(sock, lmdb)
    try:
        kv = KVStoreClient(target)
        create(kv)
        kv.free("c", ["s0"])                      # the sequence goes; its hashed blocks stay on disk
        prompt = list(range(200))
        assert kv.allocate("c", "new", prompt) == 192
        st = kv.stats("c").caches[0]
        assert st.prefix_hit_blocks_disk == 12
        kv.close()
    finally:
        stop_daemon(p)


def test_kill_9_during_offload_never_tears_a_sequence(tmp_path):
    from kvstore.client import KVStoreClient
    from tests.service.test_daemon_process import stop_daemon
    sock, lmdb = str(tmp_path / "kv.sock"), str(tmp_path / "lmdb")
    rng = random.Random(1)
    n_tok = 2000
    seen_whole = 0
    for trial in range(10):        # two daemon starts a trial: ~10 s on a 2-core box
        p, target = start(sock, lmdb)
        kv = KVStoreClient(target)
        create(kv)
        for s in [i.sequence_id for i in kv.list_sequences("c")]:
            kv.free("c", [s])                     # start each trial empty
        w = subprocess.Popen([sys.executable, "-c", WRITER, target, "4", str(n_tok)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The kill comes at a random moment of the writer's calls, not of its start-up (which
        # a loaded box stretches past any fixed delay); the first trial waits for an offload.
        assert w.stdout.readline().strip() == "ready", "the writer did not start"
        if trial == 0:
            line = w.stdout.readline()
            assert line.startswith("offloaded"), "the writer offloaded nothing: " + w.stderr.read()[-2000:]
        time.sleep(rng.uniform(0.0, 2.5) if trial else rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        p.wait()
        w.kill()
        w.wait()
        kv.close()
        p, target = start(sock, lmdb)
        try:
            kv = KVStoreClient(target)
            create(kv)
            for info in kv.list_sequences("c"):
                assert info.tier == "disk" and info.length == n_tok
                i = int(info.sequence_id[1:])
                k, v = kv.retrieve("c", info.sequence_id, 0, n_tok)
                g = torch.Generator().manual_seed(i)
                want = torch.randn(2, n_tok, 2, 16, generator=g).half()
                assert torch.equal(k, want) and torch.equal(v, -want)
                seen_whole += 1
            kv.close()
        finally:
            stop_daemon(p)
    assert seen_whole > 0, "no trial found a durable sequence, not even the one that waited for it"
