"""The one place that picks a backend for every kernel op.

Three backends: the torch reference (reference.py) off the GPU; the CUDA C++ kernels
(cuda/: cupy, sm_80+, the shapes and dtypes they take) where they apply, being the
fastest; the Triton kernels (triton/) for everything else on CUDA. The choice is made
from what the caller states up front (device, geometry, dtypes, q's alignment), so a
plan never swaps itself for another at run time: `decode_backend` and `encode_backend`
say which, and every entry point below goes through them.

    plan = plan_decode("pq", sealed_lens, tail_lens, num_qo_heads=32, num_kv_heads=8,
                       head_dim=128, block_size=16, tail_block_size=16, device=dev,
                       dtype=q.dtype, aligned=query_aligned(q))     # once a step
    out, lse = plan.run_pq(q, ...)                                   # per layer (plan.py)

Sliding windows (start indices after the lengths, plan.py) and logit soft-capping run on
every backend: the CUDA C++ plan runs them on builds of its kernel of their own (a window's
first PQ tile masked, scores capped), so the choice of backend does not depend on them
(docs/kernels.md, Sliding windows).

Multi-token queries (plan_decode(query_tokens=T), T in 2..128: T new tokens per sequence,
causal among them, plan.py) take the same choice, but for the number of query rows: the
CUDA C++ kernel runs groups of at most 8 of a KV head's T x G query rows as its MMA rows
(cuda/attention.py query_groups), decoding the codes once a group; from
tunables.MTQ_TRITON_ROWS rows on, Triton's blocks of 128 rows (plan.py wide_rows) take
the plan.

Entry points with reference.py's signatures (pq_decode_attention, paged_decode_attention,
pq_multi_attention, paged_multi_attention, pq_encode_to_slots, gather_pq_blocks, write_slots) plan and run in one call: the engine's
hot path holds plans instead. Triton and CuPy are imported on first use only: a CPU
install never imports either.
"""
from __future__ import annotations

import math

import torch

from . import reference, tunables
from .cuda import attention as cuda_attention
from .cuda import build as cuda_build
from .cuda import encode as cuda_encode
from .cuda import images as cuda_images
from .plan import (HALF, HEAD_DIMS, MAX_QUERY_TOKENS, MULTI_ROWS, DecodePlan, check_encode_layers, host_lens,
                   pq_lens, query_rows, validate_heads, wide_rows)

REFERENCE, CUDA, TRITON = "reference", "cuda", "triton"
KINDS = ("pq", "paged")


def query_aligned(q: torch.Tensor) -> bool:
    """q meets the CUDA attention kernel's alignment (4-byte rows, even strides): what
    plan_decode's `aligned` asks of a caller whose q may sit anywhere in a buffer."""
    return cuda_attention.query_aligned(q)


def decode_backend(kind: str, *, device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                   codebook_dtype: torch.dtype | None = None, aligned: bool = True,
                   backend: str = "auto", query_tokens: int = 1) -> str:
    """REFERENCE, CUDA or TRITON for a decode of this kind ("pq" or "paged").

    dtype: that of q and out; kv_dtype and codebook_dtype (default: dtype): those of the
    fp16 tail or pool and of the PQ codebooks. aligned: q and the pools meet the CUDA kernels' alignment
    (query_aligned(q); pools the engine or a client allocates always do). backend:
    "auto", or "cuda" / "triton" to insist (the benches and tests); "cuda" where the
    CUDA kernels do not apply is a ValueError. Sliding windows and soft-capping do not
    enter the choice: every backend takes both. query_tokens: > 1 for a multi-token
    plan, which every backend takes; a PQ plan whose T x G query rows per KV head reach
    tunables.MTQ_TRITON_ROWS and make wide row blocks (plan.wide_rows) goes to Triton."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if backend not in ("auto", CUDA, TRITON):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'triton', got {backend!r}")
    if backend == TRITON:
        return TRITON
    if (backend == "auto" and kind == "pq" and tunables.MTQ_TRITON_ROWS
            and wide_rows(query_tokens, num_qo_heads, num_kv_heads, head_dim) > MULTI_ROWS
            and query_rows(query_tokens, num_qo_heads, num_kv_heads) >= tunables.MTQ_TRITON_ROWS
            and torch.device(device).type == "cuda"):
        return TRITON        # many query rows a KV head: tunables.MTQ_TRITON_ROWS says why
    if kind == "pq" and aligned and cuda_attention.supports(
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, device=device, dtype=dtype,
            kv_dtype=dtype if kv_dtype is None else kv_dtype,
            codebook_dtype=dtype if codebook_dtype is None else codebook_dtype):
        return CUDA
    if backend == CUDA:
        raise ValueError("backend='cuda': cupy is missing, or the CUDA kernels do not take this "
                         "kind, shape, dtype or alignment")
    return TRITON if torch.device(device).type == "cuda" else REFERENCE


def plan_decode(kind: str, *lens, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, device, dtype: torch.dtype, tail_block_size: int | None = None,
                kv_dtype: torch.dtype | None = None, codebook_dtype: torch.dtype | None = None,
                aligned: bool = True, spare_items: int | None = None, backend: str = "auto",
                target_ctas: int | None = None, softcap: float = 0.0, query_tokens: int = 1,
                **triton_tuning) -> DecodePlan:
    """The plan of one decode step (plan.py: run_pq / run_paged per layer, update()).

    kind "pq": lens = (sealed_lens [B] multiples of block_size, tail_lens [B]), with
    tail_block_size the fp16 tail's block size; "paged": lens = (seq_lens [B],). Host
    lists or tensors (read on the host). A layer with a sliding window adds the start
    index of each range after them (plan.pq_window_starts / window_start): ("pq")
    (sealed_lens, tail_lens, sealed_starts, tail_starts), ("paged") (seq_lens, starts);
    its plan's update() takes the same four / two. softcap: > 0 caps every score s to
    softcap * tanh(s / softcap). query_tokens T in 2..128: a multi-token plan (plan.py),
    whose last T tokens of each sequence's fp16 range (tail_lens / seq_lens count them)
    are its new tokens; no start indices. Choice of backend: decode_backend. spare_items
    (None: a one-step plan) keeps room for that many more work items (at least B) and
    a fixed merge width, so later steps update() its buffers and a CUDA graph captured
    with it replays them. target_ctas: the grid size the partition aims at (default:
    the backend's); triton_tuning: the Triton kernels' tile_pq, tile_fp, tile,
    num_warps, num_stages, maxnreg, unused by the CUDA plan.

    Decode plans run on CUDA (on a CPU device only backend="triton", which runs under
    TRITON_INTERPRET in the tests); off the GPU use pq_decode_attention /
    paged_decode_attention, the reference."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    validate_heads(num_qo_heads, num_kv_heads, head_dim)
    n_lens = 2 if kind == "pq" else 1
    if len(lens) not in (n_lens, 2 * n_lens):
        raise ValueError(f"a {kind!r} plan takes "
                         f"{'(sealed_lens, tail_lens[, sealed_starts, tail_starts])' if kind == 'pq' else '(seq_lens[, starts])'}")
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap}")
    if not (isinstance(query_tokens, int) and 1 <= query_tokens <= MAX_QUERY_TOKENS):
        raise ValueError(f"query_tokens must be in [1, {MAX_QUERY_TOKENS}], got {query_tokens!r}")
    if len(lens) == 2 * n_lens and query_tokens > 1:
        raise ValueError("sliding windows: a multi-token plan does not take start indices")
    if kind == "pq":
        if tail_block_size is None:
            raise ValueError("a 'pq' plan needs tail_block_size")
        sl, tl_ = pq_lens(*lens[:2], block_size=block_size)
    else:
        sl = host_lens(lens[0], "seq_lens")
    which = decode_backend(kind, device=device, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, block_size=block_size, dtype=dtype, kv_dtype=kv_dtype,
                           codebook_dtype=codebook_dtype, aligned=aligned, backend=backend,
                           query_tokens=query_tokens)
    geo = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
               block_size=block_size, device=device, target_ctas=target_ctas, spare_items=spare_items)
    if which == CUDA:
        return cuda_attention.plan_pq(sl, tl_, *lens[2:], tail_block_size=tail_block_size, dtype=dtype,
                                      softcap=softcap, query_tokens=query_tokens, **geo)
    if which == REFERENCE:
        raise ValueError(f"decode plans run on CUDA devices, not {torch.device(device)}: use "
                         "pq_decode_attention / paged_decode_attention (the reference) there")
    from .triton import decode as triton_decode
    if kind == "pq":
        return triton_decode.plan_pq(sl, tl_, *lens[2:], tail_block_size=tail_block_size, softcap=softcap,
                                     query_tokens=query_tokens, **geo, **triton_tuning)
    return triton_decode.plan_paged(sl, *lens[1:], softcap=softcap, query_tokens=query_tokens, **geo,
                                    **triton_tuning)


def _pq_operands(q, k_codes, v_codes, k_codebook, v_codebook, tail_k, tail_v):
    """-> (k_codebook, v_codebook, aligned): the codebooks as the kernels read them (fp16/bf16,
    contiguous; others in q's dtype, fp16 for an fp32 q) and whether q, the codes and the tail
    meet the CUDA kernels' alignment."""
    cb_dt = q.dtype if q.dtype in HALF else torch.float16
    kcb, vcb = (c if c.dtype in HALF else c.to(cb_dt) for c in (k_codebook, v_codebook))
    kcb, vcb = kcb.contiguous(), vcb.to(kcb.dtype).contiguous()
    dsub = kcb.shape[-1] if kcb.dim() == 4 else 2
    return kcb, vcb, cuda_attention.misaligned(q, k_codes, v_codes, tail_k, tail_v, dsub) is None


def pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                        tail_k, tail_v, tail_tables, tail_lens, scale, sealed_starts=None, tail_starts=None,
                        softcap: float = 0.0):
    """reference.pq_decode_attention's contract, on whichever backend applies."""
    if q.device.type != "cuda":
        return reference.pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
                                             sealed_lens, tail_k, tail_v, tail_tables, tail_lens, scale,
                                             sealed_starts, tail_starts, softcap)
    starts = () if sealed_starts is None and tail_starts is None else (sealed_starts, tail_starts)
    kcb, vcb, aligned = _pq_operands(q, k_codes, v_codes, k_codebook, v_codebook, tail_k, tail_v)
    sealed_tables, tail_tables = sealed_tables.to(torch.int32), tail_tables.to(torch.int32)
    plan = plan_decode("pq", sealed_lens, tail_lens, *starts, num_qo_heads=q.shape[1],
                       num_kv_heads=k_codes.shape[1], head_dim=q.shape[2], block_size=k_codes.shape[2],
                       tail_block_size=tail_k.shape[2], device=q.device, dtype=q.dtype, softcap=softcap,
                       kv_dtype=tail_k.dtype, codebook_dtype=kcb.dtype, aligned=aligned)
    return plan.run_pq(q, k_codes, v_codes, kcb, vcb, sealed_tables, tail_k, tail_v, tail_tables, scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, starts=None,
                           softcap: float = 0.0):
    """reference.paged_decode_attention's contract, on whichever backend applies."""
    if q.device.type != "cuda":
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, starts,
                                                softcap)
    plan = plan_decode("paged", seq_lens, *(() if starts is None else (starts,)), num_qo_heads=q.shape[1],
                       num_kv_heads=k_cache.shape[1], head_dim=q.shape[2], block_size=k_cache.shape[2],
                       device=q.device, dtype=q.dtype, softcap=softcap)
    return plan.run_paged(q, k_cache, v_cache, block_tables.to(torch.int32), scale)


def pq_multi_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                       tail_k, tail_v, tail_tables, tail_lens, scale, softcap: float = 0.0):
    """reference.pq_multi_attention's contract (q [B, T, Hq, d]), on whichever backend
    applies."""
    if q.device.type != "cuda":
        return reference.pq_multi_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
                                            sealed_lens, tail_k, tail_v, tail_tables, tail_lens, scale, softcap)
    kcb, vcb, aligned = _pq_operands(q, k_codes, v_codes, k_codebook, v_codebook, tail_k, tail_v)
    plan = plan_decode("pq", sealed_lens, tail_lens, num_qo_heads=q.shape[2], num_kv_heads=k_codes.shape[1],
                       head_dim=q.shape[3], block_size=k_codes.shape[2], tail_block_size=tail_k.shape[2],
                       device=q.device, dtype=q.dtype, kv_dtype=tail_k.dtype, codebook_dtype=kcb.dtype,
                       softcap=softcap, query_tokens=q.shape[1], aligned=aligned)
    return plan.run_pq(q, k_codes, v_codes, kcb, vcb, sealed_tables.to(torch.int32), tail_k, tail_v,
                       tail_tables.to(torch.int32), scale)


def paged_multi_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, softcap: float = 0.0):
    """reference.paged_multi_attention's contract (q [B, T, Hq, d]): Triton on CUDA, the
    reference elsewhere."""
    if q.device.type != "cuda":
        return reference.paged_multi_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, softcap)
    plan = plan_decode("paged", seq_lens, num_qo_heads=q.shape[2], num_kv_heads=k_cache.shape[1],
                       head_dim=q.shape[3], block_size=k_cache.shape[2], device=q.device, dtype=q.dtype,
                       softcap=softcap, query_tokens=q.shape[1])
    return plan.run_paged(q, k_cache, v_cache, block_tables.to(torch.int32), scale)


# ------------------------------------------------------------------ encode

def encode_backend(codebook: torch.Tensor) -> str:
    """REFERENCE, CUDA or TRITON for PQ encoding with this codebook [Hkv, M, 256, dsub] (or
    every layer's, [L, Hkv, M, 256, dsub])."""
    if not codebook.is_cuda:
        return REFERENCE
    return CUDA if cuda_encode.supported(codebook) else TRITON


def pq_encode_to_slots(x, codebook, slots, k_codes=None, v_codes=None) -> None:
    """reference.pq_encode_to_slots's contract, on whichever backend applies. Every layer
    at once: codebook [L, Hkv, M, 256, dsub], x [L, N, Hkv, d], the codes [L, nb, ...],
    the same slots in each layer: one launch of the CUDA kernels, one call a layer on the
    others."""
    which = encode_backend(codebook)
    if which == CUDA:
        fn = cuda_encode.pq_encode_to_slots
    elif which == TRITON:
        from .triton.encode import pq_encode_to_slots as fn
    else:
        fn = reference.pq_encode_to_slots
    if which == CUDA or codebook.dim() != 5:
        fn(x, codebook, slots, k_codes=k_codes, v_codes=v_codes)
        return
    check_encode_layers(x, codebook.shape[0], k_codes, v_codes)
    for i in range(codebook.shape[0]):
        fn(x[i], codebook[i], slots, k_codes=None if k_codes is None else k_codes[i],
           v_codes=None if v_codes is None else v_codes[i])


def prepare_encode(codebook: torch.Tensor) -> None:
    """Build whatever pq_encode_to_slots caches per codebook now (the CUDA cell tables),
    replacing anything cached under the same address: call it for new codebooks."""
    if encode_backend(codebook) == CUDA:
        cuda_encode.encode_plan(codebook, refresh=True)


def release_encode(codebook: torch.Tensor) -> None:
    """Drop what prepare_encode cached for this codebook: call it when its owner drops it."""
    if encode_backend(codebook) == CUDA:
        cuda_encode.release_plan(codebook)


# ------------------------------------------------------- blocks and slots

def gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook, block_ids):
    """reference.gather_pq_blocks's contract: Triton on CUDA, the reference elsewhere."""
    if k_codes.device.type != "cuda":
        return reference.gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook, block_ids)
    from .triton.dequantize import gather_pq_blocks as fn
    return fn(k_codes, v_codes, k_codebook.contiguous(), v_codebook.contiguous(), block_ids)


def write_slots(k, v, k_cache, v_cache, slots) -> None:
    """reference.write_slots's contract: Triton on CUDA, the reference elsewhere."""
    if k.device.type != "cuda":
        return reference.write_slots(k, v, k_cache, v_cache, slots)
    from .triton.slot_write import write_slots as fn
    return fn(k, v, k_cache, v_cache, slots)


# --------------------------------------------------------------- checksums

def xxh3_64_rows(rows: torch.Tensor) -> torch.Tensor:
    """reference.xxh3_64_rows's contract: the Triton kernel for CUDA rows it takes
    (triton/xxh3.py: takes), the reference elsewhere."""
    if rows.is_cuda:
        from .triton import xxh3
        if xxh3.takes(rows):
            return xxh3.xxh3_64_rows(rows)
    return reference.xxh3_64_rows(rows)


# ---------------------------------------------------------- codebook images

def codebook_images(k_codebooks, v_codebooks, num_qo_heads: int, words=None):
    """k/v_codebooks [L, Hkv, M, 256, dsub] -> int32 [L, Hkv, IMG_WORDS]: every layer's
    codebooks laid out for the CUDA attention kernel's bulk copies (cuda/images.py),
    written into `words` when it fits; None where no kernel here reads such an image
    (CPU, no CUDA kernels, no Hopper GPU, bulk copies off: tunables.TMA_MAX_ITEM_TOKENS)."""
    if not k_codebooks.is_cuda or not cuda_build.available():
        return None
    return cuda_images.codebook_images(k_codebooks, v_codebooks, num_qo_heads, words)


def layer_images(words, num_qo_heads: int, dsub: int) -> list:
    """The per-layer images (run_pq's codebook_image) of codebook_images' result."""
    return cuda_images.layer_images(words, num_qo_heads, dsub)


__all__ = ["HEAD_DIMS", "REFERENCE", "CUDA", "TRITON", "DecodePlan", "decode_backend", "plan_decode", "query_aligned",
           "pq_decode_attention", "paged_decode_attention", "pq_multi_attention", "paged_multi_attention",
           "encode_backend", "pq_encode_to_slots",
           "prepare_encode", "release_encode", "gather_pq_blocks", "write_slots", "codebook_images", "layer_images",
           "xxh3_64_rows", "tunables"]
