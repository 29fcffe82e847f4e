"""The attention function registered with transformers as "kvstore": a layer's decode
step (and a multi-token chunk after a prefix hit) goes to the daemon, whose sequences
hold its K/V; everything else runs by the attention the model had before, the mask of
a prefill whose K/V go to the daemon checked first (hf_masks.py)."""
from __future__ import annotations

from . import hf_variants
from .hf_step import take_decode_target, take_prefill_check

ATTN = "kvstore"
_registered = False
_inner: dict[int, str | None] = {}     # id(config) -> the attention implementation it had before


def register() -> None:
    """Register the "kvstore" attention (and its mask: sdpa's) with transformers."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTN, kvstore_attention)
    AttentionMaskInterface.register(ATTN, sdpa_mask)
    _registered = True


def kvstore_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, Hq, n, d], key/value [B, Hkv, kv, d] -> ([B, n, Hq, d], None).
    Decode steps of a KVStoreCache go to the daemon; everything else (prefill,
    fallback, plain caches) runs in-process by the model's own attention."""
    layer = getattr(module, "layer_idx", None)      # None: a vision tower's, with no cache layer
    cache = None if layer is None else take_decode_target(layer, key, value)
    if cache is not None:
        cache.adapter.variant.check_call(layer, kwargs, attention_mask, cache.length + query.shape[2],
                                         module, cache.pads, cache.masks_checked)
        out, key, value = cache.decode_attention(layer, query, key, value, scaling)
        if out is not None:
            return out, None
    elif layer is not None and (pre := take_prefill_check(layer)) and not pre[0].local:    # its K/V go to the daemon
        pre[0].adapter.variant.check_call(layer, kwargs, attention_mask, pre[1], module,
                                          pre[0].pads, pre[0].masks_checked)
    impl = _inner.get(id(module.config), "sdpa")
    fn = hf_variants.inner_attention(module, impl)
    if impl != "sdpa" and (layer is not None or attention_mask is not None):
        # the registered mask is sdpa's (bool, or None for plain causal: a vision tower's None
        # is no mask); eager adds a float one
        attention_mask = hf_variants.as_additive_mask(attention_mask, query, key)
    return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
