"""Checks of the float tensors a request brings (K, V, Q, codebook samples):
dtype, shape, and values in the cache's dtype. The engine runs them before
any state changes; errors name the request field."""
from __future__ import annotations

import math

import torch

from kvstore.core.config import CacheConfig
from kvstore.errors import InvalidArgument

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_values(x: torch.Tensor, field: str, limit: float, converted: bool) -> None:
    """Refuse NaN, Inf and |element| > limit in x, a tensor in a cache's dtype
    (one min/max reduction). converted: x is the daemon's conversion of the
    request's tensor, where an Inf may be a finite value past the dtype's range."""
    if x.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    if -limit <= lo and hi <= limit:       # False for NaN too
        return
    if math.isnan(lo) or math.isnan(hi):
        raise InvalidArgument(field, "contains NaN")
    if math.isinf(lo) or math.isinf(hi):
        top = torch.finfo(x.dtype).max
        raise InvalidArgument(field, f"contains Inf, or values past {top:g} that overflow the cache's {x.dtype}"
                              if converted else "contains Inf")
    raise InvalidArgument(field, f"holds {max(-lo, hi):g}; a {x.dtype} cache takes |{field}| <= {limit:g} "
                          "(larger ones overflow the fp32 attention scores)")


def request_tensor(cfg: CacheConfig, t: torch.Tensor, field: str, shape: tuple,
                   limit: float | None = None) -> torch.Tensor:
    """Check a float tensor's shape (None = any size) and values, -> it on the
    cache's device in the cache dtype. limit: the largest |element| taken (q
    and k: ModelGeometry.qk_limit); None: any value finite in the cache dtype."""
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidArgument(field, f"dtype {t.dtype} is not float16/bfloat16/float32")
    if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidArgument(field, f"shape {list(t.shape)}, expected {want}")
    x = t.to(dtype=getattr(torch, cfg.geometry.dtype))
    # Values are checked in the cache dtype, after the conversion, which can
    # overflow (1e5 in fp32 is Inf in fp16). On CUDA the check synchronises
    # with the host: a tensor that arrives on the GPU in the cache dtype (the
    # decode path) is the client's responsibility, as a check would stall
    # every call; one the daemon converts costs a copy anyway and is checked.
    if not x.is_cuda or x is not t:
        check_values(x, field, limit if limit is not None else torch.finfo(x.dtype).max, x is not t)
    return x.to(device=cfg.device)
