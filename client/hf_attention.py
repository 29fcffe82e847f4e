"""The attention function registered with transformers as "kvstore": a layer's decode
step (and a multi-token chunk after a prefix hit) goes to the daemon, whose sequences
hold its K/V; everything else runs by the attention the model had before, the mask of
a prefill whose K/V go to the daemon checked first (hf_masks.py)."""
from __future__ import annotations

from . import hf_variants
from .hf_step import take_decode_target, take_prefill_check

ATTN = "kvstore"
_registered = False


class Implementation(str):
    """The name "kvstore" holding the attention implementation the config had before, so
    that a copy of the model (copy.deepcopy, pickle) runs the model's own attention, not
    sdpa: a table keyed by the config's id would not know the copy's config."""
    inner: str | None

    def __new__(cls, inner: str | None):
        name = super().__new__(cls, ATTN)
        # a plain "kvstore" (set by hand) runs sdpa; None is eager, as transformers reads it
        name.inner = inner.inner if isinstance(inner, Implementation) else "sdpa" if inner == ATTN else inner
        return name

    def __reduce__(self):
        return Implementation, (self.inner,)


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


def install(configs: list) -> list:
    """Set each config's attention to "kvstore" holding the one it had; returns those, for
    restore()."""
    old = [c._attn_implementation for c in configs]
    for c, name in _parents_first(configs, old):
        c._attn_implementation = Implementation(name)
    return old


def restore(configs: list, old: list) -> None:
    for c, name in _parents_first(configs, old):
        c._attn_implementation = name


def _parents_first(configs: list, names: list) -> list:
    """(config, name) with every config after those holding it as a sub-config: setting a
    config's attention sets its sub-configs' too, which may have had their own."""
    parents: dict[int, list] = {}
    for c in configs:
        for key in getattr(c, "sub_configs", None) or {}:
            if (sub := getattr(c, key, None)) is not None:
                parents.setdefault(id(sub), []).append(c)

    def depth(c, seen: frozenset) -> int:
        return max((1 + depth(p, seen | {id(c)}) for p in parents.get(id(c), ()) if id(p) not in seen),
                   default=0)
    return sorted(zip(configs, names), key=lambda pair: depth(pair[0], frozenset()))


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
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    impl = name.inner if isinstance(name, Implementation) else "sdpa"
    fn = hf_variants.inner_attention(module, impl)
    if impl != "sdpa" and (layer is not None or attention_mask is not None):
        # the registered mask is sdpa's (bool, or None for plain causal: a vision tower's None
        # is no mask); eager adds a float one
        attention_mask = hf_variants.as_additive_mask(attention_mask, query, key)
    return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
