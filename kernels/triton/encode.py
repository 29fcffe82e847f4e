"""PQ encode on the GPU: nearest centroid per sub-vector, written into block slots.

plan = plan_pq_encode(codebook)          # once per codebook (precomputes -2c, ||c||^2)
plan.run(x, slots, k_codes=...)          # or v_codes=...; allocates nothing

Distance per candidate c: ||x_m||^2 + ||c||^2 - 2 x_m.c in fp32 (the true squared
distance, so >= 0 up to rounding). The argmin packs the centroid index into the
8 low mantissa bits of the distance and takes one float min: ties (and
distances equal to ~2^-15 relative) go to the lowest index, as torch.argmin.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import check_encode_args


@triton.jit
def _pq_encode_kernel(x_ptr, sx_n, sx_h, cm2_ptr, cn_ptr, slots_ptr, out_ptr,
                      so_blk, so_h, so_off, so_m, N,
                      M: tl.constexpr, DSUB: tl.constexpr, BS: tl.constexpr,
                      TILE_N: tl.constexpr, MG: tl.constexpr):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * MG
    offs_n = pid_n * TILE_N + tl.arange(0, TILE_N)
    offs_c = tl.arange(0, 256)
    nmask = offs_n < N
    slot = tl.load(slots_ptr + offs_n, mask=nmask, other=0).to(tl.int64)
    out_base = out_ptr + (slot // BS) * so_blk + h * so_h + (slot % BS) * so_off
    x_base = x_ptr + offs_n.to(tl.int64) * sx_n + h * sx_h
    for m in range(m0, m0 + MG):
        cb = (h * M + m) * 256
        dist = tl.load(cn_ptr + cb + offs_c)[None, :] + tl.zeros([TILE_N, 256], tl.float32)
        xn = tl.zeros([TILE_N], tl.float32)
        for j in tl.static_range(DSUB):
            xj = tl.load(x_base + m * DSUB + j, mask=nmask, other=0.0).to(tl.float32)
            xn += xj * xj
            # cm2 [Hkv, M, DSUB, 256] = -2c, laid out so a row of 256 is contiguous
            dist += xj[:, None] * tl.load(cm2_ptr + ((h * M + m) * DSUB + j) * 256
                                          + offs_c)[None, :]
        dist += xn[:, None]
        key = ((dist.to(tl.int32, bitcast=True) & -256) | offs_c[None, :]).to(tl.float32,
                                                                            bitcast=True)
        code = tl.min(key, axis=1).to(tl.int32, bitcast=True) & 255
        tl.store(out_base + m * so_m, code.to(tl.uint8), mask=nmask)


@dataclass(slots=True)
class PQEncodePlan:
    """cm2 [Hkv, M, dsub, 256] fp32 = -2 * codebook; cn [Hkv, M, 256] fp32 = ||c||^2."""
    cm2: torch.Tensor
    cn: torch.Tensor
    num_kv_heads: int
    m: int
    dsub: int
    tile_n: int = 64
    subspaces_per_program: int = 8
    num_warps: int = 4

    def run(self, x: torch.Tensor, slots: torch.Tensor,
            k_codes: torch.Tensor | None = None, v_codes: torch.Tensor | None = None) -> None:
        """x [N, Hkv, d] float; slots [N] int (block_id * bs + offset); exactly one of
        k_codes [nb, Hkv, bs, M] u8 (row-wise) or v_codes [nb, Hkv, M, bs] u8."""
        hkv, m, dsub = self.num_kv_heads, self.m, self.dsub
        codes, bs, so_off, so_m = check_encode_args(x, slots, k_codes, v_codes, hkv, m, dsub, self.cn.device)
        n = x.shape[0]
        if n == 0:
            return
        mg = self.subspaces_per_program
        grid = (triton.cdiv(n, self.tile_n), hkv, m // mg)
        _pq_encode_kernel[grid](x, x.stride(0), x.stride(1), self.cm2, self.cn, slots, codes,
                                codes.stride(0), codes.stride(1), so_off, so_m, n,
                                M=m, DSUB=dsub, BS=bs, TILE_N=self.tile_n, MG=mg,
                                num_warps=self.num_warps)


def plan_pq_encode(codebook: torch.Tensor, tile_n: int = 64, subspaces_per_program: int = 8,
                   num_warps: int = 4) -> PQEncodePlan:
    """codebook [Hkv, M, 256, dsub] (any float dtype) -> plan with fp32 precomputes."""
    if codebook.dim() != 4 or codebook.shape[2] != 256:
        raise ValueError(f"codebook must be [Hkv, M, 256, dsub], got {tuple(codebook.shape)}")
    hkv, m, _, dsub = codebook.shape
    mg = min(subspaces_per_program, m)
    if m % mg:
        raise ValueError(f"M={m} must be a multiple of subspaces_per_program={mg}")
    cb = codebook.float()
    return PQEncodePlan(cm2=(-2.0 * cb).permute(0, 1, 3, 2).contiguous(),
                        cn=(cb * cb).sum(-1).contiguous(), num_kv_heads=hkv, m=m, dsub=dsub,
                        tile_n=tile_n, subspaces_per_program=mg, num_warps=num_warps)


def pq_encode_to_slots(x, codebook, slots, k_codes=None, v_codes=None) -> None:
    """Same contract as reference.pq_encode_to_slots (plans, then runs)."""
    plan_pq_encode(codebook).run(x, slots, k_codes=k_codes, v_codes=v_codes)

