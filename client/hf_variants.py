"""Which attention a transformers model runs, as the daemon must run it, and what
the adapter cannot run (refused when it is built, naming the feature).

The daemon runs decode attention with GQA, a per-call scale (the model's own
`scaling`: query_pre_attn_scalar and head_dim not hidden / heads come in that
way), a sliding window per layer, logit soft-capping and learned sink logits
(gpt-oss's `sinks`, taken from the model when the adapter is built), in fp16 or bf16. The
in-process attention (prefill, fallback) is the model's own implementation, so
every variant the model has is computed there as transformers computes it.
"""
from __future__ import annotations

import hashlib
import inspect
import sys
from dataclasses import dataclass

import torch

from . import hf_masks

# What each of transformers' layer_types keeps while generating: K/V (in the daemon),
# a recurrent or convolution state (linear attention, Mamba, short convolutions: kept
# in-process by transformers' own cache layer; its size a sequence is fixed, whatever
# the length: heads x head_dim x state size a layer), both (a layer running attention and
# a Mamba mixer side by side), or nothing.
LAYER_KINDS = {"full_attention": "kv", "sliding_attention": "kv", "chunked_attention": "kv",
               "hybrid": "kv+state", "hybrid_sliding": "kv+state",
               "linear_attention": "state", "conv": "state", "mlp": "none", "moe": "none"}
SLIDING = ("sliding_attention", "hybrid_sliding")


def kv_layer_indices(types, n: int) -> list[int]:
    """The layers that keep K/V, of n layers of these layer_types (None: every layer);
    a type LAYER_KINDS does not know counts as one (detect refuses it by name)."""
    if types is None:
        return list(range(n))
    return [i for i, t in enumerate(types) if LAYER_KINDS.get(t, "kv").startswith("kv")]


@dataclass(slots=True, frozen=True)
class AttentionVariant:
    """Per layer below means per layer of the daemon's cache: the model's layers that
    keep K/V, in order (kv_of maps a model layer to its index there)."""
    windows: tuple[int, ...]     # per layer; 0: global; () when no layer slides
    softcap: float               # attn_logit_softcapping; 0: none
    chunks: tuple[int, ...] = ()     # per layer: attention_chunk_size (Llama 4); () when no layer is chunked
    # learned attention-sink logits (gpt-oss `sinks`), per layer and query head, layer-major;
    # -inf for a layer without; () when no layer has them
    sinks: tuple[float, ...] = ()
    # per model layer: its index among the layers that keep K/V, -1 for one that keeps none
    # (linear attention, Mamba, convolution, MLP-only); () when every layer keeps K/V
    kv_of: tuple[int, ...] = ()
    # per model layer: its layer type keeps a recurrent / convolution state in-process;
    # () when none does
    stateful: tuple[bool, ...] = ()

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def chunk(self, layer: int) -> int:
        return self.chunks[layer] if self.chunks else 0

    def kv_index(self, model_layer: int) -> int:
        """The daemon cache's layer of a model layer (-1: the layer keeps no K/V)."""
        return self.kv_of[model_layer] if self.kv_of else model_layer

    @property
    def has_state(self) -> bool:
        """Some layer keeps a state the daemon does not hold: a cached prefix stands in
        for running its tokens only with that state at its end (hf_states.py)."""
        return any(self.stateful)

    def spec(self) -> dict:
        """The CreateCache fields that make the daemon attend as the model does."""
        out = {"layer_windows": list(self.windows)} if self.windows else {}
        if self.chunks:
            out["layer_chunks"] = list(self.chunks)
        if self.softcap:
            out["logit_softcap"] = self.softcap
        if self.sinks:
            out["sink_logits"] = list(self.sinks)
        return out

    def check_call(self, layer: int, kwargs: dict, mask, kv_len: int, module=None, pads=None,
                   checked: set | None = None) -> None:
        """The attention call of `layer` asks for what the daemon's cache was made with:
        a model whose layers decide their window or cap otherwise than its config
        says is refused before its decode step reaches the daemon. layer: the model's
        (the attention module's layer_idx), mask: the call's (sdpa's: bool [B, 1, n,
        kv_len], True = attend, or None), kv_len: the tokens it reads, module: the
        attention module making the call, pads: each row's left padding, checked: the
        (window, chunk) kinds whose mask this forward has checked (one mask a kind)."""
        at = self.kv_index(layer)
        if at < 0:
            raise ValueError(f"layer {layer}: the model attends with K/V in a layer whose layer_types entry "
                             "keeps none (the kvstore cache holds only its attention layers)")
        w, want = kwargs.get("sliding_window") or 0, self.window(at)
        cap = kwargs.get("softcap") or 0.0
        # A model may window through its mask alone (PhiMoE, Doge: the call carries no
        # sliding_window): the mask must then hide every token before the window.
        if w != want and not (w == 0 and (kv_len <= want or hf_masks.masks_before(mask, kv_len - want))):
            raise ValueError(f"layer {layer}: the model attends with sliding_window={w}, the kvstore cache "
                             f"was made with {want} (from its config)")
        c = self.chunk(at)      # chunks come by the mask alone (Llama 4): it must hide the earlier ones
        if c and (w or not hf_masks.hides_earlier_chunks(mask, kv_len, c, pads or [0])):
            raise ValueError(f"layer {layer}: the model does not attend in chunks of {c} tokens as its config "
                             "says (attention_chunk_size), or not through its mask")
        if checked is None or (want, c) not in checked:
            hf_masks.check(layer, mask, kv_len, pads or [0], want, c)
            if checked is not None:
                checked.add((want, c))
        if float(cap) != self.softcap:
            raise ValueError(f"layer {layer}: the model soft-caps attention logits at {cap}, the kvstore "
                             f"cache at {self.softcap}")
        aux = kwargs.get("s_aux")
        if aux is not None and not (self.sinks and aux is sink_parameter(module)):
            # the daemon's cache holds the values of the attention's `sinks` when the adapter
            # was built: other logits in the call would be attended with those
            raise ValueError(f"layer {layer}: the model attends with learned sink logits (s_aux) other than "
                             "its attention's `sinks` parameter, which the kvstore cache was made with")


def sink_parameter(module):
    """The attention module's learned sink logits (gpt-oss `sinks`, [Hq]), or None."""
    p = getattr(module, "sinks", None)
    return p if isinstance(p, torch.nn.Parameter) else None


def _sink_logits(model, c, kv_layers: list[int]) -> tuple[float, ...]:
    """The sink logits of every layer that keeps K/V (kv_layers: model layers), layer-major
    ([L * Hq]; -inf for a layer whose attention has none, as MiMo's global layers), or ()
    when no layer has them."""
    hq = heads(c)[0]
    rows: dict[int, list[float]] = {}
    for name, m in model.named_modules():
        p = sink_parameter(m)
        if p is None:
            continue
        layer = getattr(m, "layer_idx", None)
        if layer not in kv_layers or p.numel() != hq or layer in rows:
            _refuse(f"learned attention-sink logits outside one attention module a layer of {hq} query heads "
                    f"({name}.sinks: {tuple(p.shape)})")
        rows[layer] = p.detach().float().cpu().tolist()
    if not rows:
        return ()
    return tuple(x for layer in kv_layers for x in rows.get(layer, [float("-inf")] * hq))


def _refuse(feature: str) -> None:
    raise ValueError(f"{feature}: not supported by the kvstore adapter (the daemon's decode attention "
                     "would compute something else)")


def setting(c, name: str, default=None):
    """c.<name>, also where transformers declares it per layer (a config with
    per_layer_config, as Gemma 4's head_dim): the value every layer has; refused,
    naming it, where layers differ (one daemon cache has one geometry)."""
    try:
        return getattr(c, name, default)
    except Exception as e:      # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, by name
        if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
    values = [getattr(layer, name, default) for layer in c.per_layer_config]
    for i, v in enumerate(values):
        if v != values[0]:
            _refuse(f"{name} differing by layer ({values[0]} in layer 0, {v} in layer {i})")
    return values[0]


def length_dependent_rope(c) -> bool:
    """Whether the model's RoPE frequencies depend on the length of the forward (dynamic
    NTK, LongRoPE): K/V cached from a prompt of another length were rotated otherwise."""
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    kinds = [params] + [v for v in params.values() if isinstance(v, dict)]     # per layer type (Gemma 3)
    return any(k.get("rope_type", k.get("type")) in ("dynamic", "longrope") for k in kinds)


def heads(c) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a decoder's text config, whichever names it
    uses: num_key_value_heads (Llama and most), num_kv_heads (Falcon), multi_query
    (GPTBigCode: one KV head), none of them (GPT-2, GPT-NeoX, OPT: one per query head).
    head_dim is the config's own where it has one (Gemma's is not hidden / heads)."""
    q = setting(c, "num_attention_heads")
    kv = setting(c, "num_key_value_heads") or setting(c, "num_kv_heads") \
        or (1 if setting(c, "multi_query", False) else q)
    return q, kv, setting(c, "head_dim") or c.hidden_size // q


def _attends_by_itself(model) -> str | None:
    """What attends without looking up the registered function, so that the decode step
    never reaches the daemon: the model, when no modeling file of its layers looks one
    up (GPT-J, Falcon, Bloom, MPT, CodeGen), or the class of a module that updates the
    cache in its forward and then attends by itself (GIT's text attention, though its
    vision tower looks the function up). None where every one looks it up, or no source
    can be read: KVStoreCache refuses such a step at run time. The class flag
    _supports_attention_backend is no guide: StableLM and BioGPT look it up without it."""
    layered = {sys.modules[type(m).__module__] for m in model.modules() if hasattr(m, "layer_idx")}
    if not any(hasattr(mod, "ALL_ATTENTION_FUNCTIONS") for mod in layered):
        return type(model).__name__
    for cls in {type(m) for m in model.modules() if hasattr(m, "layer_idx")}:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if ".update(" in src and "past_key_value" in src and "ALL_ATTENTION_FUNCTIONS" not in src:
            return cls.__name__
    return None


def detect(model, c) -> AttentionVariant:
    """The attention variant of `model` (c: its decoder's text config); ValueError naming
    the first feature the daemon cannot run."""
    if model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _refuse(f"model dtype {model.dtype}")
    own = _attends_by_itself(model)
    if own is not None:
        _refuse(f"{own}: attention outside transformers' AttentionInterface")
    for name, m in model.named_modules():
        if isinstance(getattr(m, "lambda_q1", None), torch.nn.Parameter):
            _refuse("differential attention (two softmaxes over halves of V, as DiffLlama)")
        if hasattr(m, "layer_idx") and hasattr(m, "is_causal") and m.is_causal is False:
            # BERT-like models not made decoders (is_decoder), and the encoder attention
            # of an encoder-decoder's decoder layers (BART's encoder_attn)
            _refuse(f"non-causal attention ({name}: bidirectional, or over another input)")
    if setting(c, "cross_attention_layers", None) or setting(c, "add_cross_attention", False):
        _refuse("cross-attention layers (cross_attention_layers, add_cross_attention: K/V of another input)")
    if setting(c, "use_bidirectional_attention", False):
        _refuse("use_bidirectional_attention")
    if setting(c, "alibi", False) or setting(c, "position_embedding_type", None) == "alibi":
        _refuse("ALiBi position biases")
    if setting(c, "kv_lora_rank") or setting(c, "v_head_dim") not in (None, heads(c)[2]):
        _refuse("latent / asymmetric K and V heads (kv_lora_rank, v_head_dim)")
    if setting(c, "num_kv_shared_layers", None):
        _refuse("layers attending with another layer's K/V (num_kv_shared_layers)")
    own = _own_cache_class(model)
    if own is not None:
        _refuse(f"a cache class of the model's own ({own}: state kept outside transformers' cache layers)")
    n = c.num_hidden_layers
    sw = setting(c, "sliding_window") or 0
    types = setting(c, "layer_types", None)
    if types is not None:
        other = sorted(set(types) - set(LAYER_KINDS))
        if other:
            _refuse(f"layer_types {other}")
        if len(types) != n:
            _refuse(f"layer_types of {len(types)} layers for num_hidden_layers={n}")
    kv_layers = kv_layer_indices(types, n)
    if not kv_layers:
        _refuse(f"no attention layer (layer_types {sorted(set(types))}): nothing for the daemon to hold")
    if types is not None:
        windows = tuple(sw if types[i] in SLIDING else 0 for i in kv_layers)
    else:
        # Mistral and Phi-3: no layer_types; every layer slides when sliding_window is set
        windows = (sw,) * n if sw else ()
    if not any(windows):
        windows = ()
    # Llama 4: attention_chunk_size on the layers whose layer_types say chunked_attention
    size = setting(c, "attention_chunk_size", None) or 0
    chunks = tuple(size if types[i] == "chunked_attention" else 0 for i in kv_layers) if types else ()
    if bool(size) != any(chunks):
        _refuse(f"chunked attention (attention_chunk_size={size or None}) without chunked_attention layers"
                if size else "chunked_attention layers without attention_chunk_size")
    cap = setting(c, "attn_logit_softcapping", None) or 0.0
    kv_of = tuple(kv_layers.index(i) if i in kv_layers else -1 for i in range(n))
    stateful = tuple(LAYER_KINDS[t].endswith("state") for t in types or ())
    return AttentionVariant(windows=windows, softcap=float(cap), chunks=chunks if any(chunks) else (),
                            sinks=_sink_logits(model, c, kv_layers),
                            kv_of=kv_of if len(kv_layers) < n else (),
                            stateful=stateful if any(stateful) else ())


def _own_cache_class(model) -> str | None:
    """A Cache subclass the model's modeling file defines (MiniMax keeps its linear
    attention's state in one, and refuses any other cache), or None."""
    from transformers.cache_utils import Cache
    for mod in {sys.modules[type(m).__module__] for m in model.modules()}:
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, Cache) and obj.__module__ == mod.__name__:
                return name
    return None


USE_CACHE_REFUSED = ("use_cache=False: generation without a KV cache has nothing for kvstore to hold; "
                     "call model.generate directly")
ATTENTIONS_REFUSED = ("output_attentions: the daemon's decode steps return no attention weights; "
                      "call model.generate directly")


def generate_setting(model, kwargs: dict, name: str, default=None):
    """A generate() setting as generate() reads it: its kwargs, else the generation config
    given, else the model's, else default."""
    said = (kwargs.get(name), *(getattr(g, name, None) for g in (kwargs.get("generation_config"),
                                                                  model.generation_config)))
    return next((v for v in said if v is not None), default)


def check_generate(model, kwargs: dict) -> None:
    """ValueError naming a generate() setting the daemon's sequences cannot serve, read as
    generate() reads it: its kwargs, else the generation config given, else the model's,
    else transformers' default (None, as GenerationConfig() and most generation_config.json
    files leave use_cache, is unset: the next source decides)."""
    asked = lambda name, default=None: generate_setting(model, kwargs, name, default)  # noqa: E731
    if kwargs.pop("past_key_values", None) is not None:     # None: as if not given, as generate() takes it
        raise ValueError("past_key_values: adapter.generate makes (and frees) a kvstore cache of its own; for "
                         "the next turn pass the whole conversation (the turns so far are cached blocks its "
                         "prompt hits), or give a cache from adapter.cache_for(input_ids) to model.generate")
    if not asked("use_cache", True):
        raise ValueError(USE_CACHE_REFUSED)
    if asked("output_attentions", False):
        raise ValueError(ATTENTIONS_REFUSED)
    for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if asked(name):
            raise ValueError(f"{name}: assisted / speculative generation is not supported by the kvstore "
                             "adapter (a daemon sequence cannot drop the draft tokens it rejects)")
    check_media(kwargs)


def check_media(kwargs: dict) -> None:
    """ValueError naming an image, video or audio input: its tokens are placeholder ids,
    the same whatever the input, so K/V cached under them would serve another input."""
    for name, x in kwargs.items():      # tensors only: flags and token ids of those names are no input
        if isinstance(x, torch.Tensor) and any(w in name for w in ("pixel_values", "input_features", "image", "video",
                                                                   "audio")):
            raise ValueError(f"{name}: image, video and audio inputs are not supported by the kvstore adapter "
                             "(their tokens are placeholder ids, the same for every input: K/V the daemon "
                             "stores under them would serve another input)")


def generate_mask(model, input_ids: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The attention_mask generate() attends input_ids [B, T] with: the one given, else the
    one transformers infers without one (zeros where input_ids holds pad_token_id, when it
    is set, occurs and is no eos token), then put into kwargs so that generate() and the
    daemon's sequences go by the same mask; None: every token attended. ValueError where the
    inferred mask hides a token after a row's first real one (the daemon's rows are left
    padding, then tokens that all attend)."""
    if kwargs.get("attention_mask") is not None or input_ids is None:
        return kwargs.get("attention_mask")
    pad, eos = (generate_setting(model, kwargs, n) for n in ("pad_token_id", "eos_token_id"))
    if pad is None or input_ids.ndim != 2 or input_ids.is_floating_point():
        return None
    pad = int(torch.as_tensor(pad).flatten()[0])
    if pad in ([] if eos is None else torch.as_tensor(eos).flatten().tolist()) or not bool((input_ids == pad).any()):
        return None
    mask = (input_ids != pad).long()
    real = mask.cumsum(-1) > 0                      # from each row's first token that is not pad_token_id
    if bool((real & (mask == 0)).any()):
        raise ValueError(f"input_ids: pad_token_id {pad} occurs after a row's first other token, and without an "
                         "attention_mask generate() hides it from attention; the kvstore adapter serves "
                         "left padding only: pass attention_mask (ones over every token to attend), or a "
                         "pad_token_id the prompt does not use")
    kwargs["attention_mask"] = mask
    return mask


def forward_setting(model, kwargs: dict, name: str):
    """A forward's setting: its kwargs, else the model's config."""
    return getattr(model.config, name, None) if kwargs.get(name) is None else kwargs[name]


def check_forward(model, kwargs: dict) -> None:
    """check_generate's refusals for a forward given the adapter's cache by hand
    (model.generate or model() with cache_for's cache)."""
    if forward_setting(model, kwargs, "use_cache") is False:
        raise ValueError(USE_CACHE_REFUSED)
    if forward_setting(model, kwargs, "output_attentions"):
        raise ValueError(ATTENTIONS_REFUSED)
    check_media(kwargs)


def weights_id(model) -> str:
    """The label of a model whose name (a local path, or none) says nothing of its
    weights: its class and a hash of a strided sample of every parameter, in float32,
    so that the same weights from any path, in any process, get the same label and
    other weights another."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        flat = p.detach().reshape(-1)
        h.update(f"{name} {tuple(p.shape)} {p.dtype}\n".encode())
        h.update(flat[::max(1, flat.numel() // 4096)][:4096].float().cpu().numpy().tobytes())
    return f"{type(model).__name__[:64]}@weights-{h.hexdigest()[:16]}"


def inner_attention(module, impl: str):
    """The attention function the model ran before the adapter (for prefill and
    fallbacks): a registered one, or its modeling file's eager_attention_forward."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if impl not in (None, "eager"):
        return ALL_ATTENTION_FUNCTIONS[impl]
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward
    return fn


def as_additive_mask(mask, query: torch.Tensor, key: torch.Tensor):
    """transformers' sdpa mask (bool, True = attend, or None for plain causal) as the
    additive float mask eager attention adds to its scores."""
    if mask is not None and mask.dtype != torch.bool:
        return mask
    n, kv = query.shape[-2], key.shape[-2]
    if mask is None:
        i = torch.arange(n, device=query.device).view(n, 1)
        j = torch.arange(kv, device=query.device).view(1, kv)
        mask = (j <= i + (kv - n)).view(1, 1, n, kv)
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(mask, zero, torch.finfo(query.dtype).min)
