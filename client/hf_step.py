"""Which attention call takes a layer's decode step: KVStoreCache.update names the
layer and the K/V it returned; the attention function registered with transformers
(hf_attention.kvstore_attention), called next on the same thread, takes them to the daemon.
Anything else (no call, another layer's module, other K/V, a second call) stops
generation naming the layer: the daemon would answer wrongly."""
from __future__ import annotations

import threading

import torch

_local = threading.local()     # ctx: (cache, layer, K/V) set by KVStoreCache.update for the attention call after it


def set_decode_target(cache, layer: int = -1, kv: tuple | None = None) -> None:
    """The decode step of `layer` goes to the daemon: the attention function
    (hf_attention.kvstore_attention) called next on this thread takes it, with the K/V `kv`
    update returned. A step no attention call took is refused here: that layer
    attended in-process over the new tokens alone (update kept nothing), so its
    output is wrong, and generation must stop."""
    left = getattr(_local, "ctx", None)
    if cache is not None and left is not None:
        _local.ctx = None
        raise RuntimeError(_unsupported(left[0], left[1], "did not call the registered attention function"))
    _local.ctx = (cache, layer, kv) if cache is not None else None
    _local.taken = None


def take_decode_target(layer: int, key: torch.Tensor, value: torch.Tensor):
    """The cache whose decode step of `layer` this attention call runs (at most one call
    takes a step), or None: a prefill, a fallback, a plain cache. RuntimeError naming the
    layer for a call the daemon would answer wrongly: another layer's step (K/V shared
    across layers), K/V other than update returned (changed between the cache and the
    attention, as differential attention does), or a second call for the step."""
    ctx, _local.ctx = getattr(_local, "ctx", None), None
    if ctx is None:
        taken = getattr(_local, "taken", None)
        if taken is not None and taken[1] == layer:
            raise RuntimeError(_unsupported(taken[0], layer, "was attended twice"))
        return None
    cache, want, kv = ctx
    _local.taken = (cache, want)
    if want != layer:
        raise RuntimeError(_unsupported(cache, want, f"was attended by the attention module of layer {layer}"))
    if key is not kv[0] or value is not kv[1]:
        raise RuntimeError(_unsupported(cache, want, "was attended with other K/V than the cache returned"))
    return cache


def check_all_taken() -> None:
    """RuntimeError naming a step no attention call took (a forward's last layer,
    which no later layer's update checks); cleared."""
    ctx, _local.ctx, _local.taken = getattr(_local, "ctx", None), None, None
    if ctx is not None:
        raise RuntimeError(_unsupported(ctx[0], ctx[1], "did not call the registered attention function"))


def _unsupported(cache, layer: int, how: str) -> str:
    return (f"{type(cache.adapter.model).__name__}: the decode step of layer {layer} {how}; attention that "
            "does not take the cache's K/V through transformers' AttentionInterface once per layer is not "
            "supported by the kvstore adapter")


def begin_layer() -> None:
    """A layer's step begins: its attention call may take it (once)."""
    _local.taken = None


def set_prefill_check(cache, layer: int = -1, kv_len: int = 0) -> None:
    """The attention call of `layer` that follows runs a prefill in-process, whose K/V
    (the layers after it depend on its output) go to the daemon under their token ids:
    its mask over kv_len positions must be the one the daemon's sequences stand for.
    cache None: none (one an exception left)."""
    _local.prefill = (cache, layer, kv_len) if cache is not None else None


def take_prefill_check(layer: int):
    """(cache, kv_len) of `layer`'s prefill set by KVStoreCache.update, or None; cleared."""
    got, _local.prefill = getattr(_local, "prefill", None), None
    return got[0::2] if got is not None and got[1] == layer else None
