"""A call refused for GPU room moves nothing: the sequences it names that live below the
GPU, and the room its write takes, are counted together before any of them pages in
(Room.resident), so a refusal leaves every sequence in its tier and every counter as it
was, and a call that fits once others move down still goes through."""
import dataclasses

import pytest
import torch

from kvstore.engine.engine import Engine
from kvstore.errors import ResourceExhausted

from helpers import config, kv, one_thread  # noqa: F401

T = "default"
pytestmark = pytest.mark.usefixtures("one_thread")


def tiers(e, *sids):
    return {s: e.sequence_info("c", T, s).tier for s in sids}


def test_an_append_refused_for_room_leaves_its_sequence_in_the_host_tier():
    cfg = config("fp16", num_blocks=4)
    e = Engine()
    e.create_cache(dataclasses.replace(cfg, host_bytes=cfg.host_pair_bytes() * 4))
    k, v = kv(2, 32, 2, 16)
    e.allocate("c", T, "a", [])
    e.append("c", T, ["a"], k[:, :16], v[:, :16], [16])       # 2 blocks
    e.allocate("c", T, "b", [])
    e.append("c", T, ["b"], k, v, [32])                        # 4 blocks: a goes to the host tier
    e.free("c", T, ["b"])
    e.allocate("c", T, "x", [])
    e.append("c", T, ["x"], k[:, :8], v[:, :8], [8])
    e.append("c", T, ["x"], k[0, 8:9], v[0, 8:9], [1], layer=0)     # x mid-step: it cannot move down
    before = tiers(e, "a", "x"), e.stats()["c"]
    assert before[0] == {"a": "host", "x": "gpu"}
    k2, v2 = kv(2, 9, 2, 16, seed=1)
    # a's 2 blocks and the 2 its 9 tokens add, against 2 free with x unmovable.
    with pytest.raises(ResourceExhausted, match=r"^sequence_ids: no GPU room to page in sequence 'a' \(2 blocks\) "
                                                r"and write the call's tokens \(2 blocks\) in cache 'c'"):
        e.append("c", T, ["a"], k2, v2, [9])
    assert (tiers(e, "a", "x"), e.stats()["c"]) == before
    assert before[1]["tiers"]["page_ins_host"] == 0
    e.check_invariants()
    # x's step done, x can move down: the same append now goes through, x going to the host tier.
    e.append("c", T, ["x"], k[1, 8:9], v[1, 8:9], [1], layer=1)
    e.append("c", T, ["a"], k2, v2, [9])
    assert tiers(e, "a", "x") == {"a": "gpu", "x": "host"}
    got, _ = e.retrieve("c", T, "a", 0, 25)
    assert torch.equal(got[:, :16], k[:, :16]) and torch.equal(got[:, 16:], k2)
    e.check_invariants()


@pytest.fixture
def two_on_disk(tmp_path):
    """Sequences a (2 blocks) and b (3) on disk; x (4 blocks, mid-step) holds the GPU
    pool of 8 blocks, so a and b fit the pool together but not beside x."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config("fp16", num_blocks=8))
    k, v = kv(2, 25, 2, 16)
    for sid, n in (("a", 16), ("b", 24), ("x", 24)):
        e.allocate("c", T, sid, [])
        e.append("c", T, [sid], k[:, :n], v[:, :n], [n])
    e.offload("c", T, ["a", "b"])
    e.append("c", T, ["x"], k[0, 24:], v[0, 24:], [1], layer=0)
    return e, k, v


@pytest.mark.parametrize("call", ["attend", "reserve_batch", "append", "prefetch"])
def test_a_batch_whose_second_page_in_cannot_fit_pages_in_none(two_on_disk, call):
    e, k, v = two_on_disk
    before = tiers(e, "a", "b", "x"), e.stats()["c"]
    assert before[0] == {"a": "disk", "b": "disk", "x": "gpu"}
    run = {"attend": lambda: e.attend("c", T, 0, ["a", "b"], torch.randn(2, 4, 16).half()),
           "reserve_batch": lambda: e.reserve_batch("c", T, ["a", "b"], 1),
           "append": lambda: e.append("c", T, ["a", "b"], k[:, :2], v[:, :2], [1, 1]),
           "prefetch": lambda: e.prefetch("c", T, ["a", "b"])}[call]
    with pytest.raises(ResourceExhausted, match=r"^sequence_ids: no GPU room to page in sequences \['a', 'b'\] "
                                                r"\(5 blocks\)"):
        run()
    assert (tiers(e, "a", "b", "x"), e.stats()["c"]) == before
    assert before[1]["tiers"]["page_ins_disk"] == 0
    e.check_invariants()
    # One of them alone fits: paged in, the data whole.
    out = e.attend("c", T, 0, ["b"], torch.randn(1, 4, 16).half())
    assert out.shape == (1, 4, 16) and tiers(e, "a", "b") == {"a": "disk", "b": "gpu"}
    got, _ = e.retrieve("c", T, "b", 0, 24)
    assert torch.equal(got, k[:, :24])
    e.check_invariants()


def test_blocks_a_page_in_shares_with_a_gpu_sequence_are_not_counted_as_freed_by_moving_it(tmp_path):
    """b's blocks on disk are a's on the GPU (b is a's fork): paging b in takes a
    reference on them, so moving a down frees nothing for b's write."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config("fp16", num_blocks=8, residual=0))
    k, v = kv(2, 33, 2, 16)
    prompt = list(range(100, 132))
    e.allocate("c", T, "a", prompt)
    e.append("c", T, ["a"], k[:, :32], v[:, :32], [32], token_ids=[prompt])     # 4 hashed blocks
    e.fork("c", T, "a", "b")
    e.offload("c", T, ["b"])
    e.allocate("c", T, "x", [])
    e.append("c", T, ["x"], k[:, :24], v[:, :24], [24])
    e.append("c", T, ["x"], k[0, 24:25], v[0, 24:25], [1], layer=0)     # x mid-step: 4 blocks, unmovable
    before = tiers(e, "a", "b", "x"), e.stats()["c"]
    assert before[0] == {"a": "gpu", "b": "disk", "x": "gpu"} and before[1]["main"].free == 0
    with pytest.raises(ResourceExhausted, match=r"^sequence_ids: no GPU room to page in sequence 'b' \(1 blocks\) "
                                                r"and write the call's tokens \(1 blocks\)"):
        e.append("c", T, ["b"], k[:, 32:33], v[:, 32:33], [1])
    assert (tiers(e, "a", "b", "x"), e.stats()["c"]) == before
    e.check_invariants()
    e.append("c", T, ["x"], k[1, 24:25], v[1, 24:25], [1], layer=1)     # x's step done: x can move down
    e.append("c", T, ["b"], k[:, 32:33], v[:, 32:33], [1])
    got, _ = e.retrieve("c", T, "b", 0, 33)
    assert torch.equal(got, k) and tiers(e, "b")["b"] == "gpu"
    got, _ = e.retrieve("c", T, "a", 0, 32)
    assert torch.equal(got, k[:, :32])
    e.check_invariants()


def test_room_the_host_tier_cannot_take_moves_nothing_down():
    """No disk tier: making room for x's write would move a (it fits the host tier),
    then b (it does not). Neither moves, and the write is refused; a smaller write,
    for which a alone is enough, moves a."""
    cfg = config("fp16", num_blocks=8)
    e = Engine()
    e.create_cache(dataclasses.replace(cfg, host_bytes=cfg.host_pair_bytes() * 2))
    k, v = kv(2, 40, 2, 16)
    for sid, n in (("a", 8), ("b", 40), ("x", 0)):
        e.allocate("c", T, sid, [])
        if n:
            e.append("c", T, [sid], k[:, :n], v[:, :n], [n])
    before = tiers(e, "a", "b"), e.stats()["c"]
    assert before[0] == {"a": "gpu", "b": "gpu"} and before[1]["main"].free == 2
    with pytest.raises(ResourceExhausted, match=r"^k: no room in cache 'c' for what the call writes: need 4 blocks"):
        e.append("c", T, ["x"], k[:, :32], v[:, :32], [32])
    assert (tiers(e, "a", "b"), e.stats()["c"]) == before
    e.check_invariants()
    e.append("c", T, ["x"], k[:, :24], v[:, :24], [24])
    assert tiers(e, "a", "b", "x") == {"a": "host", "b": "gpu", "x": "gpu"}
    e.free("c", T, ["x"])
    got, _ = e.retrieve("c", T, "a", 0, 8)
    assert torch.equal(got, k[:, :8])
    e.check_invariants()


def test_a_block_an_earlier_page_in_of_the_call_brings_up_is_counted_once():
    """Codec fp16: A's full tail block is B's first sealed block (B forked A and sealed
    it). Paging A in brings that block up findable, and B's page-in shares it: the two
    take 3 blocks, which fit beside F2's 5, not 4."""
    cfg = config("fp16", residual=0, num_blocks=8)
    e = Engine()
    e.create_cache(dataclasses.replace(cfg, host_bytes=cfg.host_pair_bytes() * 32))
    k, v = kv(2, 64, 2, 16)
    e.allocate("c", T, "A", [])
    e.append("c", T, ["A"], k[:, :16], v[:, :16], [16], token_ids=[list(range(16))])
    e.fork("c", T, "A", "B")
    e.append("c", T, ["B"], k[:, 16:24], v[:, 16:24], [8], token_ids=[list(range(16, 24))])
    e.allocate("c", T, "F1", [])
    e.append("c", T, ["F1"], k, v, [64])            # every GPU block: A and B go to the host
    e.free("c", T, ["F1"])
    e.allocate("c", T, "F2", [])
    e.append("c", T, ["F2"], k[:, :32], v[:, :32], [32])
    e.reserve("c", T, "F2", 1)                      # F2 holds 5 blocks and cannot move
    assert tiers(e, "A", "B") == {"A": "host", "B": "host"} and e.stats()["c"]["main"].free == 3
    e.prefetch("c", T, ["A", "B"])
    assert tiers(e, "A", "B") == {"A": "gpu", "B": "gpu"}
    got, _ = e.retrieve("c", T, "B", 0, 24)
    assert torch.equal(got, k[:, :24])
    e.check_invariants()
