"""PQ encode in CUDA C++ (encode.cu): nearest centroid per sub-vector, written straight
into block slots. Contract of reference.pq_encode_to_slots, and every layer in one launch.

    plan = plan_pq_encode(codebook)          # once per codebook: precomputes, cell tables
    plan.run(x, slots, k_codes=...)          # or v_codes=...; allocates nothing

A codebook of every layer [L, Hkv, M, 256, dsub] plans them all: run() then takes x [L,
N, Hkv, d] and codes [L, nb, ...] and encodes every layer in that one launch (its grid
runs over L x Hkv; the tables stack the layers' heads). A seal encodes the same tokens
in every layer, and a launch costs the host more than the encode itself costs the GPU.

dsub 2 with M % 16 == 0 runs through cell tables (kernels/pq_cells.py: exact, the
reference's codes bit for bit); x rows the cell kernel cannot load as 16 B vectors, and
every other shape, take the brute-force kernel of the same plan.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..plan import ceil, check_encode_args, check_encode_layers
from . import build
from .build import i32, i64, ptr


def supported(codebook: torch.Tensor) -> bool:
    """The kernels take this codebook [Hkv, M, 256, dsub] or [L, Hkv, M, 256, dsub] (on a
    GPU where they run)."""
    if not (codebook.is_cuda and build.available()) or codebook.dim() not in (4, 5):
        return False
    _, m, c, dsub = codebook.shape[-4:]
    return c == 256 and dsub in (2, 4) and m % (8 if dsub == 2 else 4) == 0


@dataclass(slots=True)
class CudaPQEncodePlan:
    """cpre [Hkv, M, 256, 4 | 8] fp32: (-2c, ||c||^2) per centroid, float4-aligned, for the
    brute-force kernel. dsub 2 also gets cell tables (kernels/pq_cells.py): cents
    [Hkv, M, 256, 2] fp32, bp [Hkv, M, 2, G+1] fp32, recs [Hkv, M, G*G, cmax+1] u8
    (count, candidates); `cells` None = brute force only. layers > 1: a plan of every
    layer, whose tables lead with L x Hkv heads (layer-major)."""
    cpre: torch.Tensor
    num_kv_heads: int
    m: int
    dsub: int
    tokens_per_thread: int = 4
    cells: dict | None = None
    num_sms: int = 132
    layers: int = 1

    def run(self, x, slots, k_codes=None, v_codes=None) -> None:
        """x [N, Hkv, d] fp16/bf16/fp32; slots [N] int32/int64 (block * bs + offset);
        exactly one of k_codes [nb, Hkv, bs, M] u8 (row-wise) or v_codes [nb, Hkv, M, bs] u8.
        A plan of L layers: x [L, N, Hkv, d] and k_codes / v_codes [L, nb, ...]; the same
        slots in every layer."""
        hkv, m, dsub = self.num_kv_heads, self.m, self.dsub
        sx_l = so_l = 0
        if self.layers > 1 or x.dim() == 4:
            check_encode_layers(x, self.layers, k_codes, v_codes)
            sx_l, so_l = x.stride(0), (k_codes if k_codes is not None else v_codes).stride(0)
            x, k_codes, v_codes = x[0], None if k_codes is None else k_codes[0], None if v_codes is None else v_codes[0]
        codes, bs, so_off, so_m = check_encode_args(x, slots, k_codes, v_codes, hkv, m, dsub, self.cpre.device)
        n = x.shape[0]
        if n == 0:
            return
        heads = self.layers * hkv
        xb = "true" if x.dtype == torch.bfloat16 else "false"
        xf = "true" if x.dtype == torch.float32 else "false"
        s64 = "true" if slots.dtype == torch.int64 else "false"
        layered = (i32(hkv), i64(sx_l), i64(so_l))
        if self.cells is not None and cells_aligned(x, sx_l):
            c = self.cells
            tpb = c["tokens_per_block"] or _tokens_per_block(n, m // 16 * heads, self.num_sms)
            vec = int(so_m == 1 and codes.data_ptr() % 4 == 0 and codes.stride(0) % 4 == 0
                      and codes.stride(1) % 4 == 0 and so_off % 4 == 0 and so_l % 4 == 0)
            fn = build.function("encode.cu", f"pq_encode_cells<{c['grid']}, {c['cmax']}, {xb}, {xf}, {s64}>",
                                x.device)
            build.launch(fn, x.device, (m // 16, ceil(n, tpb), heads), (256,),
                         (ptr(x), i64(x.stride(0)), i64(x.stride(1)), ptr(c["cents"]), ptr(c["bp"]),
                          ptr(c["recs"]), ptr(slots), ptr(codes), i64(codes.stride(0)),
                          i64(codes.stride(1)), i64(so_off), i64(so_m), i32(n), i32(m),
                          i32(bs), i32(tpb), i32(vec), *layered))
            return
        t = self.tokens_per_thread
        mg = 8 if dsub == 2 else 4
        fn = build.function("encode.cu", f"pq_encode<{dsub}, {t}, {mg}, {xb}, {xf}, {s64}>", x.device)
        build.launch(fn, x.device, (ceil(n, 32 * t), heads, m // mg), (32 * mg,),
                     (ptr(x), i64(x.stride(0)), i64(x.stride(1)), ptr(self.cpre), ptr(slots),
                      ptr(codes), i64(codes.stride(0)), i64(codes.stride(1)), i64(so_off),
                      i64(so_m), i32(n), i32(m), i32(bs), *layered))


def cells_aligned(x: torch.Tensor, layer_stride: int = 0) -> bool:
    """The cell kernel loads 8 x values per thread as 16 B (fp16/bf16) or 2 x 16 B (fp32):
    every row it reads, in every layer (layer_stride, elements), starts on 16 B."""
    v = 8 if x.element_size() == 2 else 4
    return x.data_ptr() % 16 == 0 and all(s % v == 0 for s in (x.stride(0), x.stride(1), layer_stride))


def _tokens_per_block(n: int, groups: int, num_sms: int) -> int:
    """About 8 blocks per SM in total (6 fit at once): enough tokens per block to amortise
    staging 36 KB of centroids, enough blocks to keep the tail wave short."""
    return max(64, ceil(ceil(n * groups, 8 * num_sms), 64) * 64)


def plan_pq_encode(codebook: torch.Tensor, tokens_per_thread: int = 4, cells: bool = True,
                   grid: int = 32, cmax: int = 7, tokens_per_block: int = 0) -> CudaPQEncodePlan:
    """codebook [Hkv, M, 256, dsub], or [L, Hkv, M, 256, dsub]: a plan of every layer.
    dsub 2 with M % 16 == 0 (and not fp64, whose reference arithmetic is fp64) also builds
    the cell tables on the codebook's device."""
    kw = dict(tokens_per_thread=tokens_per_thread, cells=cells, grid=grid, cmax=cmax,
              tokens_per_block=tokens_per_block)
    if codebook.dim() == 5:
        return _every_layer(codebook, **kw)
    hkv, m, c, dsub = codebook.shape
    cb = codebook.float()
    pre = torch.zeros(hkv, m, 256, 4 if dsub == 2 else 8, dtype=torch.float32,
                      device=codebook.device)
    pre[..., :dsub] = -2.0 * cb
    pre[..., 2 if dsub == 2 else 4] = (cb * cb).sum(-1)
    tabs = None
    if (cells and dsub == 2 and m % 16 == 0 and codebook.dtype != torch.float64
            and torch.cuda.get_device_capability(codebook.device) >= (8, 0)):   # __reduce_max_sync
        from ..pq_cells import build_cell_tables
        t = build_cell_tables(codebook, grid=grid, cmax=cmax)
        tabs = dict(cents=cb.contiguous(), bp=t.bp.contiguous(),
                    recs=torch.cat([t.counts.unsqueeze(-1), t.lists], -1).contiguous(),
                    grid=grid, cmax=cmax, tokens_per_block=tokens_per_block)
    return CudaPQEncodePlan(cpre=pre.contiguous(), num_kv_heads=hkv, m=m, dsub=dsub,
                            tokens_per_thread=tokens_per_thread, cells=tabs,
                            num_sms=torch.cuda.get_device_properties(codebook.device).multi_processor_count)


def _every_layer(codebooks: torch.Tensor, **kw) -> CudaPQEncodePlan:
    """One plan for codebooks [L, Hkv, M, 256, dsub]: each layer's tables, built one layer
    at a time (the cell tables' temporaries stay one layer's) into tensors that stack the
    layers' heads, [L x Hkv, ...] layer-major, as the kernels index them."""
    layers, hkv = codebooks.shape[:2]

    def stacked(t):
        return torch.empty((layers * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)

    one = plan_pq_encode(codebooks[0], **kw)
    cells = None if one.cells is None else {
        k: (stacked(v) if isinstance(v, torch.Tensor) else v) for k, v in one.cells.items()}
    out = dataclasses.replace(one, cpre=stacked(one.cpre), cells=cells, layers=layers)
    for i in range(layers):
        one = one if i == 0 else plan_pq_encode(codebooks[i], **kw)
        rows = slice(i * hkv, (i + 1) * hkv)
        out.cpre[rows] = one.cpre
        for k, v in (one.cells or {}).items():
            if isinstance(v, torch.Tensor):
                out.cells[k][rows] = v
    return out


_encode_plans: dict = {}        # (address, shape, dtype) -> (the tensor's version, plan)


def _plan_key(codebook: torch.Tensor) -> tuple:
    return codebook.data_ptr(), tuple(codebook.shape), codebook.dtype


def encode_plan(codebook: torch.Tensor, refresh: bool = False) -> CudaPQEncodePlan:
    """The plan of a codebook (precomputed -2c and ||c||^2, and for dsub 2 the cell
    tables, a few hundred ms per layer on an H100), cached per codebook tensor: a
    cache's codebooks are set once and read on every seal, so SetCodebooks builds
    them (router.prepare_encode) rather than the first seal. One plan an address: a
    codebook written in place since (its version) gets its plan rebuilt over the old
    one, not beside it (~0.24 GB of tables a codebook of an 8B model). refresh: rebuild
    even so (new codebooks may sit where freed ones were, at the same version)."""
    key = _plan_key(codebook)
    hit = _encode_plans.get(key)
    if hit is None or refresh or hit[0] != codebook._version:
        if hit is None and len(_encode_plans) >= 4096:
            _encode_plans.clear()
        hit = _encode_plans[key] = (codebook._version, plan_pq_encode(codebook))
    return hit[1]


def release_plan(codebook: torch.Tensor) -> None:
    """Forget this codebook tensor's plan (its owner is dropping it): the tables are
    GPU memory that would otherwise outlive the codebooks."""
    _encode_plans.pop(_plan_key(codebook), None)


def pq_encode_to_slots(x, codebook, slots, k_codes=None, v_codes=None) -> None:
    """Same contract as reference.pq_encode_to_slots."""
    encode_plan(codebook).run(x, slots, k_codes=k_codes, v_codes=v_codes)
