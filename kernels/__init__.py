"""Decode-attention and PQ codec kernels, installed as kvstore.kernels.

    router.py     the one place that picks a backend for every op (re-exported here)
    plan.py       what every decode plan is (plan/run, update() for CUDA graphs) and shares
    tunables.py   every knob, with its environment variable and the measurement behind it
    reference.py  pure-torch references: the contract every kernel is tested against
    cuda/         CUDA C++ kernels (NVRTC through CuPy): PQ attention + merge, PQ encode
    triton/       Triton kernels: PQ and paged attention, encode, dequantize, slot writes,
                  XXH3-64 of rows (the disk tier's checksums, on the device)
    pq_cells.py   cell tables for exact fast PQ encoding (dsub 2), built in torch
    cpu_decode.py the CPU daemon's decode attention (reference math, fewer torch ops)

Importing this package imports neither Triton nor CuPy: the router does, on first use.
"""
from . import reference, tunables
from .plan import DecodePlan
from .reference import fold_sink_logits, sink_table
from .router import (CUDA, HEAD_DIMS, REFERENCE, TRITON, codebook_images, decode_backend,
                     encode_backend, gather_pq_blocks, layer_images, paged_decode_attention,
                     paged_multi_attention, plan_decode, pq_decode_attention, pq_encode_to_slots,
                     pq_multi_attention, prepare_encode, query_aligned, release_encode, write_slots,
                     xxh3_64_rows)

__all__ = ["reference", "tunables", "DecodePlan", "CUDA", "REFERENCE", "TRITON", "codebook_images",
           "decode_backend", "encode_backend", "fold_sink_logits", "gather_pq_blocks", "layer_images", "paged_decode_attention",
           "paged_multi_attention", "plan_decode", "pq_decode_attention", "pq_multi_attention",
           "pq_encode_to_slots", "prepare_encode", "query_aligned", "release_encode",
           "sink_table", "write_slots"]
