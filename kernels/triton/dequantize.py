"""Dequantize whole PQ blocks to K, V (the Retrieve path); contract of
reference.gather_pq_blocks. One program = one block x one KV head; each output
element is one codebook load (codes -> centroid coordinate)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_kernel(kc_ptr, vc_ptr, skc_blk, skc_h, svc_blk, svc_h, kcb_ptr, vcb_ptr,
                    ids_ptr, k_out, v_out, so_n, so_h, BS: tl.constexpr, M: tl.constexpr,
                    DSUB: tl.constexpr, D: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    t = tl.arange(0, BS)[:, None]                                   # token in block
    col = tl.arange(0, D)[None, :]
    m = col // DSUB
    cb = (h * M + m) * (256 * DSUB) + col % DSUB                    # codebook [Hkv, M, 256, DSUB]
    kc = tl.load(kc_ptr + blk * skc_blk + h * skc_h + t * M + m).to(tl.int32)     # [bs, M] rows
    vc = tl.load(vc_ptr + blk * svc_blk + h * svc_h + m * BS + t).to(tl.int32)    # [M, bs] cols
    out = (i * BS + t).to(tl.int64) * so_n + h * so_h + col
    tl.store(k_out + out, tl.load(kcb_ptr + cb + kc * DSUB))
    tl.store(v_out + out, tl.load(vcb_ptr + cb + vc * DSUB))


def gather_pq_blocks(k_codes: torch.Tensor, v_codes: torch.Tensor,
                     k_codebook: torch.Tensor, v_codebook: torch.Tensor,
                     block_ids: torch.Tensor, k_out: torch.Tensor | None = None,
                     v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k_codes [nb, Hkv, bs, M] u8; v_codes [nb, Hkv, M, bs] u8; k/v_codebook
    [Hkv, M, 256, dsub] (contiguous, one dtype); block_ids [n] int ->
    K, V [n * bs, Hkv, M * dsub] in the codebook dtype (written into k_out/v_out if given)."""
    if k_codebook.dim() != 4 or not k_codebook.is_contiguous():
        raise ValueError(f"k_codebook must be contiguous [Hkv, M, 256, dsub], got "
                         f"{tuple(k_codebook.shape)}")
    hkv, m, c, dsub = k_codebook.shape
    if (v_codebook.shape != k_codebook.shape or v_codebook.dtype != k_codebook.dtype
            or not v_codebook.is_contiguous()):
        raise ValueError("v_codebook must match k_codebook (shape, dtype, contiguous)")
    if k_codes.dtype != torch.uint8 or k_codes.dim() != 4 or k_codes.shape[1:] != (hkv, k_codes.shape[2], m):
        raise ValueError(f"k_codes must be uint8 [nb, {hkv}, bs, {m}], got {tuple(k_codes.shape)}")
    bs = k_codes.shape[2]
    if v_codes.dtype != torch.uint8 or v_codes.shape != (k_codes.shape[0], hkv, m, bs):
        raise ValueError(f"v_codes must be uint8 [nb, {hkv}, {m}, {bs}], got {tuple(v_codes.shape)}")
    if k_codes.stride()[2:] != (m, 1) or v_codes.stride()[2:] != (bs, 1):
        raise ValueError("k_codes / v_codes: each (block, head) slice must be contiguous")
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_ids must be a 1-D int32/int64 tensor")
    d, n = m * dsub, block_ids.shape[0]
    for name, o in (("k_out", k_out), ("v_out", v_out)):
        if o is not None and (o.shape != (n * bs, hkv, d) or o.dtype != k_codebook.dtype
                              or o.stride(2) != 1):
            raise ValueError(f"{name} must be {k_codebook.dtype} [{n * bs}, {hkv}, {d}]")
    k_out = torch.empty(n * bs, hkv, d, dtype=k_codebook.dtype, device=k_codes.device) \
        if k_out is None else k_out
    v_out = torch.empty_like(k_out) if v_out is None else v_out
    if k_out.stride() != v_out.stride():
        raise ValueError("k_out and v_out must have the same strides")
    if n > 0:
        _dequant_kernel[(n, hkv)](k_codes, v_codes, k_codes.stride(0), k_codes.stride(1),
                                  v_codes.stride(0), v_codes.stride(1), k_codebook, v_codebook,
                                  block_ids, k_out, v_out, k_out.stride(0), k_out.stride(1),
                                  BS=bs, M=m, DSUB=dsub, D=d, num_warps=4)
    return k_out, v_out
