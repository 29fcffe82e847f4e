"""XXH3-64 (seed 0, the default secret) of every row of a [n, width] uint8
tensor on the GPU, bit for bit what xxhash.xxh3_64_intdigest gives on the CPU.
Contract of reference.xxh3_64_rows; kernels/router.py picks it for CUDA rows
it takes (takes()).

What for: a restore from the disk tier checks every value it serves against
the checksum stored with it. On the CPU that is a second pass over every byte
on the copy threads, sharing the host's memory bandwidth with the copies: the
read back of an 8K-token prefix to the GPU ran at 0.72-0.77x of its unchecked
speed that way, 0.98-1.03x checked here (bench/bench_lmdb_spill.py --device
cuda, docs/scale.md). Here it is one read of rows that are on the device
anyway, and the bytes checked are the bytes served.

The algorithm (XXH3's long-input path, inputs over 240 bytes): eight 64-bit
accumulators take every 64-byte stripe of the input; after each 1024-byte
block they are scrambled (shift, xor with the secret, multiply); the last
partial block and the input's last 64 bytes follow; then the eight are merged
pairwise by 64x64->128-bit products folded to 64 bits, and avalanched. Within
a block a stripe only adds to the accumulators, so the block's 16 stripes are
one [16, 8] tile summed along its stripes; blocks run in order. One program
per row: a restore has hundreds of rows, so the GPU is full.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..reference import check_xxh3_rows

# XXH3's default secret (xxhash.h, XXH3_kSecret): 192 bytes.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
ROW_MIN = 241           # shorter inputs take XXH3's short paths, which this kernel does not have


def takes(rows: torch.Tensor) -> bool:
    """Whether the kernel takes these rows: [n, width] uint8 rows of whole
    64-bit words (the kernel reads words), long enough for the long path."""
    return (rows.dim() == 2 and rows.dtype == torch.uint8 and rows.shape[1] >= ROW_MIN
            and rows.shape[1] % 8 == 0 and rows.stride(1) == 1 and rows.stride(0) % 8 == 0
            and rows.data_ptr() % 8 == 0)


def _word(off: int) -> int:
    """The secret's little-endian 64-bit word at byte offset off, as a signed int64."""
    return int.from_bytes(XXH3_SECRET[off:off + 8], "little", signed=True)


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device) -> torch.Tensor:
    """int64 [16*8 + 8 + 8 + 8 + 8]: the secret words each stripe of a block
    xors with ([16, 8]: stripe s, lane i at byte 8s + 8i), the scramble's (at
    byte 128), the last stripe's (at byte 121), the merge's (at byte 11), and
    the accumulators' initial values."""
    init = [0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
            0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1]
    words = ([_word(8 * s + 8 * i) for s in range(16) for i in range(8)] + [_word(128 + 8 * i) for i in range(8)]
             + [_word(121 + 8 * i) for i in range(8)] + [_word(11 + 8 * i) for i in range(8)]
             + [int.from_bytes(v.to_bytes(8, "little"), "little", signed=True) for v in init])
    return torch.tensor(words, dtype=torch.int64, device=device)


@triton.jit
def _fold(a, b):
    """The 128-bit product of uint64 a and b, its halves xored (in 32-bit limbs)."""
    m32 = tl.full(a.shape, 0xFFFFFFFF, tl.uint64)
    a_lo, a_hi = a & m32, a >> 32
    b_lo, b_hi = b & m32, b >> 32
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    cross = (ll >> 32) + (lh & m32) + hl            # < 2^64: no carry lost
    lo = (cross << 32) | (ll & m32)
    hi = hh + (lh >> 32) + (cross >> 32)
    return lo ^ hi


@triton.jit
def _xxh3_kernel(x_ptr, row_words, n_words, n_blocks, last_stripes, t_ptr, out_ptr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * row_words
    s = tl.arange(0, 16)[:, None]
    i = tl.arange(0, 8)[None, :]
    lane = tl.arange(0, 8)
    m32 = tl.full([16, 8], 0xFFFFFFFF, tl.uint64)
    m32_lane = tl.full([8], 0xFFFFFFFF, tl.uint64)
    prime32_1 = tl.full([8], 0x9E3779B1, tl.uint64)
    key = tl.load(t_ptr + s * 8 + i).to(tl.uint64, bitcast=True)          # [16, 8]
    scramble = tl.load(t_ptr + 128 + lane).to(tl.uint64, bitcast=True)
    acc = tl.load(t_ptr + 152 + lane).to(tl.uint64, bitcast=True)
    own, pair = s * 8 + i, s * 8 + (i ^ 1)      # lane i takes stripe word i's product and word i^1's value
    for b in range(n_blocks):
        at = base + b * 128
        dk = tl.load(at + own).to(tl.uint64, bitcast=True) ^ key
        acc += tl.sum((dk & m32) * (dk >> 32), axis=0) + tl.sum(tl.load(at + pair).to(tl.uint64, bitcast=True), axis=0)
        acc = ((acc ^ (acc >> 47)) ^ scramble) * prime32_1
    # The last block's whole stripes (none may remain), then the input's last 64 bytes.
    at = base + n_blocks * 128
    live = (s < last_stripes) & (i >= 0)
    dk = tl.load(at + own, mask=live, other=0).to(tl.uint64, bitcast=True) ^ key
    prod = tl.where(live, (dk & m32) * (dk >> 32), tl.zeros([16, 8], tl.uint64))
    acc += tl.sum(prod, axis=0) + tl.sum(tl.load(at + pair, mask=live, other=0).to(tl.uint64, bitcast=True), axis=0)
    last = base + n_words - 8
    dk = tl.load(last + lane).to(tl.uint64, bitcast=True) ^ tl.load(t_ptr + 136 + lane).to(tl.uint64, bitcast=True)
    acc += (dk & m32_lane) * (dk >> 32) + tl.load(last + (lane ^ 1)).to(tl.uint64, bitcast=True)
    # Merge: pairs (0,1) (2,3) (4,5) (6,7), each xored with the merge secret, multiplied and folded.
    mixed = acc ^ tl.load(t_ptr + 144 + lane).to(tl.uint64, bitcast=True)
    zero = tl.zeros([8], tl.uint64)
    even = tl.sum(tl.reshape(tl.where(lane % 2 == 0, mixed, zero), [4, 2]), axis=1)
    odd = tl.sum(tl.reshape(tl.where(lane % 2 == 1, mixed, zero), [4, 2]), axis=1)
    length = (n_words * 8).to(tl.uint64)
    h = length * tl.full([], 0x9E3779B185EBCA87, tl.uint64) + tl.sum(_fold(even, odd), axis=0)
    h = h ^ (h >> 37)
    h = h * tl.full([], 0x165667919E3779F9, tl.uint64)
    h = h ^ (h >> 32)
    tl.store(out_ptr + row, h.to(tl.int64, bitcast=True))


def xxh3_64_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [n, width] uint8 (takes()) -> int64 [n] on their device: each row's
    XXH3-64, its bits as a signed int64 (reference.xxh3_64_rows)."""
    check_xxh3_rows(rows)
    if not takes(rows):
        raise ValueError("rows: the Triton XXH3 kernel takes rows of a multiple of 8 bytes, 8-byte aligned, "
                         f"at least {ROW_MIN} (got {tuple(rows.shape)}, strides {rows.stride()})")
    n, width = rows.shape
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    if n == 0:
        return out
    words = rows.view(torch.int64)       # [n, width / 8], the row stride in words
    n_blocks = (width - 1) // 1024
    last_stripes = ((width - 1) - 1024 * n_blocks) // 64
    _xxh3_kernel[(n,)](words, rows.stride(0) // 8, width // 8, n_blocks, last_stripes, _tables(rows.device), out,
                       num_warps=4)
    return out
