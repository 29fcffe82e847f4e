"""A block's bytes as the tiers move them (pack/unpack): every layer's K
slot then every layer's V slot, exact for each codec and dtype, whatever the
payload's alignment in memory."""
import dataclasses

import pytest
import torch

from kvstore.engine.storage import Fp16Store, PQStore
from tests.helpers import config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
STORES = [("pq", "float16", 32), ("pq", "float16", 16), ("fp16", "float16", 0), ("fp16", "bfloat16", 0)]


def store(kind, dtype, m, device, seed):
    cfg = dataclasses.replace(config(codec=kind, m=m, num_blocks=12, num_layers=3, num_kv_heads=2, head_dim=64,
                                     dtype=dtype), device=device)
    s = PQStore(cfg, 12) if kind == "pq" else Fp16Store(cfg, 12)
    g = torch.Generator().manual_seed(seed)
    for t in ((s.k_codes, s.v_codes) if kind == "pq" else (s.k, s.v)):
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8).to(device))
    return s, ((s.k_codes, s.v_codes) if kind == "pq" else (s.k, s.v))


def expected(k, v, ids):
    """The layout written out by hand: block b's layer-0..L-1 K bytes, then its V bytes."""
    rows = []
    for b in ids:
        parts = [k[layer, b].contiguous().view(torch.uint8).flatten() for layer in range(k.shape[0])]
        parts += [v[layer, b].contiguous().view(torch.uint8).flatten() for layer in range(v.shape[0])]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,dtype,m", STORES)
def test_pack_lays_out_each_block_layer_by_layer_k_then_v(device, kind, dtype, m):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    s, (k, v) = store(kind, dtype, m, device, seed=1)
    ids = [7, 0, 11, 3]
    got = s.pack(torch.tensor(ids, device=device))
    assert got.dtype == torch.uint8
    assert torch.equal(got.cpu(), expected(k, v, ids).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,dtype,m", STORES)
@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_unpack_writes_exactly_the_blocks_named_from_any_payload_start(device, kind, dtype, m, offset):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    src, (k, v) = store(kind, dtype, m, device, seed=2)
    dst, (k2, v2) = store(kind, dtype, m, device, seed=3)
    before_k, before_v = k2.clone(), v2.clone()
    payload = src.pack(torch.tensor([2, 5, 9], device=device))
    # The same bytes at an odd start in a larger buffer (a slice of a staging buffer):
    # word-wide copies do not apply there, and the bytes must land the same.
    buf = torch.zeros(payload.numel() + 8, dtype=torch.uint8, device=device)
    buf[offset:offset + payload.numel()] = payload.flatten()
    shifted = buf[offset:offset + payload.numel()].view(payload.shape)
    dst.unpack(torch.tensor([10, 1, 4], device=device), shifted)
    for d, s_ in ((10, 2), (1, 5), (4, 9)):
        assert torch.equal(k2[:, d].view(torch.uint8), k[:, s_].view(torch.uint8))
        assert torch.equal(v2[:, d].view(torch.uint8), v[:, s_].view(torch.uint8))
    others = [b for b in range(12) if b not in (10, 1, 4)]
    assert torch.equal(k2[:, others].view(torch.uint8), before_k[:, others].view(torch.uint8))
    assert torch.equal(v2[:, others].view(torch.uint8), before_v[:, others].view(torch.uint8))


@pytest.mark.gpu
def test_unpack_from_a_host_payload_into_a_gpu_store():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    src, (k, v) = store("pq", "float16", 32, "cpu", seed=4)
    dst, (k2, v2) = store("pq", "float16", 32, "cuda", seed=5)
    dst.unpack(torch.tensor([3, 8], device="cuda"), src.pack(torch.tensor([1, 6])))
    torch.cuda.synchronize()
    assert torch.equal(k2[:, [3, 8]].cpu(), k[:, [1, 6]]) and torch.equal(v2[:, [3, 8]].cpu(), v[:, [1, 6]])
