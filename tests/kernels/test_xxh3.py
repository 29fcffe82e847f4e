"""The XXH3-64 row kernel (kernels/triton/xxh3.py) against xxhash's own C code
(reference.xxh3_64_rows): every length class of XXH3's long path (a partial
last block or none, whole stripes or not), real payload widths, strided rows,
and a changed byte anywhere changes the hash."""
import numpy as np
import pytest
import torch
from test_triton_kernels import HAS_CUDA, INTERPRET, cpu_only, gpu  # noqa: F401

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels.triton import xxh3

xxhash = pytest.importorskip("xxhash")


def rows_of(n, width, seed=0, device="cpu"):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, width), dtype=np.uint8)).to(device)


def test_reference_is_xxhash():
    r = rows_of(3, 300)
    want = [xxhash.xxh3_64_intdigest(r[i].numpy().tobytes()) for i in range(3)]
    assert [s & (2**64 - 1) for s in ref.xxh3_64_rows(r).tolist()] == want


@cpu_only
@pytest.mark.parametrize("width", [248, 1024, 1032, 1088, 2040, 4096])
def test_kernel_matches_xxhash_cpu(width):
    r = rows_of(3, width, seed=width)
    assert torch.equal(xxh3.xxh3_64_rows(r), ref.xxh3_64_rows(r))


@cpu_only
def test_kernel_refuses_rows_it_does_not_take():
    for bad in (rows_of(2, 240), rows_of(2, 300)[:, :292 + 4], rows_of(2, 256)[:, 1:249]):
        assert not xxh3.takes(bad)
        with pytest.raises(ValueError, match="rows"):
            xxh3.xxh3_64_rows(bad)


@gpu
@pytest.mark.parametrize("width", [248, 256, 1024, 1032, 1088, 4096, 65544, 512 * 1024, 2 * 1024 * 1024])
def test_kernel_matches_xxhash_gpu(width):
    r = rows_of(5, width, seed=width, device="cuda")
    assert xxh3.takes(r)
    assert torch.equal(kernels.xxh3_64_rows(r).cpu(), ref.xxh3_64_rows(r.cpu()))


@gpu
def test_kernel_on_strided_rows_and_every_changed_byte_gpu():
    base = rows_of(64, 1536, seed=7, device="cuda")
    r = base[:, 8:8 + 1288]                          # rows 1536 bytes apart, 1288 wide
    assert torch.equal(kernels.xxh3_64_rows(r).cpu(), ref.xxh3_64_rows(r.cpu()))
    want = kernels.xxh3_64_rows(r)
    changed = r.clone()
    at = torch.arange(64, device="cuda") * 20        # one byte per row, at every position class
    changed[torch.arange(64, device="cuda"), at] ^= 1
    assert bool((kernels.xxh3_64_rows(changed) != want).all())
    assert kernels.xxh3_64_rows(r[:0]).shape == (0,)


@gpu
def test_router_falls_back_to_the_reference_gpu():
    r = rows_of(3, 100, device="cuda")                # the short path: not the kernel's
    assert not xxh3.takes(r)
    got = kernels.xxh3_64_rows(r)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), ref.xxh3_64_rows(r.cpu()))
