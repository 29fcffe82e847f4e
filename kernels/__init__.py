"""Decode-attention and PQ codec kernels: Triton on CUDA, torch references on CPU.

Callers use `kvstore.kernels.dispatch` (reference signatures, routed by device) or,
on the hot path, the plans in `decode_attention` / `pq_encode`. Triton is imported
only when a CUDA tensor first reaches a kernel.
"""
from . import dispatch, reference  # noqa: F401
