"""What the disk tier serves is checked against the checksum stored with it,
on the copy threads (CPU) or by the XXH3 kernel where the rows land (GPU):
a prefix hit stops at the first block whose bytes changed behind LMDB's back,
a sequence with such a block is refused whole, and what is served is exact."""
import dataclasses

import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.engine.engine import Engine
from kvstore.errors import DataLoss
from kvstore.tiers import staging
from kvstore.tiers.disk import block_key
from tests.helpers import config

T = "default"
L, HKV, D, M = 2, 2, 64, 32    # a PQ block of 8 tokens: 2 x 2 x 2 x 8 x 32 = 2 KiB, the kernel's long path
# On a GPU, the rows of a read of at least staging.DEVICE_CHECK_MIN_ROWS are checked by
# the kernel, fewer on the copy threads; "cuda" lowers the bound so these few rows take
# the kernel, "cuda-threads" keeps it.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda-threads", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _device_check_bound(request, monkeypatch):
    if getattr(request.node, "callspec", None) and request.node.callspec.params.get("device") == "cuda":
        monkeypatch.setattr(staging, "DEVICE_CHECK_MIN_ROWS", 1)


def engine(tmp_path, device):
    device = device.split("-")[0]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    e = Engine(device, lmdb_path=str(tmp_path / "lmdb"))
    e.create_cache(dataclasses.replace(config(num_blocks=64, num_layers=L, num_kv_heads=HKV, head_dim=D), device=device))
    g = torch.Generator().manual_seed(0)
    e.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, M, 256, 2, generator=g),
                                   v=torch.randn(L, HKV, M, 256, 2, generator=g)))
    # A GPU cache checks restored rows on the device (the XXH3 kernel), a CPU one on the copy threads.
    assert (e.cold_store.books.device_checksums is not None) == (device == "cuda")
    return e


def fill(e, sid, prompt, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, len(prompt), HKV, D, generator=g).half().to(e.device)
    v = torch.randn(L, len(prompt), HKV, D, generator=g).half().to(e.device)
    e.allocate("c", T, sid, prompt)
    e.append("c", T, [sid], k, v, [len(prompt)], token_ids=[prompt])


def damage(e, key):
    """Change a stored value's bytes without its checksum: what a torn page or
    a bad sector leaves (tests/tiers/test_lmdb_crash.py does it in the file)."""
    store = e.cold_store
    with store.lock, store.env.begin(write=True) as txn:
        v = bytearray(txn.get(key))
        v[len(v) // 2] ^= 0x5A
        txn.put(key, bytes(v))


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_hit_from_disk_stops_at_a_damaged_block(tmp_path, device):
    e = engine(tmp_path, device)
    prompt = list(range(1, 81))                    # 10 blocks of 8; the sealed ones get content hashes
    fill(e, "s", prompt)
    want = [t.clone() for t in e.retrieve("c", T, "s", 0, len(prompt))]
    c = e.caches["c"]
    hashes = [c.main_pool.blocks[b].hash for b in c.seqs[(T, "s")].sealed]
    assert len(hashes) >= 5
    e.offload("c", T, ["s"])
    e.free("c", T, ["s"])                          # the sequence goes; its hashed blocks stay on disk
    damage(e, block_key(c.fingerprint, hashes[3]))
    c.main_pool.clear_hashes()
    c.tail_pool.clear_hashes()
    before = e.cold_store.counters["refused_values"]
    got = e.allocate("c", T, "x", prompt).cached_tokens
    assert got == 3 * 8, "served up to the damaged block, not past it"
    assert e.cold_store.counters["refused_values"] == before + 1
    assert e.stats("c")["c"]["tiers"]["prefix_hits_disk"] == 3
    k, v = e.retrieve("c", T, "x", 0, got)
    assert torch.equal(k, want[0][:, :got]) and torch.equal(v, want[1][:, :got])
    e.free("c", T, ["x"])
    # The damaged block was an unreferenced cached block: it is gone, and the next hit stops there too.
    assert not e.cold_store.contains(block_key(c.fingerprint, hashes[3]))
    e.check_invariants()
    e.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_sequence_with_a_damaged_block_is_refused_whole(tmp_path, device):
    e = engine(tmp_path, device)
    fill(e, "s", list(range(1, 81)))
    fill(e, "t", list(range(1000, 1080)), seed=1)
    want = [t.clone() for t in e.retrieve("c", T, "t", 0, 80)]
    e.offload("c", T, ["s", "t"])
    c = e.caches["c"]
    m = c.seqs[(T, "s")].manifest
    tail_hash = next(h for h in m["tail_hashes"] if h)
    for h in (m["sealed_hashes"][1], tail_hash):         # one block of each part: the count covers both
        damage(e, block_key(c.fingerprint, bytes.fromhex(h)))
    total = len(m["sealed_hashes"]) + len(m["tail_hashes"])
    with pytest.raises(DataLoss, match=f"'s'.*: 2 of its {total} blocks on disk are missing or failed"):
        e.prefetch("c", T, ["s"])
    assert e.sequence_info("c", T, "s").tier == "disk", "a refused restore changed the sequence"
    assert e.cold_store.counters["refused_values"] >= 1
    e.prefetch("c", T, ["t"])
    k, v = e.retrieve("c", T, "t", 0, 80)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    e.check_invariants()
    e.close()
