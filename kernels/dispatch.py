"""Route each op by device: CUDA tensors -> Triton kernels, anything else -> the
torch reference. Signatures are reference.py's. Triton modules are imported on
first CUDA use, so CPU-only installs never need Triton.

The engine's hot path should hold plans instead (decode_attention.plan_*_decode,
pq_encode.plan_pq_encode): these wrappers re-plan on every call.
"""
from __future__ import annotations

import torch

from . import reference


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def pq_encode_to_slots(x, codebook, slots, k_codes=None, v_codes=None):
    if _on_cuda(x):
        from . import cuda_pq
        if cuda_pq.encode_supported(codebook):     # CUDA C++ kernel where cupy imports
            fn = cuda_pq.pq_encode_to_slots
        else:
            from .pq_encode import pq_encode_to_slots as fn
    else:
        fn = reference.pq_encode_to_slots
    return fn(x, codebook, slots, k_codes=k_codes, v_codes=v_codes)


def prepare_encode(codebook) -> None:
    """Build whatever pq_encode_to_slots caches per codebook now (CUDA cell tables),
    replacing anything cached under the same address: call it for new codebooks."""
    if _on_cuda(codebook):
        from . import cuda_pq
        if cuda_pq.encode_supported(codebook):
            cuda_pq.encode_plan(codebook, refresh=True)


def codebook_images(k_codebooks, v_codebooks, num_qo_heads: int, words=None):
    """k/v_codebooks [L, Hkv, M, 256, dsub] -> int32 [L, Hkv, IMG_WORDS]: every layer's
    codebooks laid out for the CUDA attention kernel's bulk copies, written into `words`
    when it fits; None where no kernel here reads such an image (CPU, no Hopper GPU)."""
    if not _on_cuda(k_codebooks):
        return None
    from . import cuda_pq
    return cuda_pq.codebook_images(k_codebooks, v_codebooks, num_qo_heads, words)


def layer_images(words, num_qo_heads: int, dsub: int) -> list:
    """The per-layer images (run_pq's codebook_image) of codebook_images' result."""
    from . import cuda_pq
    layout = cuda_pq.image_layout(num_qo_heads, words.shape[1], dsub)
    return [cuda_pq.CodebookImage(words[i], layout) for i in range(words.shape[0])]


def write_slots(k, v, k_cache, v_cache, slots):
    if _on_cuda(k):
        from .slot_write import write_slots as fn
    else:
        fn = reference.write_slots
    return fn(k, v, k_cache, v_cache, slots)


def gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook, block_ids):
    if _on_cuda(k_codes):
        from .pq_dequantize import gather_pq_blocks as fn
        return fn(k_codes, v_codes, k_codebook.contiguous(), v_codebook.contiguous(),
                  block_ids)
    return reference.gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook, block_ids)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    if _on_cuda(q):
        from .decode_attention import paged_decode_attention as fn
    else:
        fn = reference.paged_decode_attention
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale)


def pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                        tail_k, tail_v, tail_tables, tail_lens, scale):
    if _on_cuda(q):
        from .decode_attention import pq_decode_attention as fn
    else:
        fn = reference.pq_decode_attention
    return fn(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
              tail_k, tail_v, tail_tables, tail_lens, scale)
