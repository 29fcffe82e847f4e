"""Attention hooks the offline tools run a transformers model through: every
attention call of the model goes to a handler of theirs (quantize, sample,
fine-tune), over full causal windows with no cache.

The handler never re-implements attention: it gets the call's q, k and v and
an `attend` that runs the model's own attention function (the one its config
names, sdpa or eager) with the model's own mask and arguments, so sliding
windows, logit soft-capping, query scaling and attention-sink logits stay
what the model does. The handler may swap the keys and values (dequantized
ones) and narrow the mask; it cannot widen it."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

_IMPL = "kvstore_hook"
_ACTIVE: dict = {}
# The model's attention implementations the hook can wrap: those whose mask is a
# tensor over the keys (flash and flex kernels take the window as an argument and
# would apply it to the doubled key axis protocol i builds).
WRAPPABLE = ("sdpa", "eager")


@dataclass(slots=True)
class AttentionCall:
    """One attention call of the model: query [B, Hq, n, d], key/value [B, Hkv, n, d].
    layer: its index among the model's layers that keep K/V (models.kv_layers)."""
    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    _run: object = field(repr=False)

    def attend(self, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
               allow: torch.Tensor | None = None) -> torch.Tensor:
        """The model's attention of this call's query over key/value [B, Hkv, nk, d]
        (default: the call's own), nk a multiple of n: key j reads as position
        j mod n under the model's mask, narrowed by `allow` [n, nk] bool if given.
        -> out [B, n, Hq, d] (the layout the model's attention functions return)."""
        return self._run(self.key if key is None else key, self.value if value is None else value, allow)


def _extend_mask(mask: torch.Tensor | None, n: int, nk: int, allow: torch.Tensor | None, device) -> torch.Tensor | None:
    """The model's mask [B, 1, n, n] (bool: True = attend; float: 0 = attend) tiled
    over nk keys and AND-ed with allow [n, nk]; same kind as the model's."""
    if nk == n and allow is None:
        return mask
    assert mask is not None, "the hook's mask function always materializes the mask"
    assert nk % n == 0, f"{nk} keys for {n} queries: the key axis must be whole copies of the window"
    keep = mask if mask.dtype == torch.bool else mask == 0
    keep = keep[..., :n].repeat(1, 1, 1, nk // n)
    if allow is not None:
        keep = keep & allow.to(device)
    if mask.dtype == torch.bool:
        return keep
    zero = torch.zeros((), dtype=mask.dtype, device=device)
    return torch.where(keep, zero, torch.finfo(mask.dtype).min)


def _original_function(module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = _ACTIVE["impl"]
    if impl == "eager":
        # "eager" is each model's own module-level function, not a registry entry
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def _attention(module, query, key, value, attention_mask, **kwargs):
    fn = _original_function(module)
    n = query.shape[2]

    def run(k, v, allow):
        mask = _extend_mask(attention_mask, n, k.shape[2], allow, query.device)
        return fn(module, query, k, v, mask, **kwargs)[0]

    layer = _ACTIVE["kv_of"][module.layer_idx]
    _ACTIVE["seen"].add(layer)
    return _ACTIVE["handler"](AttentionCall(layer, query, key, value, run)), None


def check_routed(model) -> None:
    """After a forward inside attention_handler: ValueError naming --model unless every
    layer that keeps K/V called the handler. A model whose attention does not go through
    transformers' AttentionInterface (Falcon, Bloom) runs its own, and a tool reading or
    replacing K/V there would measure nothing of them (the HF adapter refuses it too)."""
    missing = sorted(set(_ACTIVE["kv_of"].values()) - _ACTIVE["seen"])
    if missing:
        raise ValueError(f"--model: {type(model).__name__}'s attention does not go through transformers' "
                         f"AttentionInterface in {len(missing)} of its {len(_ACTIVE['kv_of'])} layers (first: "
                         f"{missing[0]}): the tools cannot see its K/V there, and kvstore cannot serve it")


def _mask(*args, **kwargs):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    kwargs["allow_is_causal_skip"] = False        # a tensor always, so `attend` can tile and narrow it
    return ALL_MASK_ATTENTION_FUNCTIONS[_ACTIVE["impl"]](*args, **kwargs)


def _configs(model) -> list:
    out = [model.config]
    text = model.config.get_text_config(decoder=True)
    return out + ([text] if text is not model.config else [])


@contextlib.contextmanager
def attention_handler(model, handler):
    """Route every attention call of `model` to handler(call: AttentionCall) ->
    out [B, n, Hq, d] (full causal windows, no cache, no padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    impl = model.config.get_text_config(decoder=True)._attn_implementation
    if impl not in WRAPPABLE:
        raise ValueError(f"attn_implementation: the tools run the model's own attention with a mask over the keys, "
                         f"which {impl!r} does not take; load the model with one of {WRAPPABLE}")
    assert not _ACTIVE, "attention_handler does not nest"
    AttentionInterface.register(_IMPL, _attention)
    AttentionMaskInterface.register(_IMPL, _mask)
    configs = _configs(model)
    old = [c._attn_implementation for c in configs]
    from .models import kv_layers
    # calls are numbered as the daemon's cache numbers layers: among those that keep K/V
    _ACTIVE.update(handler=handler, impl=impl, kv_of={j: i for i, j in enumerate(kv_layers(model))}, seen=set())
    for c in configs:
        c._attn_implementation = _IMPL
    try:
        yield
    finally:
        for c, o in zip(configs, old):
            c._attn_implementation = o
        _ACTIVE.clear()


def exact_attention(call: AttentionCall) -> torch.Tensor:
    """The handler that changes nothing: the model's attention as it is."""
    return call.attend()
