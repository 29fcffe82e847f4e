"""Sliding-window memory (engine/window.py): a cache whose every layer slides releases
the sealed blocks that left its window. Checked on CPU: the blocks held after each
step, the pool's books, attention bit-equal to the same cache that keeps every block,
a refused Retrieve of a freed range that changes nothing, tier round trips that keep
holes as holes, prefix hits through released blocks that stay cached, fork and free."""
import dataclasses

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import FailedPrecondition
from tests.engine.test_sinks import BS, D, HKV, HQ, L, M, R, T
from tests.engine.test_window_attention import lockstep, windowed
from tests.helpers import config, kv, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOWS = (13, 21)         # every layer slides: the cache's window is 21 (no multiple of the block)


def engine(codec: str, sinks: int = 0, windows=WINDOWS, keep: bool = False, lmdb: str | None = None,
           host_bytes: int = 0, num_blocks: int = 64) -> Engine:
    """keep: the same cache that releases nothing (its window taken away after creation),
    the baseline every output is compared with."""
    e = Engine(lmdb_path=lmdb)
    cfg = config(codec, block_size=BS, residual=R, sink_tokens=sinks, num_blocks=num_blocks)
    e.create_cache(dataclasses.replace(cfg, layer_windows=windows, host_bytes=host_bytes))
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, M, 256, D // M, generator=g),
                                       v=torch.randn(L, HKV, M, 256, D // M, generator=g)))
    if keep:
        e.cache("c").window = 0
    return e


def out_of_window(n: int, sinks: int = 0, window: int = max(WINDOWS)) -> int:
    """Sealed blocks wholly before the window of a sequence of n committed tokens."""
    return max(0, (n - window - sinks) // BS)


def held_main(e: Engine) -> int:
    return e.stats()["c"]["main"].used


CASES = [("fp16", 0), ("pq", 0), ("pq", 16)]


@pytest.mark.parametrize("codec,sinks", CASES)
def test_releases_what_left_the_window_and_attention_is_unchanged(codec, sinks):
    """A prefill, then decode steps of a batch of two (per-layer appends, one token each):
    after every step the freeing cache holds only blocks some window can still read,
    and its outputs equal the keeping cache's and the positional fp64 reference."""
    free, keep = engine(codec, sinks), engine(codec, sinks, keep=True)
    n0, steps = 70, 12
    k, v = kv(L, n0 + steps, HKV, D, seed=1)
    k2, v2 = kv(L, n0 + steps, HKV, D, seed=2)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3)).half()
    for e in (free, keep):
        e.allocate("c", T, "a", [])
        e.allocate("c", T, "b", [])
        e.append("c", T, ["a", "b"], torch.cat([k[:, :n0], k2[:, :40]], 1), torch.cat([v[:, :n0], v2[:, :40]], 1),
                 [n0, 40])
    c = free.cache("c")
    for t in range(steps):
        for layer in range(L):
            new_k = torch.stack([k[layer, n0 + t], k2[layer, 40 + t]])
            new_v = torch.stack([v[layer, n0 + t], v2[layer, 40 + t]])
            outs = [e.append_attend("c", T, layer, ["a", "b"], new_k, new_v, q) for e in (free, keep)]
            assert torch.equal(outs[0], outs[1]), (t, layer)
            if codec == "fp16":
                n = n0 + t + 1
                want = windowed(q[0], k[layer, :n], v[layer, :n], WINDOWS[layer], 0.0)
                assert torch.allclose(outs[0][0].double(), want, rtol=1e-3, atol=1e-3)
        for sid, n in (("a", n0 + t + 1), ("b", 40 + t + 1)):
            assert c.seq(T, sid).freed == out_of_window(n, sinks), (sid, n)
        free.check_invariants()
        keep.check_invariants()
    gone = out_of_window(n0 + steps, sinks) + out_of_window(40 + steps, sinks)
    assert gone > 0
    assert held_main(free) == held_main(keep) - gone
    assert free.stats()["c"]["window_freed_blocks"] == gone
    info = free.sequence_info("c", T, "a")
    assert info.window_freed_blocks == out_of_window(n0 + steps, sinks)
    assert info.sealed_block_refs[:info.window_freed_blocks] == [0] * info.window_freed_blocks


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_stats_count_the_blocks_sequences_hold_not_the_holes_block(codec):
    """The block holes point at is the cache's own: Stats leaves it out of the main pool
    (capacity = used + cached + free, used = what sequences hold, as DeleteCache counts)."""
    e = engine(codec)
    main = e.stats()["c"]["main"]
    assert (main.capacity, main.used) == (64 - 1, 0) and main.used + main.cached + main.free == main.capacity
    assert e.stats()["c"]["main_used_bytes"] == 0 and e.stats()["c"]["used_bytes"] == 0
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], *kv(L, 90, HKV, D), [90])
    info = e.sequence_info("c", T, "a")
    held = len(info.sealed_blocks) - info.window_freed_blocks + (len(info.tail_blocks) if codec == "fp16" else 0)
    main = e.stats()["c"]["main"]
    assert info.window_freed_blocks > 0 and main.used == held
    assert main.used + main.cached + main.free == main.capacity
    assert e.stats()["c"]["main_used_bytes"] == held * e.cache("c").cfg.bytes_per_block()
    assert e.delete_cache("c").main_blocks == held


def test_a_mixed_cache_releases_nothing():
    """One global layer reads every token: a block (one id for every layer) stays."""
    e = engine("fp16", windows=(13, 0))
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], *kv(L, 90, HKV, D), [90])
    assert e.cache("c").null_block is None and e.cache("c").seq(T, "a").freed == 0
    assert held_main(e) == -(-90 // BS)
    e.check_invariants()


def test_a_sequence_may_outgrow_the_pool():
    """Held tokens, not the length, must fit: 40 blocks' worth of tokens through a pool of 12."""
    e = engine("fp16", num_blocks=12)
    e.allocate("c", T, "a", [])
    for i in range(20):
        e.append("c", T, ["a"], *kv(L, 16, HKV, D, seed=i), [16])
    assert e.length("c", T, "a") == 320 and held_main(e) <= 12
    e.check_invariants()


@pytest.mark.parametrize("codec,sinks", CASES)
def test_retrieve_of_a_freed_range_is_refused_and_changes_nothing(codec, sinks):
    e = engine(codec, sinks, lmdb=None, host_bytes=1 << 20)
    k, v = kv(L, 90, HKV, D, seed=4)
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], k, v, [90])
    c = e.cache("c")
    c.tiering.to_host(c.seq(T, "a"))           # a refusal must not page it in either
    before = (e.sequence_info("c", T, "a"), e.stats()["c"]["main"], e.stats()["c"]["tiers"]["page_ins_host"])
    first = sinks + out_of_window(90, sinks) * BS
    for start, end in ((sinks, 90), (first - 1, first + 1), (0, 90)):
        with pytest.raises(FailedPrecondition) as err:
            e.retrieve("c", T, "a", start, end)
        assert err.value.field == "start" and "sliding window" in str(err.value)
    assert (e.sequence_info("c", T, "a"), e.stats()["c"]["main"], e.stats()["c"]["tiers"]["page_ins_host"]) == before
    got = e.retrieve("c", T, "a", first, 90)                   # the window's blocks read back
    if codec == "fp16":
        assert torch.equal(got[0], k[:, first:]) and torch.equal(got[1], v[:, first:])
    if sinks:                                                  # the sinks are held for good
        assert torch.equal(e.retrieve("c", T, "a", 0, sinks)[0], k[:, :sinks])
    e.check_invariants()


@pytest.mark.parametrize("codec,sinks", CASES)
@pytest.mark.parametrize("via", ["host", "disk", "restart"])
def test_tier_round_trip_keeps_holes(tmp_path, codec, sinks, via):
    lmdb = str(tmp_path / "lmdb")
    e = engine(codec, sinks, lmdb=lmdb, host_bytes=1 << 20 if via == "host" else 0)
    prompt = list(range(300, 390))
    e.allocate("c", T, "a", prompt)
    e.append("c", T, ["a"], *kv(L, 90, HKV, D, seed=5), [90], token_ids=[prompt])
    c = e.cache("c")
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(6)).half()
    outs = [e.attend("c", T, layer, ["a"], q) for layer in range(L)]
    first = sinks + out_of_window(90, sinks) * BS
    want = e.retrieve("c", T, "a", first, 90)
    info = e.sequence_info("c", T, "a")
    if via == "host":
        c.tiering.to_host(c.seq(T, "a"))
        assert e.stats()["c"]["tiers"]["host_main"].used == len(info.sealed_blocks) - info.window_freed_blocks
    else:
        e.offload("c", T, ["a"])
    assert held_main(e) == 0                                    # the null block is the cache's: not counted
    e.check_invariants()
    if via == "restart":
        e.cold_store.close()
        e = engine(codec, sinks, lmdb=lmdb)
    e.prefetch("c", T, ["a"])
    back = e.sequence_info("c", T, "a")
    assert back.tier == "gpu" and back.window_freed_blocks == info.window_freed_blocks
    assert len(back.sealed_blocks) == len(info.sealed_blocks)
    for layer in range(L):
        assert torch.equal(e.attend("c", T, layer, ["a"], q), outs[layer]), layer
    got = e.retrieve("c", T, "a", first, 90)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(FailedPrecondition):
        e.retrieve("c", T, "a", 0, 90)
    e.append("c", T, ["a"], *kv(L, 20, HKV, D, seed=7), [20])      # decode goes on, releasing more
    assert e.sequence_info("c", T, "a").window_freed_blocks == out_of_window(110, sinks)
    e.check_invariants()


@pytest.mark.parametrize("codec,sinks", CASES)
def test_prefix_hit_through_released_blocks(codec, sinks):
    """Released blocks keep their hash: a second sequence with the same prompt hits them
    (cached, not used), takes back only what its own window reads, and attends as the first."""
    e = engine(codec, sinks)
    prompt = list(range(500, 600))
    k, v = kv(L, 100, HKV, D, seed=8)
    e.allocate("c", T, "a", prompt)
    e.append("c", T, ["a"], k, v, [100], token_ids=[prompt])
    assert e.stats()["c"]["main"].cached >= out_of_window(100, sinks)
    hit = e.allocate("c", T, "b", prompt).cached_tokens
    assert hit == 96                                            # every full block but the last one
    assert e.cache("c").seq(T, "b").freed == out_of_window(96, sinks)
    e.check_invariants()
    e.append("c", T, ["b"], k[:, 96:], v[:, 96:], [4], token_ids=[prompt[96:]])
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(9)).half()
    for layer in range(L):
        assert torch.equal(e.attend("c", T, layer, ["a"], q), e.attend("c", T, layer, ["b"], q))
    e.fork("c", T, "b", "f")
    e.check_invariants()
    e.free("c", T, ["a", "b", "f"])
    assert held_main(e) == 0 and e.stats()["c"]["main_used_bytes"] == 0     # the null block is no sequence's
    e.check_invariants()


def test_reserve_commits_release_and_renew_the_table_epoch():
    """Reserve's commit releases too; the table changed before its end, so a caller's
    known prefix no longer holds (the whole table comes back)."""
    e = engine("fp16")
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], *kv(L, 40, HKV, D, seed=10), [40])
    r = e.reserve("c", T, "a", 8)
    for _ in range(3):
        known = (len(r.sealed_blocks) + r.sealed_start, r.table_epoch)
        r = e.reserve("c", T, "a", 8, known)
    assert e.cache("c").seq(T, "a").freed == out_of_window(64)
    assert r.sealed_start == 0 and r.sealed_blocks[:5] == [e.cache("c").null_block] * out_of_window(64)
    e.check_invariants()


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("codec,sinks", [("fp16", 0), ("pq", 16)])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_holes_are_never_read(codec, sinks, graphs):
    """On CUDA (Triton windowed plans; decode graphs replaying tables whose entries turn
    into the null block as the window moves): decode steps of a freeing cache equal the
    keeping cache's, and the CPU engine's over the same tokens. The null block is filled
    with NaN: a kernel that read a hole would show it."""
    d, hq, hkv = 64, 4, 2

    def make(device, keep):
        e = Engine(device)
        cfg = dataclasses.replace(config(codec, block_size=16, residual=16, sink_tokens=sinks, num_blocks=128,
                                         num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                                  layer_windows=(40, 50), device=device)
        e.create_cache(cfg)
        if codec == "pq":
            g = torch.Generator().manual_seed(0)
            e.set_codebooks("c", Codebooks(k=torch.randn(L, hkv, d // 2, 256, 2, generator=g),
                                           v=torch.randn(L, hkv, d // 2, 256, 2, generator=g)))
        c = e.cache("c")
        c.graphs.enabled = graphs
        if keep:
            c.window = 0
        elif codec == "fp16":
            c.main.k[:, c.null_block] = float("nan")
        else:
            c.main.k_codes[:, c.null_block] = 255
        return e
    engines = [make("cuda", False), make("cuda", True), make("cpu", False)]
    lens, steps = (100, 60), 40
    k, v = kv(L, max(lens) + steps, hkv, d, seed=11)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(12)).half()
    for t, layer, outs in lockstep(engines, k, v, lens, steps, q):
        assert torch.isfinite(outs[0]).all()
        assert torch.allclose(outs[0], outs[1], atol=2e-3, rtol=2e-3), (t, layer)
        # the CPU engine computes in fp32; the CUDA build rounds P and the codebooks to fp16:
        # with these random (peaky) codebooks its error reaches 4e-3 of the output
        err = ((outs[0] - outs[2]).norm() / outs[2].norm()).item()
        assert err < 1e-2, (t, layer, err)
    assert engines[0].cache("c").seq(T, "a").freed > 0
    for e in engines:
        e.check_invariants()
