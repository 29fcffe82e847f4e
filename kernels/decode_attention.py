"""Decode attention over PQ codes (+ fp16 tail) and over plain fp16 paged KV.

Plan/run split as in FlashInfer's BatchDecodeWithPagedKVCacheWrapper:

    plan = plan_pq_decode(sealed_lens, tail_lens, num_qo_heads=32, ...)  # once per step
    out, lse = plan.run_pq(q, k_codes, v_codes, k_cb, v_cb, sealed_tables,
                           tail_k, tail_v, tail_tables, scale)            # per layer

plan() reads the lengths on the host, cuts every sequence into work items
(split-K over blocks, the fp16 tail as one more item) and allocates the
partial-result workspace. run() only checks metadata and launches two
kernels (attend, then a log-sum-exp merge): it allocates nothing when `out`
and `lse` are given, never synchronises, and can be captured in a CUDA graph.
Semantics are those of reference.pq_decode_attention / paged_decode_attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kvstore.cuda.pinned import copy_into, to_device

from ._decode_kernels import _decode_kernel, _merge_kernel

_PQ, _DENSE = 0, 1
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)



@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sms(device.index if device.index is not None else torch.cuda.current_device())
    return 1


def _host_lens(x, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]                       # plan may sync
    return [int(v) for v in x]


@dataclass(slots=True)
class DecodePlan:
    """Work partition + workspace for one decode step (all layers reuse it).

    items [n_items, 4] int32 (b, kind, lo, hi); item_ptr [B + 1] int32: the
    items of sequence b are item_ptr[b]:item_ptr[b+1]; o_part fp32
    [n_items, Hq, d] and lse_part fp32 [n_items, Hq] are the partials.
    """
    items: torch.Tensor
    item_ptr: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int          # PQ block size (pq plans) or the fp16 pool's
    tail_block_size: int
    sealed_cols: int         # block-table columns the plan needs
    tail_cols: int
    max_items: int
    has_pq: bool
    tile_pq: int
    tile_fp: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None   # register cap: more resident programs to hide gather latency
    chunk0: int = 0              # split size the plan was made with (update() starts there)

    def update(self, *lens) -> "DecodePlan":
        """Re-partition for new lengths (same batch) into this plan's own buffers.

        For CUDA graphs: the item count, workspace and merge width stay those of
        the plan (splits grow until the items fit; unused items are empty and
        never merged), so a graph captured with this plan replays correctly
        after update(). Arguments as the plan function's: (sealed_lens,
        tail_lens) for a PQ plan, (seq_lens,) for a paged one."""
        items, ptr = self.rows(*lens)
        copy_into(self.items, torch.tensor(items, dtype=torch.int32))
        copy_into(self.item_ptr, torch.tensor(ptr, dtype=torch.int32))
        return self

    def rows(self, *lens) -> tuple[list[int], list[int]]:
        """update() on the host: (items, item_ptr) as flat lists for the new lengths,
        items padded to this plan's capacity, for a caller that copies them in itself."""
        cap = self.items.shape[0]
        if self.has_pq:
            sl, tl_ = _pq_lens(*lens, block_size=self.block_size)
            make = lambda c: _pq_items(sl, tl_, c)           # noqa: E731
        else:
            sl = _host_lens(lens[0], "seq_lens")
            tl_ = sl
            make = lambda c: _paged_items(sl, c)             # noqa: E731
        if len(sl) != self.batch:
            raise ValueError(f"update: the plan is for a batch of {self.batch}, got {len(sl)} lengths")
        items, ptr = _fit(make, self.chunk0, cap, 4, self.max_items)
        if self.has_pq:
            self.sealed_cols = max([n // self.block_size for n in sl] + [0])
        self.tail_cols = max([triton.cdiv(n, self.tail_block_size) for n in tl_] + [0])
        return items, ptr

    # ------------------------------------------------------------ checks
    def _check_q_out(self, q, out, lse):
        b, hq, d = self.batch, self.num_qo_heads, self.head_dim
        _check(q, "q", (b, hq, d), _FLOAT, self.items.device)
        if out is None:
            out = torch.empty_like(q)
        else:
            _check(out, "out", (b, hq, d), (q.dtype,), q.device)
        if lse is None:
            lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
        else:
            _check(lse, "lse", (b, hq), (torch.float32,), q.device, last=False)
        return out, lse

    def _check_pool(self, k, v, tables, names, cols):
        nb = k.shape[0] if k.dim() == 4 else -1
        shape = (nb, self.num_kv_heads, self.tail_block_size, self.head_dim)
        _check(k, names[0], shape, _FLOAT, self.items.device)
        _check(v, names[1], shape, (k.dtype,), k.device)
        if k.stride() != v.stride():
            raise ValueError(f"{names[0]} and {names[1]} must have the same strides")
        _check_table(tables, names[2], self.batch, cols, k.device)

    # --------------------------------------------------------------- run
    def run_pq(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
               tail_k, tail_v, tail_tables, scale: float, out=None, lse=None,
               trusted: bool = False, codebook_image=None):
        """q [B, Hq, d]; k_codes [nb, Hkv, bs, M] u8; v_codes [nb, Hkv, M, bs] u8;
        k/v_codebook [Hkv, M, 256, dsub] fp16|bf16 (dsub 2 or 4); sealed_tables
        [B, >=S] int32; tail_k/v [nt, Hkv, tbs, d]; tail_tables [B, >=T] int32
        -> (out [B, Hq, d] q dtype, lse [B, Hq] fp32). trusted and codebook_image
        are the CUDA plan's (cuda_pq.CudaPQPlan.run_pq): this plan always checks
        its arguments and has no use for an image, so one signature serves both."""
        if not self.has_pq:
            raise ValueError("plan was made by plan_paged_decode; use run_paged")
        out, lse = self._check_q_out(q, out, lse)
        hkv, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        if k_codebook.dim() != 4:
            raise ValueError(f"k_codebook must be [Hkv, M, 256, dsub], got {tuple(k_codebook.shape)}")
        m, dsub = k_codebook.shape[1], k_codebook.shape[3]
        if dsub not in (2, 4) or m * dsub != d:
            raise ValueError(f"k_codebook: need dsub in (2, 4) and M*dsub == head_dim, got M={m} dsub={dsub}")
        for name, cb in (("k_codebook", k_codebook), ("v_codebook", v_codebook)):
            _check(cb, name, (hkv, m, 256, dsub), (torch.float16, torch.bfloat16), q.device,
                   contiguous=True)
        if v_codebook.dtype != k_codebook.dtype:
            raise ValueError("v_codebook must have k_codebook's dtype")
        nb = k_codes.shape[0] if k_codes.dim() == 4 else -1
        _check(k_codes, "k_codes", (nb, hkv, bs, m), (torch.uint8,), q.device)
        _check(v_codes, "v_codes", (nb, hkv, m, bs), (torch.uint8,), q.device)
        if k_codes.stride(2) != m or v_codes.stride(2) != bs:
            raise ValueError("k_codes / v_codes: each (block, head) slice must be contiguous")
        _check_table(sealed_tables, "sealed_tables", self.batch, self.sealed_cols, q.device)
        self._check_pool(tail_k, tail_v, tail_tables, ("tail_k", "tail_v", "tail_tables"),
                         self.tail_cols)
        word = torch.int32 if dsub == 2 else torch.int64
        kw, vw = k_codebook.view(word), v_codebook.view(word)      # no copy
        self._launch(q, out, lse, scale, k_codes, v_codes, kw, vw, sealed_tables,
                     tail_k, tail_v, tail_tables, m, dsub, k_codebook.dtype == torch.bfloat16,
                     tail_k.dtype)
        return out, lse

    def run_paged(self, q, k_cache, v_cache, block_tables, scale: float, out=None, lse=None,
                  trusted: bool = False):
        """q [B, Hq, d]; k/v_cache [nb, Hkv, bs, d]; block_tables [B, >=S] int32
        -> (out [B, Hq, d] q dtype, lse [B, Hq] fp32). trusted: the caller made
        every argument to this plan's measure (the engine, from its own pools):
        skip the checks (~40 µs of a tiny call)."""
        if self.has_pq:
            raise ValueError("plan was made by plan_pq_decode; use run_pq")
        if trusted:
            out = torch.empty_like(q) if out is None else out
            lse = torch.empty(self.batch, self.num_qo_heads, dtype=torch.float32, device=q.device) \
                if lse is None else lse
        else:
            out, lse = self._check_q_out(q, out, lse)
            self._check_pool(k_cache, v_cache, block_tables, ("k_cache", "v_cache", "block_tables"),
                             self.tail_cols)
        self._launch(q, out, lse, scale, q, q, q, q, block_tables, k_cache, v_cache,
                     block_tables, 16, 2, False, k_cache.dtype)
        return out, lse

    def _launch(self, q, out, lse, scale, kc, vc, kw, vw, st, tk, tv, tt, m, dsub, cb_bf16,
                dense_dtype):
        hq, hkv = self.num_qo_heads, self.num_kv_heads
        g = hq // hkv
        n_items = self.items.shape[0]
        prec = "ieee" if dense_dtype == torch.float32 else "tf32"
        if n_items > 0:
            _decode_kernel[(n_items, hkv)](
                q, q.stride(0), q.stride(1), self.items, self.o_part, self.lse_part,
                kc, vc, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                kw, vw, st, st.stride(0),
                tk, tv, tk.stride(0), tk.stride(1), tk.stride(2),
                tv.stride(0), tv.stride(1), tv.stride(2), tt, tt.stride(0),
                scale * 1.4426950408889634, hq,
                G=g, GP=max(16, triton.next_power_of_2(g)), D=self.head_dim, M=m, DSUB=dsub,
                BS=self.block_size, TBS=self.tail_block_size, TILE_PQ=self.tile_pq,
                TILE_FP=self.tile_fp, HAS_PQ=self.has_pq, CB_BF16=cb_bf16, PREC=prec,
                num_warps=self.num_warps, num_stages=self.num_stages, maxnreg=self.maxnreg)
        _merge_kernel[(self.batch, hq)](
            self.o_part, self.lse_part, self.item_ptr, out, out.stride(0), out.stride(1),
            lse, lse.stride(0), hq, D=self.head_dim, MAX_ITEMS=self.max_items, num_warps=4)


# -------------------------------------------------------------------- checks

def _check(t, name, shape, dtypes, device, last=True, contiguous=False):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor")
    if t.dim() != len(shape) or any(s >= 0 and a != s for a, s in zip(t.shape, shape)):
        want = tuple("?" if s < 0 else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if last and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_table(t, name, batch, cols, device):
    _check(t, name, (batch, -1), (torch.int32,), device)
    if t.shape[1] < cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, the plan needs {cols}")


# ---------------------------------------------------------------------- plan

def _chunk(total: int, n_fixed: int, hkv: int, tile: int, target_ctas: int) -> int:
    """Tokens per split: about target_ctas programs in all, whole tiles, >= 4 tiles."""
    items = max(1, target_ctas // hkv - n_fixed)
    return max(4 * tile, triton.cdiv(triton.cdiv(max(total, 1), items), tile) * tile)


def _fit(make, chunk: int, cap: int | None, width: int, max_per_seq: int | None = None):
    """items, ptr = make(chunk), with chunk doubled until at most cap items (and at
    most max_per_seq per sequence) come out, then padded with empty items to cap."""
    while True:
        items, ptr = make(chunk)
        n = len(items) // width
        per_seq = max([ptr[i + 1] - ptr[i] for i in range(len(ptr) - 1)] + [0])
        if (cap is None or n <= cap) and (max_per_seq is None or per_seq <= max_per_seq):
            break
        if all(ptr[i + 1] - ptr[i] <= 1 for i in range(len(ptr) - 1)) or chunk > 1 << 40:
            raise ValueError(f"the plan has room for {cap} work items, these lengths need {n}")
        chunk *= 2
    if cap is not None:
        items = items + [0] * (width * (cap - n))
    return items, ptr


def _capacity(n: int, batch: int, spare_items: int | None) -> int | None:
    """Item capacity of a plan meant for update(): what it needs now plus room."""
    return None if spare_items is None else n + max(spare_items, batch)


def _finish(items, ptr, batch, hq, d, device, cap=None, **kw) -> DecodePlan:
    n = len(items) // 4
    per_seq = max([ptr[i + 1] - ptr[i] for i in range(batch)] + [1])
    dev = torch.device(device)
    if cap is not None:         # room for update(): a fixed count and merge width
        items = items + [0] * (4 * (cap - n))
        n, per_seq = cap, cap
    return DecodePlan(
        items=to_device(torch.tensor(items, dtype=torch.int32).reshape(n, 4), dev),
        item_ptr=to_device(torch.tensor(ptr, dtype=torch.int32), dev),
        o_part=torch.empty(max(n, 1), hq, d, dtype=torch.float32, device=dev),
        lse_part=torch.empty(max(n, 1), hq, dtype=torch.float32, device=dev),
        batch=batch, num_qo_heads=hq, head_dim=d, max_items=triton.next_power_of_2(per_seq),
        **kw)


def _validate_heads(hq, hkv, d):
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if d not in (64, 128, 256):
        raise ValueError(f"head_dim must be 64, 128 or 256, got {d}")


def _pq_lens(sealed_lens, tail_lens, *, block_size):
    sl, tl_ = _host_lens(sealed_lens, "sealed_lens"), _host_lens(tail_lens, "tail_lens")
    if len(sl) != len(tl_):
        raise ValueError("sealed_lens and tail_lens must have the same length")
    if any(n % block_size or n < 0 for n in sl):
        raise ValueError(f"sealed_lens must be non-negative multiples of block_size={block_size}")
    if any(n < 0 for n in tl_):
        raise ValueError("tail_lens must be non-negative")
    return sl, tl_


def _pq_items(sl, tl_, chunk):
    items, ptr = [], [0]
    for b, (ns, nt) in enumerate(zip(sl, tl_)):
        for lo in range(0, ns, chunk):
            items += [b, _PQ, lo, min(ns, lo + chunk)]
        for lo in range(0, nt, 4096):      # the tail is short; cap keeps items bounded
            items += [b, _DENSE, lo, min(nt, lo + 4096)]
        ptr.append(len(items) // 4)
    return items, ptr


def plan_pq_decode(sealed_lens, tail_lens, *, num_qo_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, tail_block_size: int, device,
                   target_ctas: int | None = None, tile_pq: int = 128, tile_fp: int = 32,
                   num_warps: int = 4, num_stages: int = 1,
                   maxnreg: int | None = 128, backend: str = "auto",
                   spare_items: int | None = None) -> DecodePlan:
    """sealed_lens [B] (tokens, multiples of block_size), tail_lens [B]: host lists or
    tensors (read on the host). Returns the plan for DecodePlan.run_pq.

    spare_items (None: a one-step plan) makes a plan for plan.update(): it keeps
    room for that many more work items (at least B) and a fixed merge width, so
    later steps reuse its buffers and a CUDA graph captured with it.

    Defaults are the fastest of bench/sweep_pq.py on an H100 (bench/NOTES-attention.md):
    the code -> centroid gathers are latency-bound, so many small-register programs
    (~8 per SM at 128 registers) with 128-token tiles keep the most loads in flight."""
    _validate_heads(num_qo_heads, num_kv_heads, head_dim)
    sl, tl_ = _pq_lens(sealed_lens, tail_lens, block_size=block_size)
    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'triton', got {backend!r}")
    if backend != "triton":
        # CUDA C++ kernels (kernels/cuda_pq.py) where cupy imports and the shape fits;
        # their plan falls back to this Triton plan for dtypes they do not take.
        from . import cuda_pq
        if cuda_pq.supports(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, device=device):
            fb = dict(sealed_lens=sl, tail_lens=tl_, num_qo_heads=num_qo_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                      tail_block_size=tail_block_size, device=device, target_ctas=target_ctas,
                      tile_pq=tile_pq, tile_fp=tile_fp, num_warps=num_warps,
                      num_stages=num_stages, maxnreg=maxnreg)
            return cuda_pq.plan_pq_decode(sl, tl_, num_qo_heads=num_qo_heads,
                                          num_kv_heads=num_kv_heads, head_dim=head_dim,
                                          block_size=block_size,
                                          tail_block_size=tail_block_size, device=device,
                                          target_ctas=target_ctas, fallback_args=fb,
                                          spare_items=spare_items)
        if backend == "cuda":
            raise ValueError("backend='cuda': cupy is missing or the shape is not supported")
    if target_ctas is None:
        target_ctas = 8 * _num_sms(torch.device(device))
    chunk = _chunk(sum(sl), sum(1 for n in tl_ if n > 0), num_kv_heads, tile_pq, target_ctas)
    items, ptr = _pq_items(sl, tl_, chunk)
    return _finish(items, ptr, len(sl), num_qo_heads, head_dim, device,
                   cap=_capacity(len(items) // 4, len(sl), spare_items),
                   num_kv_heads=num_kv_heads, block_size=block_size,
                   tail_block_size=tail_block_size,
                   sealed_cols=max([n // block_size for n in sl] + [0]),
                   tail_cols=max([triton.cdiv(n, tail_block_size) for n in tl_] + [0]),
                   has_pq=True, tile_pq=tile_pq, tile_fp=tile_fp,
                   num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg, chunk0=chunk)


def _paged_items(sl, chunk):
    items, ptr = [], [0]
    for b, n in enumerate(sl):
        for lo in range(0, n, chunk):
            items += [b, _DENSE, lo, min(n, lo + chunk)]
        ptr.append(len(items) // 4)
    return items, ptr


def plan_paged_decode(seq_lens, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, device, target_ctas: int | None = None,
                      tile: int = 128, num_warps: int = 4, num_stages: int = 3,
                      spare_items: int | None = None) -> DecodePlan:
    """seq_lens [B] (host list or tensor). Returns the plan for DecodePlan.run_paged;
    spare_items as in plan_pq_decode. Defaults from bench/sweep_paged.py on an H100
    (tile 128, 4 x SMs work items: 0.98x / 0.95x SDPA flash at B=8, 32K / 128K, against
    0.93x with tile 64 and 2 x SMs)."""
    _validate_heads(num_qo_heads, num_kv_heads, head_dim)
    sl = _host_lens(seq_lens, "seq_lens")
    if target_ctas is None:
        target_ctas = 4 * _num_sms(torch.device(device))
    chunk = _chunk(sum(sl), 0, num_kv_heads, tile, target_ctas)
    items, ptr = _paged_items(sl, chunk)
    return _finish(items, ptr, len(sl), num_qo_heads, head_dim, device,
                   cap=_capacity(len(items) // 4, len(sl), spare_items),
                   num_kv_heads=num_kv_heads, block_size=block_size,
                   tail_block_size=block_size, sealed_cols=0,
                   tail_cols=max([triton.cdiv(n, block_size) for n in sl] + [0]),
                   has_pq=False, tile_pq=64, tile_fp=tile,
                   num_warps=num_warps, num_stages=num_stages, chunk0=chunk)


# ------------------------------------------------- reference-signature entry points

def pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                        tail_k, tail_v, tail_tables, tail_lens, scale):
    """Same contract as reference.pq_decode_attention (plans, then runs)."""
    hq, hkv = q.shape[1], k_codes.shape[1]
    plan = plan_pq_decode(sealed_lens, tail_lens, num_qo_heads=hq, num_kv_heads=hkv,
                          head_dim=q.shape[2], block_size=k_codes.shape[2],
                          tail_block_size=tail_k.shape[2], device=q.device)
    cb_dt = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float16
    kcb, vcb = (c if c.dtype in (torch.float16, torch.bfloat16) else c.to(cb_dt)
                for c in (k_codebook, v_codebook))
    return plan.run_pq(q, k_codes, v_codes, kcb.contiguous(), vcb.to(kcb.dtype).contiguous(),
                       sealed_tables.to(torch.int32), tail_k, tail_v,
                       tail_tables.to(torch.int32), scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Same contract as reference.paged_decode_attention (plans, then runs)."""
    plan = plan_paged_decode(seq_lens, num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1],
                             head_dim=q.shape[2], block_size=k_cache.shape[2], device=q.device)
    return plan.run_paged(q, k_cache, v_cache, block_tables.to(torch.int32), scale)
