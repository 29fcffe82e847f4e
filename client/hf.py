"""Hugging Face transformers adapter: `model.generate()` with the KV cache in the daemon.

    from kvstore.client.hf import KVStoreAdapter
    adapter = KVStoreAdapter(model, "unix:///tmp/kvstore-1000/kvstore.sock", cache="smollm2", codec="fp16")
    out = adapter.generate(input_ids, max_new_tokens=200, do_sample=False)
    # or by hand:
    cache = adapter.cache_for(input_ids)          # Allocate (prefix hit -> Retrieve)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=200)
    cache.release()                               # Free

How a step runs (any decoder-only model whose attention calls
`past_key_values.update` then the registered attention function: Llama,
Qwen2/3, SmolLM, Mistral, Phi-3, Gemma-2/3: sliding-window layers and logit
soft-capping go to the daemon with the cache spec, hf_variants.py; what it
cannot run is refused at construction, naming the feature):
  - prefill (a forward of n > 1 tokens): attention in-process on exact K/V, by
    the model's own attention implementation (eager for Gemma-2's soft-cap)
    (a cached prefix comes back from `Retrieve`, dequantized); the last
    layer's update sends the new tokens of all layers in one Append with their
    token ids (so later prompts can hit them).
  - decode (one token): `KVStoreCache.update` keeps nothing; the attention
    function "kvstore" sends (k, v, q) of the layer to `AppendAttend`.
  - the daemon is unreachable (any RPC error: UNAVAILABLE, or NOT_FOUND after
    a restart lost the sequence): a warning, then the cache recomputes the
    tokens so far into in-process DynamicLayers and generation goes on there.
    The adapter drops its channel; the next request reconnects (re-creating
    the cache and codebooks on a restarted daemon).
Batches of B sequences without padding work; prefix reuse is for B == 1.
"""
from __future__ import annotations

import itertools
import math
import os
import warnings

import grpc
import torch

from . import hf_variants
from .client import KVStoreClient
from .hf_cache import FALLBACK_ERRORS, KVStoreCache, take_decode_target

ATTN = "kvstore"
DEFAULT_PQ_SINKS = 32     # bench/ACCURACY.md: 32 sinks keep 4-bit PQ within 0.5 % at R = 128
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
    ctx = take_decode_target()
    if ctx is not None and ctx[1] == module.layer_idx:
        ctx[0].adapter.variant.check_call(module.layer_idx, kwargs)
        out, key, value = ctx[0].decode_attention(module.layer_idx, query, key, value, scaling)
        if out is not None:
            return out, None
    impl = _inner.get(id(module.config), "sdpa")
    fn = hf_variants.inner_attention(module, impl)
    if impl != "sdpa":
        # the registered mask is sdpa's (bool, or None for plain causal); eager adds a float one
        attention_mask = hf_variants.as_additive_mask(attention_mask, query, key)
    return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


class KVStoreAdapter:
    """Binds a model to a daemon cache. codec "fp16" or "pq" (codebooks: the
    safetensors bytes or path from kvstore-calibrate; transform: its optional
    kvstore.codec.transform.Transform, applied on this side before encoding).
    sink_tokens: the first tokens of every sequence the daemon keeps in fp16;
    None: 32 for pq (rounded up to a whole block), which keeps 4-bit PQ within
    0.5 % perplexity of fp16 at R = 128 (bench/ACCURACY.md)."""

    def __init__(self, model, target: str | None = None, cache: str = "hf", codec: str = "fp16",
                 codebooks: bytes | str | None = None, transform=None, block_size: int = 16, residual: int = 128,
                 num_blocks: int = 4096, max_sequences: int = 64, model_id: str | None = None,
                 timeout: float = 30.0, sink_tokens: int | None = None):
        if codec == "pq" and codebooks is None:
            raise ValueError("codec 'pq' needs codebooks (kvstore-calibrate output)")
        if isinstance(codebooks, str):
            with open(codebooks, "rb") as f:
                codebooks = f.read()
        if sink_tokens is None:
            sink_tokens = math.ceil(DEFAULT_PQ_SINKS / block_size) * block_size if codec == "pq" else 0
        c = model.config.get_text_config(decoder=True)
        self.variant = hf_variants.detect(model, c)       # ValueError naming what the daemon cannot run
        self.model, self.target, self.cache_name, self.codec = model, target, cache, codec
        self.codebooks, self.transform, self.timeout = codebooks, transform, timeout
        self.num_layers = c.num_hidden_layers
        self.num_q_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.spec = dict(model_id=model_id or getattr(c, "_name_or_path", "") or type(model).__name__,
                         num_layers=self.num_layers, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, dtype="bfloat16" if model.dtype == torch.bfloat16 else "float16",
                         codec=codec, block_size=block_size, residual=residual, num_blocks=num_blocks,
                         max_sequences=max_sequences, sink_tokens=sink_tokens)
        if self.variant.windows:
            self.spec["layer_windows"] = list(self.variant.windows)
        if self.variant.softcap:
            self.spec["logit_softcap"] = self.variant.softcap
        if codec == "pq":
            from safetensors.torch import load
            self.spec["num_subvectors"] = load(codebooks)["k"].shape[2]
        self._kv: KVStoreClient | None = None
        self._ids = itertools.count()
        self._prefix = f"hf-{os.getpid()}-{id(self):x}"
        self.fallbacks = 0
        register()
        self._configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
        self._old_attn = {k: c._attn_implementation for k, c in self._configs.items()}
        for k, c in self._configs.items():    # sub-configs (e.g. a decoder's) carry their own attribute
            if self._old_attn[k] != ATTN:
                _inner[k] = self._old_attn[k]
            c._attn_implementation = ATTN
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    # ----------------------------------------------------------- connection
    def client(self) -> KVStoreClient:
        """The live client; a fresh channel (and cache check) after a failure."""
        if self._kv is None:
            kv = KVStoreClient(self.target, timeout=self.timeout)
            try:
                kv.create_cache(self.cache_name, exist_ok=True, **self.spec)
                if self.codec == "pq" and not kv.get_cache(self.cache_name).has_codebooks:
                    kv.set_codebooks(self.cache_name, self.codebooks)
            except BaseException:
                kv.close()
                raise
            self._kv = kv
        return self._kv

    def broken(self, err: BaseException) -> None:
        """Note a failed RPC: warn, drop the channel so the next request reconnects."""
        self.fallbacks += 1
        code = err.code().name if isinstance(err, grpc.RpcError) else type(err).__name__
        warnings.warn(f"kvstore daemon unreachable ({code}): continuing in-process", RuntimeWarning, stacklevel=3)
        if self._kv is not None:
            try:
                self._kv.close()
            except Exception:
                pass
            self._kv = None

    def close(self) -> None:
        """Detach from the model (its attention goes back to what it was) and the daemon."""
        self._hook.remove()
        for k, c in self._configs.items():
            c._attn_implementation = self._old_attn[k]
            _inner.pop(k, None)
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    # ------------------------------------------------------------- requests
    def cache_for(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> KVStoreCache:
        """A cache for generating from input_ids [B, T]: sequences allocated in
        the daemon, a cached prefix (B == 1) retrieved so that generate() only
        runs the rest. Falls back to an in-process cache if the daemon fails."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask: padded batches are not supported; send sequences of equal length")
        b = input_ids.shape[0]
        seq_ids = [f"{self._prefix}-{next(self._ids)}" for _ in range(b)]
        try:
            kv = self.client()
            cached = []
            for i, sid in enumerate(seq_ids):
                prompt = input_ids[i].tolist() if b == 1 else []
                cached.append(kv.allocate(self.cache_name, sid, prompt))
                if cached[-1] == 0:
                    continue
                k, v = kv.retrieve(self.cache_name, sid, 0, cached[-1])       # [L, P, Hkv, d]
                if self.transform is not None:
                    k = torch.stack([self.transform.inverse(k[l].float(), l, "k") for l in range(self.num_layers)])
                    v = torch.stack([self.transform.inverse(v[l].float(), l, "v") for l in range(self.num_layers)])
                prefix = (k.transpose(1, 2).unsqueeze(1).to(self.model.dtype),
                          v.transpose(1, 2).unsqueeze(1).to(self.model.dtype))   # [L, 1, Hkv, P, d]
                return KVStoreCache(self, seq_ids, input_ids[:, :cached[0]], prefix)
            return KVStoreCache(self, seq_ids, input_ids[:, :0], None)
        except FALLBACK_ERRORS as e:
            self.broken(e)
            return KVStoreCache(self, [], input_ids[:, :0], None, local=True)

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """model.generate with a daemon cache, freed afterwards."""
        cache = self.cache_for(input_ids, kwargs.get("attention_mask"))
        try:
            return self.model.generate(input_ids, past_key_values=cache, **kwargs)
        finally:
            cache.release()

    def stats(self):
        """The daemon's CacheStats of this cache (None if unreachable)."""
        try:
            return self.client().stats(self.cache_name).caches[0]
        except FALLBACK_ERRORS as e:
            self.broken(e)
            return None

    @staticmethod
    def _pre_forward(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, KVStoreCache):
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache.begin_forward(ids)
