"""Decode attention in Triton over PQ codes (+ fp16 tail) and over plain fp16 paged KV.

The plan type and its contract: kernels/plan.py. Made by the router (kernels/router.py)
for every shape and dtype, on CUDA wherever the CUDA C++ kernels do not apply; the
kernels themselves: decode_kernels.py. A work item is 4 ints (b, kind, lo, hi): a token
range of one sequence over its PQ blocks (kind 0) or its fp16 blocks (kind 1). A sliding
window only moves where a sequence's ranges start (any token, not only a block's first).
A multi-token plan (query_tokens T > 1) marks the last item of each sequence's fp16
range kind 2: it holds the T new tokens and is read causally (decode_kernels.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kvstore.cuda.pinned import to_device

from .. import tunables
from ..plan import (MULTI_ROWS, DecodePlan, capacity, check_batch, fit, host_lens, pq_ranges, query_rows,
                    range_starts, wide_rows)
from .decode_kernels import _decode_kernel, _merge_kernel

_PQ, _DENSE, _CAUSAL = 0, 1, 2
# A PQ plan's tile and warps where its caller leaves them None: plan_pq says why. Wide
# multi-token blocks take tunables.MTQ_WIDE's instead (set at launch: they depend on the
# codes' bit width).
PQ_TILE, PQ_WARPS = 128, 4


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sms(device.index if device.index is not None else torch.cuda.current_device())
    return 1


@dataclass(slots=True, kw_only=True)
class TritonDecodePlan(DecodePlan):
    """A DecodePlan for decode_kernels.py: items [capacity, 4] (b, kind, lo, hi); the
    merge reads at most max_items items a sequence; the rest are the kernels' tuning
    (tile_pq / num_warps None: the defaults for the codes' bit width, set at launch)."""
    item_width = 4
    max_items: int
    tile_pq: int | None
    tile_fp: int
    num_warps: int | None
    num_stages: int
    maxnreg: int | None = None   # register cap: more resident programs to hide gather latency
    row_block: int = MULTI_ROWS  # query rows a multi-token program takes at most (wide_rows)

    def rows(self, *lens) -> tuple[list[int], list[int]]:
        cap = self.items.shape[0]
        if self.has_pq:
            sl, tl_, ss, ts = pq_ranges(*lens, block_size=self.block_size)
            check_multi(self.query_tokens, tl_, ss + ts, "tail_lens")
            make = lambda c: _pq_items(sl, tl_, c, ss, ts, self.query_tokens)   # noqa: E731
        else:
            sl, st = paged_ranges(*lens)
            check_multi(self.query_tokens, sl, st, "seq_lens")
            tl_ = sl
            make = lambda c: _paged_items(sl, c, st, self.query_tokens)         # noqa: E731
        check_batch(self, sl)
        items, ptr = fit(make, self.chunk0, cap, 4, self.max_items)
        if self.has_pq:
            self.sealed_cols = max([n // self.block_size for n in sl] + [0])
        self.tail_cols = max([triton.cdiv(n, self.tail_block_size) for n in tl_] + [0])
        return items, ptr

    # --------------------------------------------------------------- run
    def run_pq(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
               tail_k, tail_v, tail_tables, scale: float, out=None, lse=None,
               trusted: bool = False, codebook_image=None):
        """DecodePlan.run_pq; trusted skips the checks. Reads no codebook image."""
        if not self.has_pq:
            raise ValueError("plan was made for paged decode; use run_paged")
        if trusted:
            out, lse = self.unchecked_out(q, out, lse)
            m, dsub = k_codebook.shape[1], k_codebook.shape[3]
        else:
            out, lse = self.check_q_out(q, out, lse)
            m, dsub = self.check_codes(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables)
            self.check_pool(tail_k, tail_v, tail_tables, ("tail_k", "tail_v", "tail_tables"), self.tail_cols)
        word = torch.int32 if dsub == 2 else torch.int64
        kw, vw = k_codebook.view(word), v_codebook.view(word)      # no copy
        self._launch(q, out, lse, scale, k_codes, v_codes, kw, vw, sealed_tables,
                     tail_k, tail_v, tail_tables, m, dsub, k_codebook.dtype == torch.bfloat16,
                     tail_k.dtype)
        return out, lse

    def run_paged(self, q, k_cache, v_cache, block_tables, scale: float, out=None, lse=None,
                  trusted: bool = False):
        """DecodePlan.run_paged; trusted skips the checks (~40 µs of a tiny call)."""
        if self.has_pq:
            raise ValueError("plan was made for PQ decode; use run_pq")
        if trusted:
            out, lse = self.unchecked_out(q, out, lse)
        else:
            out, lse = self.check_q_out(q, out, lse)
            self.check_pool(k_cache, v_cache, block_tables, ("k_cache", "v_cache", "block_tables"),
                            self.tail_cols)
        self._launch(q, out, lse, scale, q, q, q, q, block_tables, k_cache, v_cache,
                     block_tables, 16, 2, False, k_cache.dtype)
        return out, lse

    def _launch(self, q, out, lse, scale, kc, vc, kw, vw, st, tk, tv, tt, m, dsub, cb_bf16,
                dense_dtype):
        hq, hkv, t = self.num_qo_heads, self.num_kv_heads, self.query_tokens
        g = hq // hkv
        n_items = self.items.shape[0]
        prec = "ieee" if dense_dtype == torch.float32 else "tf32"
        # T x G rows a KV head; a multi-token plan cuts them into blocks of self.row_block
        gp = max(16, triton.next_power_of_2(g)) if t == 1 else \
            max(16, min(triton.next_power_of_2(t * g), max(self.row_block, triton.next_power_of_2(g))))
        sq_b, sq_t, sq_h = (q.stride(0), 0, q.stride(1)) if t == 1 else (q.stride(0), q.stride(1), q.stride(2))
        tile, warps, maxnreg = self.tile_pq or PQ_TILE, self.num_warps or PQ_WARPS, self.maxnreg
        if self.row_block > MULTI_ROWS:             # tunables.MTQ_WIDE
            wt, ww = tunables.MTQ_WIDE[8 // dsub]
            tile, warps = self.tile_pq or wt, self.num_warps or ww
            maxnreg = None if dsub == 4 else maxnreg
        elif t > 1 and dsub == 4 and self.has_pq:   # tunables.MTQ_2BIT_TILE says why
            tile, maxnreg = min(tile, tunables.MTQ_2BIT_TILE), None
        if n_items > 0:
            _decode_kernel[(n_items, hkv, triton.cdiv(t * g, gp))](
                q, sq_b, sq_t, sq_h, self.items, self.o_part, self.lse_part,
                kc, vc, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                kw, vw, st, st.stride(0),
                tk, tv, tk.stride(0), tk.stride(1), tk.stride(2),
                tv.stride(0), tv.stride(1), tv.stride(2), tt, tt.stride(0),
                scale * 1.4426950408889634, self.softcap * 1.4426950408889634, hq, t,
                MULTI=t > 1, G=g, GP=gp, D=self.head_dim, M=m, DSUB=dsub,
                BS=self.block_size, TBS=self.tail_block_size, TILE_PQ=tile,
                TILE_FP=self.tile_fp, HAS_PQ=self.has_pq, CB_BF16=cb_bf16, PREC=prec,
                SOFTCAP=self.softcap > 0,
                num_warps=warps, num_stages=self.num_stages, maxnreg=maxnreg)
        # rows (token, head) of out / lse are contiguous over both (check_q_out): one index
        _merge_kernel[(self.batch, t * hq)](
            self.o_part, self.lse_part, self.item_ptr, out, out.stride(0), out.stride(-2),
            lse, lse.stride(0), t * hq, D=self.head_dim, MAX_ITEMS=self.max_items, num_warps=4)


# ---------------------------------------------------------------------- plan

def paged_ranges(seq_lens, starts=None):
    sl = host_lens(seq_lens, "seq_lens")
    return sl, range_starts(starts, sl, "starts")


def _chunk(total: int, n_fixed: int, hkv: int, tile: int, target_ctas: int) -> int:
    """Tokens per split: about target_ctas programs in all, whole tiles, >= 4 tiles."""
    items = max(1, target_ctas // hkv - n_fixed)
    return max(4 * tile, triton.cdiv(triton.cdiv(max(total, 1), items), tile) * tile)


def _finish(items, ptr, batch, hq, d, device, cap=None, query_tokens=1, **kw) -> TritonDecodePlan:
    n = len(items) // 4
    per_seq = max([ptr[i + 1] - ptr[i] for i in range(batch)] + [1])
    dev = torch.device(device)
    if cap is not None:         # room for update(): a fixed count and merge width
        items = items + [0] * (4 * (cap - n))
        n, per_seq = cap, cap
    return TritonDecodePlan(
        items=to_device(torch.tensor(items, dtype=torch.int32).reshape(n, 4), dev),
        item_ptr=to_device(torch.tensor(ptr, dtype=torch.int32), dev),
        o_part=torch.empty(max(n, 1), query_tokens * hq, d, dtype=torch.float32, device=dev),
        lse_part=torch.empty(max(n, 1), query_tokens * hq, dtype=torch.float32, device=dev),
        batch=batch, num_qo_heads=hq, head_dim=d, max_items=triton.next_power_of_2(per_seq),
        query_tokens=query_tokens, **kw)


def _dense_items(b: int, lo: int, n: int, chunk: int, t: int) -> list[int]:
    """Items over fp16 tokens [lo, n) of sequence b. t > 1 (a multi-token plan): the last
    item is kind 2 and starts at least t tokens before n, so it holds every new token and
    each of its query rows sees at least one token."""
    starts = list(range(lo, n, chunk))
    if t > 1 and len(starts) > 1 and n - starts[-1] < t:
        starts.pop()
    ends = starts[1:] + [n]
    return [x for j, (a, e) in enumerate(zip(starts, ends))
            for x in (b, _CAUSAL if t > 1 and j == len(starts) - 1 else _DENSE, a, e)]


def _pq_items(sl, tl_, chunk, ss, ts, t=1):
    items, ptr = [], [0]
    for b, (ns, nt) in enumerate(zip(sl, tl_)):
        for lo in range(ss[b], ns, chunk):
            items += [b, _PQ, lo, min(ns, lo + chunk)]
        items += _dense_items(b, ts[b], nt, 4096, t)     # the tail is short; cap keeps items bounded
        ptr.append(len(items) // 4)
    return items, ptr


def check_multi(t: int, dense_lens: list[int], starts: list[int] | None, name: str) -> None:
    """A multi-token plan's lengths: every fp16 range holds its t new tokens, no window."""
    if t > 1 and starts is not None and any(starts):
        raise ValueError("sliding windows: a multi-token plan does not take start indices")
    if t > 1 and any(n < t for n in dense_lens):
        raise ValueError(f"{name}: each sequence's fp16 range must hold its {t} new tokens")


def plan_pq(sl: list[int], tl_: list[int], ss: list[int] | None = None, ts: list[int] | None = None, *,
            num_qo_heads: int, num_kv_heads: int,
            head_dim: int, block_size: int, tail_block_size: int, device,
            target_ctas: int | None = None, tile_pq: int | None = None, tile_fp: int = 32,
            num_warps: int | None = None, num_stages: int = 1, maxnreg: int | None = 128,
            spare_items: int | None = None, softcap: float = 0.0, query_tokens: int = 1) -> TritonDecodePlan:
    """sl / tl_: checked host lists of sealed (multiples of block_size) / tail lengths;
    ss / ts: the window's start in each (None: zeros). query_tokens T > 1: the last T
    tail tokens of each sequence are its new tokens, attended causally.
    spare_items (None: a one-step plan): room for that many more work items (at least
    B) and a fixed merge width, for update().

    Defaults (tile_pq / num_warps None: PQ_TILE / PQ_WARPS, 128 / 4) are the fastest of a sweep of these
    parameters on an H100 (docs/kernels.md): the code -> centroid gathers are
    latency-bound, so many small-register programs (~8 per SM at 128 registers) with
    128-token tiles keep the most loads in flight. A multi-token plan of wide row blocks
    (wide_rows) takes tunables.MTQ_WIDE's tiles and warps and about MTQ_WIDE_PROGRAMS
    programs per SM."""
    rows = wide_rows(query_tokens, num_qo_heads, num_kv_heads, head_dim)
    if target_ctas is None:
        target_ctas = 8 * _num_sms(torch.device(device))
        if rows > MULTI_ROWS:    # programs = items x Hkv x row blocks
            blocks = triton.cdiv(query_rows(query_tokens, num_qo_heads, num_kv_heads), rows)
            target_ctas = max(num_kv_heads, tunables.MTQ_WIDE_PROGRAMS * _num_sms(torch.device(device)) // blocks)
    sl, tl_, ss, ts = pq_ranges(sl, tl_, ss, ts, block_size=block_size)
    check_multi(query_tokens, tl_, ss + ts, "tail_lens")
    chunk = _chunk(sum(sl) - sum(ss), sum(1 for n, a in zip(tl_, ts) if n > a), num_kv_heads,
                   tile_pq or PQ_TILE, target_ctas)
    items, ptr = _pq_items(sl, tl_, chunk, ss, ts, query_tokens)
    return _finish(items, ptr, len(sl), num_qo_heads, head_dim, device,
                   cap=capacity(len(items) // 4, len(sl), spare_items), query_tokens=query_tokens,
                   num_kv_heads=num_kv_heads, block_size=block_size,
                   tail_block_size=tail_block_size,
                   sealed_cols=max([n // block_size for n in sl] + [0]),
                   tail_cols=max([triton.cdiv(n, tail_block_size) for n in tl_] + [0]),
                   has_pq=True, tile_pq=tile_pq, tile_fp=tile_fp, softcap=softcap,
                   num_warps=num_warps, num_stages=num_stages, chunk0=chunk, row_block=rows,
                   # ptxas cannot fit a head_dim-256 multi-token tile in 128 registers
                   # (C7602 asks for 158): the cap is for the one-token decode it was tuned on.
                   maxnreg=maxnreg if query_tokens == 1 or head_dim <= 128 else None)


def _paged_items(sl, chunk, st, t=1):
    items, ptr = [], [0]
    for b, n in enumerate(sl):
        items += _dense_items(b, st[b], n, chunk, t)
        ptr.append(len(items) // 4)
    return items, ptr


def plan_paged(sl: list[int], st: list[int] | None = None, *, num_qo_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, device, target_ctas: int | None = None, tile: int = 128,
               num_warps: int = 4, num_stages: int = 3,
               spare_items: int | None = None, softcap: float = 0.0, query_tokens: int = 1) -> TritonDecodePlan:
    """sl: host list of sequence lengths; st: the window's start in each (None: zeros);
    spare_items and query_tokens as in plan_pq. Defaults from
    a sweep on an H100 (tile 128, 4 x SMs work items: 0.98x / 0.95x SDPA
    flash at B=8, 32K / 128K, against 0.93x with tile 64 and 2 x SMs)."""
    if target_ctas is None:
        target_ctas = 4 * _num_sms(torch.device(device))
    sl, st = paged_ranges(sl, st)
    check_multi(query_tokens, sl, st, "seq_lens")
    chunk = _chunk(sum(sl) - sum(st), 0, num_kv_heads, tile, target_ctas)
    items, ptr = _paged_items(sl, chunk, st, query_tokens)
    return _finish(items, ptr, len(sl), num_qo_heads, head_dim, device,
                   cap=capacity(len(items) // 4, len(sl), spare_items), query_tokens=query_tokens,
                   num_kv_heads=num_kv_heads, block_size=block_size,
                   tail_block_size=block_size, sealed_cols=0,
                   tail_cols=max([triton.cdiv(n, block_size) for n in sl] + [0]),
                   has_pq=False, tile_pq=64, tile_fp=tile, softcap=softcap,
                   num_warps=num_warps, num_stages=num_stages, chunk0=chunk)
