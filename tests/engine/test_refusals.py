"""A refused call moves nothing: checks that need no data run before the
sequences a call names are paged back in from a lower tier."""
import pytest
import torch

from kvstore.engine.engine import Engine
from kvstore.errors import InvalidArgument

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
    with pytest.raises(ResourceExhausted, match="^k: need 1 blocks, 0 free"):
        e.append("c", TENANT, ["a"], k[0], v[0], [1], layer=0)
    assert (e.stats()["c"], e.sequence_info("c", TENANT, "a")) == before
    e.free("c", TENANT, ["b"])                      # room: the same step goes in, layer by layer
    for layer in range(2):
        e.append("c", TENANT, ["a"], k[layer], v[layer], [1], layer=layer)
    assert e.sequence_info("c", TENANT, "a").length == 17
    e.check_invariants()
