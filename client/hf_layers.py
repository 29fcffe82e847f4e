"""The layers of a KVStoreCache, one a model layer: placeholders for the K/V the
daemon holds, and transformers' own layers for what stays in-process (K/V after a
fallback, a hybrid model's linear-attention, Mamba and convolution states)."""
from __future__ import annotations

from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin, DummyLayer, DynamicLayer,
                                     LinearAttentionAndFullAttentionLayer, LinearAttentionLayer,
                                     get_layer_types_and_kwargs)


class DaemonLayer(CacheLayerMixin):
    """Placeholder layer: sizes come from the owning KVStoreCache."""
    is_sliding = False

    def __init__(self, owner):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise AssertionError("KVStoreCache.update handles daemon layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


class DaemonStateLayer(LinearAttentionLayer, DaemonLayer):
    """A layer that runs attention and a recurrent mixer side by side (layer type
    "hybrid", Falcon-H1): its K/V in the daemon, its conv / recurrent state here."""
    is_compileable = False      # the linear layers' True would let generate() compile the RPCs

    def __init__(self, owner, number_of_states: int = 1, **kwargs):
        DaemonLayer.__init__(self, owner)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)


def linear_fields() -> tuple[str, ...]:
    """The attributes in which transformers' linear-attention layers keep their state."""
    return tuple(vars(LinearAttentionLayer()))


def new_layers(owner, local: bool) -> list:
    """A fresh cache layer for every layer of owner's model: K/V in the daemon
    (DaemonLayer), or in-process (local: DynamicLayer, full for sliding and chunked
    layers too: release() hands every token over, and a fallback's masks were built
    for every token); a recurrent state in transformers' own layer class; DummyLayer
    for a layer that keeps nothing."""
    v = owner.adapter.variant
    if not v.kv_of and not v.stateful:
        return [DynamicLayer() if local else DaemonLayer(owner) for _ in range(owner.adapter.model_layers)]
    types, kwargs = get_layer_types_and_kwargs(owner.adapter.model.config.get_text_config(decoder=True))
    out = []
    for j, (t, kw) in enumerate(zip(types, kwargs)):
        kv, state = v.kv_index(j) >= 0, bool(v.stateful) and v.stateful[j]
        if kv and state:
            n = kw.get("number_of_states", 1)
            out.append(LinearAttentionAndFullAttentionLayer(number_of_states=n) if local
                       else DaemonStateLayer(owner, number_of_states=n))
        elif kv:
            out.append(DynamicLayer() if local else DaemonLayer(owner))
        elif state:
            out.append(DYNAMIC_LAYER_TYPE_MAPPING[t](**kw))
        else:
            out.append(DummyLayer())
    return out
