"""What every decode plan is, and the helpers every backend's plans share.

Plan/run split as in FlashInfer's BatchDecodeWithPagedKVCacheWrapper (docs/design.md, Write path, Read path):

    plan = router.plan_decode("pq", sealed_lens, tail_lens, num_qo_heads=32, ...)  # once a step
    out, lse = plan.run_pq(q, k_codes, v_codes, k_cb, v_cb, sealed_tables,
                           tail_k, tail_v, tail_tables, scale, out=out, lse=lse)   # per layer

Planning reads the lengths on the host, cuts every sequence into work items (split-K over
its tokens) and allocates the partial-result workspace. A run checks metadata and
launches an attention kernel and a log-sum-exp merge: it allocates nothing when `out` and
`lse` are given, never synchronises, and can be captured in a CUDA graph; update()
refills the same buffers for new lengths, so a captured graph replays the new step.
Semantics are those of reference.pq_decode_attention / paged_decode_attention.

A multi-token plan (query_tokens T in 2..128: speculative-decoding verify, a prefill chunk
after a cached prefix) takes q [B, T, Hq, d] and returns out [B, T, Hq, d], lse [B, T, Hq]:
the last T tokens of each sequence's fp16 range (the tail, or the paged sequence) are
the T new tokens, already written, and query i sees everything before them and new
tokens 0..i (reference.pq_multi_attention / paged_multi_attention). PQ plans on the CUDA
C++ kernel (cuda/attention.py query_groups) or Triton, paged plans on Triton; no sliding
windows.

A layer with a sliding window or chunked attention plans with start indices after the
lengths: ("pq") (sealed_lens, tail_lens, sealed_starts, tail_starts), ("paged")
(seq_lens, starts); window_start / pq_window_starts turn a window or chunk into them.
`softcap` (> 0: scores go through softcap * tanh(s / softcap)) is a plan parameter.

This module imports neither Triton nor CuPy: the router and both backends import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstore.cuda.pinned import copy_into

from . import tunables

FLOAT = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)      # what every GPU decode plan takes (Triton; CUDA C++ 64 and 128)
# Query tokens a sequence of a multi-token plan may bring: a prefill chunk as long as a
# pq cache's default residual (128; the engine also bounds T by residual + 1). Each call
# carries host work besides its kernel, so a 1K-token prompt suffix in chunks of 128 makes
# 8x fewer calls than in chunks of 16 (docs/kernels.md, Time to first token).
MAX_QUERY_TOKENS = 128
# Query rows (T tokens x G query heads of one KV head) a Triton multi-token program takes at
# most; a PQ plan with more rows takes wider blocks (wide_rows), and the router sends a PQ
# plan to Triton for its many rows only where they are wide (kernels/router.py).
MULTI_ROWS = 64


@dataclass(slots=True, kw_only=True)
class DecodePlan:
    """One decode step's work partition and workspace, shared by every layer.

    items [capacity, item_width] int32: the work items, in the backend's row format
    (item_width ints each: 4 for Triton, 5 for CUDA C++); rows past item_ptr[-1] are
    empty. item_ptr [B + 1] int32: sequence b's items are item_ptr[b]:item_ptr[b + 1]
    (a CUDA multi-token plan: [B x query groups + 1], cuda/attention.py).
    o_part fp32 [capacity, Hq, d] and lse_part fp32 [capacity, Hq]: the partials the
    merge combines. A caller may point items and item_ptr at views of its own buffer of
    the same shapes (kvstore/decode_graphs.py packs them with the block tables)."""
    item_width: ClassVar[int]
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
    sealed_cols: int         # block-table columns the plan needs (rows() keeps them current)
    tail_cols: int
    has_pq: bool
    chunk0: int              # split size the plan was made with (rows() starts there)
    softcap: float = 0.0     # > 0: every score s becomes softcap * tanh(s / softcap)
    query_tokens: int = 1    # T query tokens per sequence (> 1: causal among them; q [B, T, Hq, d])

    @property
    def capacity(self) -> int:
        """Work items the plan has room for (update() never grows it)."""
        return self.items.shape[0]

    def update(self, *lens) -> "DecodePlan":
        """Re-partition for new lengths (same batch) into this plan's own buffers.

        For CUDA graphs: the item count, workspace and merge width stay those of the
        plan (splits grow until the items fit; unused items are empty and never merged),
        so a graph captured with this plan replays correctly after update(). Arguments
        as the plan's: (sealed_lens, tail_lens[, sealed_starts, tail_starts]) for a PQ plan,
        (seq_lens[, starts]) for a paged one."""
        items, ptr = self.rows(*lens)
        copy_into(self.items, torch.tensor(items, dtype=torch.int32))
        copy_into(self.item_ptr, torch.tensor(ptr, dtype=torch.int32))
        return self

    def rows(self, *lens) -> tuple[list[int], list[int]]:
        """update() on the host: (items, item_ptr) as flat lists for the new lengths, items
        padded to capacity, for a caller that copies them in itself. ValueError when the
        lengths need more items than the plan has room for."""
        raise NotImplementedError

    def run_pq(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, tail_k, tail_v,
               tail_tables, scale: float, out=None, lse=None, trusted: bool = False,
               codebook_image=None):
        """q [B, Hq, d]; k_codes [nb, Hkv, bs, M] u8; v_codes [nb, Hkv, M, bs] u8;
        k/v_codebook [Hkv, M, 256, dsub] fp16|bf16 (dsub 2 or 4); sealed_tables [B, >=S]
        int32; tail_k/v [nt, Hkv, tbs, d]; tail_tables [B, >=T] int32 -> (out [B, Hq, d] in
        q's dtype, lse [B, Hq] fp32). trusted: the caller made every argument to this plan's
        measure (the engine, from its own pools): skip the shape checks. codebook_image:
        this layer's cuda.images.CodebookImage, kept current by the codebooks' owner (the
        CUDA plan stages codebooks from it by bulk copies; others ignore it)."""
        raise ValueError("plan was made for paged decode; use run_paged")

    def run_paged(self, q, k_cache, v_cache, block_tables, scale: float, out=None, lse=None,
                  trusted: bool = False):
        """q [B, Hq, d]; k/v_cache [nb, Hkv, bs, d]; block_tables [B, >=S] int32
        -> (out [B, Hq, d] in q's dtype, lse [B, Hq] fp32); trusted as in run_pq."""
        raise ValueError("plan was made for PQ decode; use run_pq")

    def check_q_out(self, q, out, lse):
        """Checked (out, lse), allocated when None. A multi-token plan: q [B, T, Hq, d],
        out [B, T, Hq, d] and lse [B, T, Hq] each contiguous over (T, Hq) (the merge
        indexes their rows as one)."""
        b, hq, d, t = self.batch, self.num_qo_heads, self.head_dim, self.query_tokens
        rows = (b, hq) if t == 1 else (b, t, hq)
        check(q, "q", rows + (d,), FLOAT, self.items.device)
        if out is None:
            out = torch.empty(rows + (d,), dtype=q.dtype, device=q.device)
        else:
            check(out, "out", rows + (d,), (q.dtype,), q.device)
        if lse is None:
            lse = torch.empty(rows, dtype=torch.float32, device=q.device)
        else:
            check(lse, "lse", rows, (torch.float32,), q.device, last=t > 1)
        if t > 1 and (out.stride(1) != hq * out.stride(2) or lse.stride(1) != hq):
            raise ValueError("out / lse must be contiguous over their (T, Hq) dims")
        return out, lse

    @staticmethod
    def unchecked_out(q, out, lse):
        """(out, lse) for a trusted run: allocated when None (out like q, lse fp32 over q's
        rows), not checked."""
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if lse is None else lse
        return out, lse

    def check_codes(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables) -> tuple[int, int]:
        """The PQ arguments' checks -> (M, dsub)."""
        hkv, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        if k_codebook.dim() != 4:
            raise ValueError(f"k_codebook must be [Hkv, M, 256, dsub], got {tuple(k_codebook.shape)}")
        m, dsub = k_codebook.shape[1], k_codebook.shape[3]
        if dsub not in (2, 4) or m * dsub != d:
            raise ValueError(f"k_codebook: need dsub in (2, 4) and M*dsub == head_dim, got M={m} dsub={dsub}")
        for name, cb in (("k_codebook", k_codebook), ("v_codebook", v_codebook)):
            check(cb, name, (hkv, m, 256, dsub), HALF, q.device, contiguous=True)
        if v_codebook.dtype != k_codebook.dtype:
            raise ValueError("v_codebook must have k_codebook's dtype")
        nb = k_codes.shape[0] if k_codes.dim() == 4 else -1
        check(k_codes, "k_codes", (nb, hkv, bs, m), (torch.uint8,), q.device)
        check(v_codes, "v_codes", (nb, hkv, m, bs), (torch.uint8,), q.device)
        if k_codes.stride(2) != m or v_codes.stride(2) != bs:
            raise ValueError("k_codes / v_codes: each (block, head) slice must be contiguous")
        check_table(sealed_tables, "sealed_tables", self.batch, self.sealed_cols, q.device)
        return m, dsub

    def check_pool(self, k, v, tables, names, cols, same_strides: bool = True):
        """An fp16 pool pair [nb, Hkv, tbs, d] and its block table (k and v with the same
        strides, where the kernel reads both through one set)."""
        nb = k.shape[0] if k.dim() == 4 else -1
        shape = (nb, self.num_kv_heads, self.tail_block_size, self.head_dim)
        check(k, names[0], shape, FLOAT, self.items.device)
        check(v, names[1], shape, (k.dtype,), k.device)
        if same_strides and k.stride() != v.stride():
            raise ValueError(f"{names[0]} and {names[1]} must have the same strides")
        check_table(tables, names[2], self.batch, cols, k.device)


# ------------------------------------------------------------ multi-token rows

def query_rows(query_tokens: int, num_qo_heads: int, num_kv_heads: int) -> int:
    """T x G: the query rows of one KV head (heads not yet validated count one KV head)."""
    return query_tokens * (num_qo_heads // max(num_kv_heads, 1))


def wide_rows(query_tokens: int, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Query rows a Triton program of a multi-token PQ plan takes at most:
    tunables.MTQ_WIDE_ROWS where a KV head's T x G rows are more than MULTI_ROWS (each
    program decodes its codes once for them all) and head_dim <= 128 (a wider tile of d
    256 was not measured), else MULTI_ROWS."""
    wide = query_tokens > 1 and head_dim <= 128 and \
        query_rows(query_tokens, num_qo_heads, num_kv_heads) > MULTI_ROWS
    return tunables.MTQ_WIDE_ROWS if wide else MULTI_ROWS


# -------------------------------------------------------------------- checks

def check(t, name, shape, dtypes, device, last=True, contiguous=False):
    """t is a tensor of shape (-1: any size), dtype and device as given, contiguous in
    its last dim (last) or whole (contiguous); else ValueError naming it."""
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


def check_table(t, name, batch, cols, device):
    check(t, name, (batch, -1), (torch.int32,), device)
    if t.shape[1] < cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, the plan needs {cols}")


def check_encode_args(x, slots, k_codes, v_codes, hkv: int, m: int, dsub: int, device):
    """The checks every encode launcher makes -> (codes, block_size, offset
    stride, subspace stride) of the one code tensor given."""
    if (k_codes is None) == (v_codes is None):
        raise ValueError("give exactly one of k_codes or v_codes")
    if x.dim() != 3 or x.shape[1] != hkv or x.shape[2] != m * dsub:
        raise ValueError(f"x must be [N, {hkv}, {m * dsub}], got {tuple(x.shape)}")
    if x.dtype not in FLOAT or x.stride(2) != 1:
        raise ValueError("x must be fp16/bf16/fp32 and contiguous in its last dim")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [{x.shape[0]}], got {slots.dtype} {tuple(slots.shape)}")
    codes, name = (k_codes, "k_codes") if k_codes is not None else (v_codes, "v_codes")
    if codes.dtype != torch.uint8 or codes.dim() != 4 or codes.shape[1] != hkv:
        raise ValueError(f"{name} must be uint8 [nb, {hkv}, ., .], got {codes.dtype} {tuple(codes.shape)}")
    for t, nm in ((x, "x"), (slots, "slots"), (codes, name)):
        if t.device != device:
            raise ValueError(f"{nm} is on {t.device}, the plan on {device}")
    if k_codes is not None:
        if k_codes.shape[3] != m:
            raise ValueError(f"k_codes last dim must be M={m}")
        return k_codes, k_codes.shape[2], k_codes.stride(2), k_codes.stride(3)
    if v_codes.shape[2] != m:
        raise ValueError(f"v_codes dim 2 must be M={m}")
    return v_codes, v_codes.shape[3], v_codes.stride(3), v_codes.stride(2)


def check_encode_layers(x, layers: int, k_codes, v_codes) -> None:
    """An encode of every layer at once: x [L, N, Hkv, d] and the one code tensor given
    [L, nb, ...], L the codebooks' layers (the per-layer checks follow: check_encode_args)."""
    codes, name = (k_codes, "k_codes") if k_codes is not None else (v_codes, "v_codes")
    if x.dim() != 4 or x.shape[0] != layers:
        raise ValueError(f"x must be [{layers}, N, Hkv, d] for codebooks of {layers} layers, got {tuple(x.shape)}")
    if codes is None or codes.dim() != 5 or codes.shape[0] != layers:
        raise ValueError(f"{name} must be [{layers}, nb, ...] for codebooks of {layers} layers, got "
                         f"{None if codes is None else tuple(codes.shape)}")


def validate_heads(hq: int, hkv: int, d: int) -> None:
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 64, 128 or 256, got {d}")


# ---------------------------------------------------------------- partition

def host_lens(x, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]                       # plan may sync
    return [int(v) for v in x]


def pq_lens(sealed_lens, tail_lens, *, block_size: int) -> tuple[list[int], list[int]]:
    """Checked host lists of a PQ plan's lengths."""
    sl, tl_ = host_lens(sealed_lens, "sealed_lens"), host_lens(tail_lens, "tail_lens")
    if len(sl) != len(tl_):
        raise ValueError("sealed_lens and tail_lens must have the same length")
    if any(n % block_size or n < 0 for n in sl):
        raise ValueError(f"sealed_lens must be non-negative multiples of block_size={block_size}")
    if any(n < 0 for n in tl_):
        raise ValueError("tail_lens must be non-negative")
    return sl, tl_


def pq_ranges(sealed_lens, tail_lens, sealed_starts=None, tail_starts=None, *, block_size: int):
    """A PQ plan's lengths (and window starts) -> checked host lists (sl, tl_, ss, ts)."""
    sl, tl_ = pq_lens(sealed_lens, tail_lens, block_size=block_size)
    return (sl, tl_, range_starts(sealed_starts, sl, "sealed_starts"),
            range_starts(tail_starts, tl_, "tail_starts"))


def range_starts(starts, lens: list[int], name: str) -> list[int]:
    """Checked host list of per-sequence start indices into ranges of these lengths
    (None: zeros): 0 <= start <= len."""
    if starts is None:
        return [0] * len(lens)
    st = host_lens(starts, name)
    if len(st) != len(lens) or any(not 0 <= a <= n for a, n in zip(st, lens)):
        raise ValueError(f"{name} must hold one start in [0, length] per sequence")
    return st


def window_start(length: int, window: int, chunk: int = 0) -> int:
    """The first position a decode query at position length - 1 reads under a sliding
    window of `window` tokens (0: none) or in chunks of `chunk` tokens (0: none).
    transformers' conventions (masking_utils): a window is the last `window` positions,
    the query's own included (sliding_window_overlay: kv_idx > q_idx - window); a chunk
    the positions of the query's own chunk up to it (chunked_overlay: kv_idx // chunk ==
    q_idx // chunk, Llama 4's attention_chunk_size)."""
    if chunk:
        return (length - 1) // chunk * chunk if length else 0
    return max(0, length - window) if window else 0


def pq_window_starts(length: int, window: int, sinks: int, sealed_tokens: int,
                     chunk: int = 0) -> tuple[int, int]:
    """(sealed start, tail start) of a PQ sequence's window, in the kernels' coordinates
    (core/sequence.py's layout): the tail table holds positions [0, sinks) and then
    [sinks + sealed_tokens, length); the sealed blocks [sinks, sinks + sealed_tokens).
    A window is a suffix of positions, so it is a suffix of each range: sink tokens
    outside it are not read (a windowed layer never sees them). A chunk likewise."""
    ws = window_start(length, window, chunk)
    if ws < sinks:
        return 0, ws
    if ws < sinks + sealed_tokens:
        return ws - sinks, sinks
    return sealed_tokens, ws - sealed_tokens


def check_batch(plan: DecodePlan, lens: list[int]) -> None:
    if len(lens) != plan.batch:
        raise ValueError(f"update: the plan is for a batch of {plan.batch}, got {len(lens)} lengths")


def fit(make, chunk: int, cap: int | None, width: int, max_per_seq: int | None = None):
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


def capacity(n: int, batch: int, spare_items: int | None) -> int | None:
    """Item capacity of a plan meant for update(): what it needs now plus room."""
    return None if spare_items is None else n + max(spare_items, batch)


def ceil(a: int, b: int) -> int:
    return -(-a // b)
