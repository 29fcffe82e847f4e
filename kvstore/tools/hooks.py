"""Attention hooks the offline tools run a transformers model through: every
attention call of the model goes to a handler of theirs (quantize, sample,
fine-tune), over full causal windows with no cache."""
from __future__ import annotations

import contextlib

import torch.nn.functional as F

_HANDLER: list = [None]


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, Hq, n, d], key/value [B, Hkv, n, d] -> ([B, n, Hq, d], None)."""
    out = _HANDLER[0](module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


@contextlib.contextmanager
def attention_handler(model, handler):
    """Route every attention call of `model` to handler(layer, q, k, v, scaling)
    -> out [B, Hq, n, d] (full causal windows, no cache, no padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register("kvstore_eval", _attention)
    AttentionMaskInterface.register("kvstore_eval", _no_mask)
    old, _HANDLER[0] = model.config._attn_implementation, handler
    model.config._attn_implementation = "kvstore_eval"
    try:
        yield
    finally:
        model.config._attn_implementation = old
        _HANDLER[0] = None


def exact_attention(q, k, v, scaling):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
