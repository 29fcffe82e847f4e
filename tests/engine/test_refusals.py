"""A refused call moves nothing: checks that need no data run before the
sequences a call names are paged back in from a lower tier."""
import pytest
import torch

from kvstore.engine.engine import Engine
from kvstore.errors import FailedPrecondition, InvalidArgument

from helpers import config, kv

TENANT = "default"


def test_a_refused_attend_pages_nothing_in(tmp_path):
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config("fp16", num_blocks=16))
    for sid in ("full", "empty"):
        e.allocate("c", TENANT, sid, [])
    k, v = kv(2, 40, 2, 16)
    e.append("c", TENANT, ["full"], k, v, [40])
    e.offload("c", TENANT, ["full", "empty"])
    before = e.stats()["c"], e.sequence_info("c", TENANT, "full")
    with pytest.raises(InvalidArgument, match="^sequence_ids: .* no tokens at layer 0"):
        e.attend("c", TENANT, 0, ["full", "empty"], torch.randn(2, 4, 16).half())
    assert (e.stats()["c"], e.sequence_info("c", TENANT, "full")) == before
    assert before[1].tier == "disk" and e.stats()["c"]["tiers"]["page_ins_disk"] == 0
    out = e.attend("c", TENANT, 0, ["full"], torch.randn(1, 4, 16).half())     # the data is all there
    assert out.shape == (1, 4, 16) and e.sequence_info("c", TENANT, "full").tier == "gpu"


def test_a_refused_append_pages_nothing_in(tmp_path):
    """Ids that contradict the ones Allocate gave are refused before the
    sequence leaves the disk."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config("fp16", num_blocks=16))
    prompt = list(range(100, 141))                  # 41 ids, 40 tokens written: position 40's id is known
    e.allocate("c", TENANT, "s", prompt)
    k, v = kv(2, 41, 2, 16)
    e.append("c", TENANT, ["s"], k[:, :40], v[:, :40], [40])
    e.offload("c", TENANT, ["s"])
    before = e.stats()["c"], e.sequence_info("c", TENANT, "s")
    with pytest.raises(InvalidArgument, match="^token_ids: differ"):
        e.append("c", TENANT, ["s"], k[0, 40:], v[0, 40:], [1], layer=0, token_ids=[[7]])
    with pytest.raises(InvalidArgument, match="^token_ids: differ"):
        e.append("c", TENANT, ["s"], k[:, 40:], v[:, 40:], [1], token_ids=[[7]])
    assert (e.stats()["c"], e.sequence_info("c", TENANT, "s")) == before
    assert before[1].tier == "disk" and e.stats()["c"]["tiers"]["page_ins_disk"] == 0
    e.append("c", TENANT, ["s"], k[:, 40:], v[:, 40:], [1], token_ids=[[140]])    # the right id: taken
    assert e.sequence_info("c", TENANT, "s").length == 41


def test_a_decode_step_the_main_pool_cannot_seal_is_refused_at_its_first_layer():
    """The step's commit seals a block (the tail is full): with no main-pool block free
    and no lower tier, its first layer is refused with nothing written, not its last,
    which would leave the sequence half a step in with no call able to finish it."""
    from kvstore.codec.codebooks import Codebooks
    from kvstore.errors import ResourceExhausted
    e = Engine()
    e.create_cache(config("pq", num_blocks=1, residual=8, block_size=8))
    g = torch.Generator().manual_seed(0)
    e.set_codebooks("c", Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g),
                                   v=torch.randn(2, 2, 8, 256, 2, generator=g)))
    for sid, n in (("a", 16), ("b", 17)):           # a: its tail full; b: its seal takes the only main block
        e.allocate("c", TENANT, sid, [])
        k, v = kv(2, n, 2, 16)
        e.append("c", TENANT, [sid], k, v, [n])
    assert e.stats()["c"]["main"].free == 0
    before = e.stats()["c"], e.sequence_info("c", TENANT, "a")
    k, v = kv(2, 1, 2, 16, seed=1)
    with pytest.raises(ResourceExhausted, match="^k: no room in cache .c. for what the call writes: need 1 blocks, 0"):
        e.append("c", TENANT, ["a"], k[0], v[0], [1], layer=0)
    assert (e.stats()["c"], e.sequence_info("c", TENANT, "a")) == before
    e.free("c", TENANT, ["b"])                      # room: the same step goes in, layer by layer
    for layer in range(2):
        e.append("c", TENANT, ["a"], k[layer], v[layer], [1], layer=layer)
    assert e.sequence_info("c", TENANT, "a").length == 17
    e.check_invariants()


def _one_block_pq(**kw) -> Engine:
    from kvstore.codec.codebooks import Codebooks
    e = Engine()
    e.create_cache(config("pq", num_blocks=1, **kw))
    g = torch.Generator().manual_seed(0)
    e.set_codebooks("c", Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g),
                                   v=torch.randn(2, 2, 8, 256, 2, generator=g)))
    return e


def test_a_step_holds_the_block_its_commit_seals_from_its_first_layer():
    """Once a step's first layer is in, no other caller can take the main-pool block its
    commit seals: the other caller is refused, and the step's last layer goes in."""
    from kvstore.errors import ResourceExhausted
    e = _one_block_pq(residual=8, block_size=8)
    for sid in ("a", "b"):
        e.allocate("c", TENANT, sid, [])
    k, v = kv(2, 16, 2, 16)
    e.append("c", TENANT, ["a"], k, v, [16])        # its tail full: the next token seals a block
    k, v = kv(2, 1, 2, 16, seed=1)
    e.append("c", TENANT, ["a"], k[0], v[0], [1], layer=0)
    assert e.stats()["c"]["main"].free == 0
    e.check_invariants()
    kb, vb = kv(2, 17, 2, 16, seed=2)
    with pytest.raises(ResourceExhausted, match="^k: no room in cache .c. for what the call writes: need 1 blocks, 0"):
        e.append("c", TENANT, ["b"], kb, vb, [17])
    e.append("c", TENANT, ["a"], k[1], v[1], [1], layer=1)
    info = e.sequence_info("c", TENANT, "a")
    assert info.length == 17 and len(info.sealed_blocks) == 1 and info.pending == [0, 0]
    e.check_invariants()
    e.free("c", TENANT, ["a"])
    assert e.stats()["c"]["main"].free == 1


def test_a_freed_half_step_gives_its_held_block_back():
    e = _one_block_pq(residual=8, block_size=8)
    e.allocate("c", TENANT, "a", [])
    k, v = kv(2, 17, 2, 16)
    e.append("c", TENANT, ["a"], k[:, :16], v[:, :16], [16])
    e.append("c", TENANT, ["a"], k[0, 16:], v[0, 16:], [1], layer=0)
    assert e.stats()["c"]["main"].free == 0
    e.free("c", TENANT, ["a"])
    assert e.stats()["c"]["main"].free == 1
    e.check_invariants()


def test_reserved_slots_hold_the_block_their_commit_seals():
    """A Reserve takes the room its slots' commit seals when it hands them out: a later
    caller cannot take it, so the next Reserve (which commits them) is not refused."""
    from kvstore.errors import ResourceExhausted
    e = _one_block_pq(residual=0, block_size=8)
    for sid in ("r", "s"):
        e.allocate("c", TENANT, sid, [])
    e.reserve("c", TENANT, "r", 16)
    assert e.stats()["c"]["main"].free == 0
    e.check_invariants()
    k, v = kv(2, 16, 2, 16)
    with pytest.raises(ResourceExhausted, match="^k: no room in cache .c. for what the call writes: need 1 blocks"):
        e.append("c", TENANT, ["s"], k, v, [16])
    r = e.reserve("c", TENANT, "r", 0)              # commits the 16: sealed into the held block
    assert r.length == 16 and len(e.sequence_info("c", TENANT, "r").sealed_blocks) == 1
    e.check_invariants()


def test_a_dropped_step_takes_its_token_ids_and_block_hash_with_it(tmp_path):
    """A step dropped half written (a lease's lapse) may come again with another token:
    the ids the dropped step recorded must not stay, or the block the new token completes
    would be indexed under the dropped token's hash and served to a prompt that has it."""
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config("fp16", num_blocks=8))
    prompt, x, y = list(range(100, 107)), 500, 600
    k, v = kv(2, 16, 2, 16)
    e.allocate("c", TENANT, "a", prompt)
    e.append("c", TENANT, ["a"], k[:, :7], v[:, :7], [7], token_ids=[prompt])
    e.append("c", TENANT, ["a"], k[0, 7:8], v[0, 7:8], [1], layer=0, token_ids=[[x]])   # completes block 0
    assert e.offload("c", TENANT, ["a"], drop_uncommitted=True) == 1
    info = e.sequence_info("c", TENANT, "a")
    assert info.length == 7 and info.known_token_ids == 7 and info.block_hashes == []
    e.append("c", TENANT, ["a"], k[:, 8:9], v[:, 8:9], [1], token_ids=[[y]])             # the step again, token y
    assert e.allocate("c", TENANT, "b", prompt + [x, 1, 2]).cached_tokens == 0
    assert e.allocate("c", TENANT, "c", prompt + [y, 1, 2]).cached_tokens == 8
    got, _ = e.retrieve("c", TENANT, "c", 0, 8)
    assert torch.equal(got[:, 7], k[:, 8])
    # Ids known before the step (the prompt Allocate named) stay: the step did not send them.
    e.allocate("c", TENANT, "p", list(range(300, 312)))
    e.append("c", TENANT, ["p"], k[0, :2], v[0, :2], [2], layer=0)
    e.offload("c", TENANT, ["p"], drop_uncommitted=True)
    info = e.sequence_info("c", TENANT, "p")
    assert info.length == 0 and info.known_token_ids == 12 and len(info.block_hashes) == 1
    e.check_invariants()


def test_a_step_the_drop_cut_short_is_refused_before_its_sequence_pages_in(tmp_path):
    e = Engine(lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(config("fp16", num_blocks=8))
    e.allocate("c", TENANT, "a", [])
    k, v = kv(2, 9, 2, 16)
    e.append("c", TENANT, ["a"], k[:, :8], v[:, :8], [8])
    e.append("c", TENANT, ["a"], k[0, 8:], v[0, 8:], [1], layer=0)
    e.offload("c", TENANT, ["a"], drop_uncommitted=True)
    assert e.sequence_info("c", TENANT, "a").tier == "disk"
    with pytest.raises(FailedPrecondition, match="^layer: 1 continues a step"):
        e.append("c", TENANT, ["a"], k[1, 8:], v[1, 8:], [1], layer=1)
    assert e.sequence_info("c", TENANT, "a").tier == "disk"
