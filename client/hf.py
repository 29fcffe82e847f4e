"""Hugging Face transformers adapter: `model.generate()` with the KV cache in the daemon.

    from kvstore.client.hf import KVStoreAdapter
    adapter = KVStoreAdapter(model, "unix:///tmp/kvstore-1000/kvstore.sock", cache="smollm2", codec="fp16")
    out = adapter.generate(input_ids, max_new_tokens=200, do_sample=False)
    # or by hand:
    cache = adapter.cache_for(input_ids)          # Allocate (prefix hit -> Retrieve)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=200)
    cache.release()                               # Free

How a step runs (any decoder-only model whose attention calls `past_key_values.update` then
the registered attention function: Llama, Qwen2/3, SmolLM, Mistral, Phi-3, Gemma-2/3/4,
Llama 4, gpt-oss, GPT-2, GPTBigCode, GPT-NeoX, OPT, hybrid models and more: sliding-window
and chunked layers, logit soft-capping and learned sink logits go to the daemon with the
cache spec, hf_variants.py; what it cannot run is refused at construction, naming the
feature, or where only the model's forward shows it (a window, chunk or head count other
than its config's) at the first step, before the daemon attends):
  - prefill (a forward of n > 1 tokens): attention in-process on exact K/V, by
    the model's own attention implementation (eager for Gemma-2's soft-cap), under the
    mask the daemon's sequences stand for (another is refused: hf_masks.py); the last
    layer's update sends all layers' new tokens in one Append with their token ids.
  - after a prefix hit, the multi-token path (prefix_path="codes", or "auto", the
    default, when codes_suffix_limit(hit) tokens or fewer follow the hit): the prompt's
    other tokens but the last run through the model in chunks of up to 128 (pq: residual
    + 1), each layer's chunk one `AppendAttend` with query_tokens (appended, then attended
    causally by the daemon from the codes); generate() then starts from the last prompt
    token. The Retrieve path (prefix_path="retrieve", "auto" past that bound, and any
    model with sliding-window layers): the cached prefix comes back from `Retrieve` onto
    the model's device, dequantized; the rest is a prefill as above (docs/kernels.md).
  - decode (one token): `KVStoreCache.update` keeps nothing; the attention function
    "kvstore" sends (k, v, q) of the layer to `AppendAttend`.
  - the daemon is unreachable (any RPC error: UNAVAILABLE or CANCELLED as it stops, NOT_FOUND
    after a restart lost the sequence): a warning, then the cache recomputes the tokens so
    far into in-process DynamicLayers and generation goes on there. The adapter drops its
    channel; the next request reconnects (re-making the cache and codebooks if need be).
Hybrid models (Qwen3.5, Jamba, Bamba, Granite 4, Nemotron-H, Falcon-H1): the daemon's cache
holds the layers that keep K/V, numbered among themselves (variant.kv_index); linear-
attention, Mamba and convolution layers keep their state in transformers' own cache layers
in-process. The daemon holds a cached prefix's K/V but not those states, so the adapter
keeps them, at prompt block boundaries, in host memory (hf_states.py): a prompt hits where
both reach.
Layers that attend through different windows or chunks (Gemma-2/3, Qwen2 with
max_window_layers, Llama 4) go to one daemon cache per window (hf_groups.py: the global
layers in `<cache>.global`, each window's in `<cache>.w<window>`, each chunk size's in
`<cache>.c<chunk>`), so that the sliding layers' cache frees the blocks that left their
window; a model with one group keeps the one cache `cache`.
Batches of B sequences: left-padded prompts (attention_mask) are stored without their
padding, each row a sequence of its own tokens; prefix reuse is for B == 1 unpadded.
Beam search and num_return_sequences: generate() repeats the rows and reorders them every
step; a row taken twice is forked in the daemon (its sealed blocks shared), a row no beam
keeps is freed.
Assisted / speculative generation (crop) and use_cache=False are refused.
Token ids go with every append, decode steps included, so a later prompt that continues
prompt + answer (the next turn of a chat) hits the cached blocks of both."""
from __future__ import annotations

import itertools
import math
import os
import warnings

import grpc
import torch

from . import hf_masks, hf_variants
from .client import KVStoreClient
from .hf_cache import FALLBACK_ERRORS, GONE, SPEC_REFUSED, KVStoreCache
from .hf_codebooks import CacheBooks, bad_transform, fitting_codebooks
from .hf_attention import install, register, restore
from .hf_step import check_all_taken, set_decode_target, set_prefill_check
from .hf_groups import LayerGroups, merge_stats
from .hf_states import StateSnapshots, continues_states, stateful_cache
from .session import restarted

DEFAULT_PQ_SINKS = 32     # docs/accuracy.md: 32 sinks keep 4-bit PQ within 0.16 % of fp16 at R = 128
MAX_QUERY_TOKENS = 128      # the daemon's bound on an AppendAttend's query_tokens (kvstore.proto)
# prefix_path="auto": after a hit of CODES_MIN_HIT tokens or more, up to CODES_MAX_SUFFIX more take
# the multi-token path, else Retrieve: it was the faster at 8K and 16K for any rest of 16-256 tokens,
# the multi-token path by 9-16 % at 32K up to 128 (H200: docs/kernels.md, Time to first token).
CODES_MIN_HIT, CODES_MAX_SUFFIX = 24576, 128


def codes_suffix_limit(cached: int) -> int:
    return CODES_MAX_SUFFIX if cached >= CODES_MIN_HIT else 1     # 1: the last token decodes, nothing to retrieve


class KVStoreAdapter:
    """Binds a model to a daemon cache. codec "fp16" or "pq". codebooks: a codebooks file
    (bytes or path, kvstore-calibrate's output or GetCodebooks'), checked against the model
    (geometry, model id: ValueError naming codebooks.<field>); a file that carries a
    transform applies it here. Files of the old format (no description) need `transform`: a
    kvstore.codec.transform.Transform or "none" (a path finds the transform file
    kvstore-calibrate wrote beside it). No file: the cache's codebooks, transform and bit
    width (ValueError naming codebooks where it has none); or, with calibrate_tokens,
    requests run in-process until the cache has seen that many tokens (past the sinks),
    whose K/V then go to TrainCodebooks; the daemon from then on. model_id: the cache's
    label; None: the model's hub id (a file naming a model must name it), else (a model
    loaded from a local path) a hash of its weights, whatever model a file names. The
    cache's spec: block_size (tokens a block), residual
    (pq: the newest tokens kept in fp16 besides the open block), num_blocks (its GPU pool),
    max_sequences (sequences it holds at once); sink_tokens: the first tokens of every
    sequence the daemon keeps in fp16; None: the file's, else 32 for pq (rounded up to a
    whole block), which keeps 4-bit PQ within 0.5 % perplexity of fp16 at R = 128
    (docs/accuracy.md). timeout: seconds an RPC may take before the request falls back
    in-process. prefix_path: how the rest of a prompt that hit a cached prefix runs:
    "codes" (multi-token AppendAttend, nothing retrieved), "retrieve" (Retrieve the prefix,
    prefill in-process; models with sliding windows always take it) or "auto" (codes for up
    to codes_suffix_limit(hit) tokens: 128 after a hit of 24K or more, else retrieve).
    prefix_runs counts the requests that took each. state_cache_bytes: host memory for a
    hybrid model's recurrent states at prompt block boundaries, which let its prompts hit a
    cached prefix (hf_states.py; 0: every prompt runs in full). layer_groups=False keeps one
    daemon cache for every layer of a model that mixes windows (hf_groups.py: correct, but
    every block stays), the baseline the per-group caches save against."""

    def __init__(self, model, target: str | None = None, cache: str = "hf", codec: str = "fp16",
                 codebooks: bytes | str | None = None, transform=None, block_size: int = 16, residual: int = 128,
                 num_blocks: int = 4096, max_sequences: int = 64, model_id: str | None = None,
                 timeout: float = 30.0, sink_tokens: int | None = None, calibrate_tokens: int = 0,
                 prefix_path: str = "auto", layer_groups: bool = True, state_cache_bytes: int = 1 << 30):
        if prefix_path not in ("auto", "codes", "retrieve"):
            raise ValueError(f"prefix_path must be 'auto', 'codes' or 'retrieve', got {prefix_path!r}")
        if state_cache_bytes < 0:
            raise ValueError(f"state_cache_bytes must be >= 0, got {state_cache_bytes}")
        if codec == "pq" and codebooks is None and calibrate_tokens and calibrate_tokens < 256:
            raise ValueError(f"calibrate_tokens: the daemon trains codebooks on 256 tokens or more, got "
                             f"{calibrate_tokens} (0 with no codebooks file: the adapter takes the cache's)")
        c = model.config.get_text_config(decoder=True)
        self.variant = hf_variants.detect(model, c)       # ValueError naming what the daemon cannot run
        self.reuse = not hf_variants.length_dependent_rope(c)     # else a prompt takes no cached prefix
        # The daemon's cache holds the layers that keep K/V (all but a hybrid model's linear
        # attention, Mamba or convolution layers, whose state stays in-process): "layer" on
        # the adapter's side of the daemon is an index among those.
        self.model_layers = c.num_hidden_layers
        self.kv_layers = tuple(j for j in range(self.model_layers) if self.variant.kv_index(j) >= 0)
        self.num_layers = len(self.kv_layers)
        self.num_q_heads, self.num_kv_heads, self.head_dim = hf_variants.heads(c)
        named = getattr(c, "_name_or_path", "") or ""
        # A local path (or no name) says nothing of which weights a model has: its weights
        # name it, so that a cache made for other weights is refused rather than shared,
        # also where a codebooks file (which fits any weights of its geometry) names a model.
        self._by_weights = not model_id and (not named or os.path.exists(named))
        cb, self._sinks_given = None, sink_tokens is not None
        if codec == "pq" and codebooks is not None:
            cb, transform = fitting_codebooks(codebooks, transform, model_id or named, model_id is not None,
                                              (self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim))
            model_id = model_id or (None if self._by_weights or cb.info is None else cb.info.model_id)
        if self._by_weights:
            model_id = hf_variants.weights_id(model)
            if cb is not None and cb.info is not None:     # the file, as the daemon checks it, is for this label
                cb = cb.describe(model_id, cb.info.num_q_heads, cb.info.sink_tokens, cb.info.calibrated_on)
        if cb is not None:
            if sink_tokens is None and cb.info is not None and cb.info.sink_tokens:
                sink_tokens = cb.info.sink_tokens
        elif isinstance(transform, str):
            transform = None if transform == "none" else bad_transform(transform)
        if sink_tokens is None:
            sink_tokens = math.ceil(DEFAULT_PQ_SINKS / block_size) * block_size if codec == "pq" else 0
        self.model, self.target, self.cache_name, self.codec = model, target, cache, codec
        self.groups = LayerGroups(cache, self.variant.windows, self.num_layers, split=layer_groups,
                                  chunks=self.variant.chunks)
        # Each group's cache gets the codebooks of its layers (the file holds every layer's).
        self.books = CacheBooks(([cb] if len(self.groups) == 1 else [cb.layers(g.layers) for g in self.groups])
                                if cb is not None else None, transform, cb.sha256() if cb is not None else "")
        self.transform, self.timeout = transform, timeout
        # Tokens one AppendAttend may bring a sequence: the daemon's bound, and on pq the
        # residual + 1 newest tokens it keeps in fp16 until they are attended.
        self.chunk = None if prefix_path == "retrieve" or self.variant.windows or self.variant.chunks else \
            min(MAX_QUERY_TOKENS, residual + 1) if codec == "pq" else MAX_QUERY_TOKENS
        self.prefix_path = prefix_path
        self.states = StateSnapshots(block_size, state_cache_bytes) if self.variant.has_state else None
        # why a hybrid model's prompts take no prefix hit (None: they do; "": not known yet)
        self.states_off = None if self.states is None else "" if state_cache_bytes else "state_cache_bytes is 0"
        self.prefix_runs = {"codes": 0, "retrieve": 0}     # requests after a prefix hit, by path
        self.calibrate_tokens = calibrate_tokens if codec == "pq" and cb is None else 0
        self._samples: list[tuple[torch.Tensor, torch.Tensor]] = []    # [L, n, Hkv, d] K/V for TrainCodebooks
        self.spec = dict(model_id=model_id or named or type(model).__name__,
                         num_layers=self.num_layers, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, dtype="bfloat16" if model.dtype == torch.bfloat16 else "float16",
                         codec=codec, block_size=block_size, residual=residual, num_blocks=num_blocks,
                         max_sequences=max_sequences, sink_tokens=sink_tokens)
        self.spec.update(self.variant.spec())
        if cb is not None:
            self.spec["num_subvectors"] = cb.k.shape[2]
        self._kv: KVStoreClient | None = None
        self._ready = codec != "pq" or cb is not None     # the daemon's cache has what it needs to store
        self._ids = itertools.count()
        self.fallbacks = 0
        register()
        # sub-configs (e.g. a decoder's) carry their own attribute
        self._configs = list({id(m.config): m.config for m in model.modules()
                              if getattr(m, "config", None) is not None}.values())
        self._old_attn = install(self._configs)
        self._hooks = (model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._post_forward))

    @property
    def _prefix(self) -> str:
        """Its sequence ids' prefix: the process's (a fork() child's ids are not its parent's)."""
        return f"hf-{os.getpid()}-{id(self):x}"

    # ----------------------------------------------------------- connection
    def client(self) -> KVStoreClient:
        """The live client; a fresh channel (and cache check) after a failure, and in a
        fork() child of the process that made it (a client is its process's)."""
        if self._kv is not None and self._kv.session.forked:
            self._kv.close()
            self._kv = None
        if self._kv is None:
            kv = KVStoreClient(self.target, timeout=self.timeout)
            cache = None
            try:
                if self.codec == "pq" and self.books.files is None and not self.calibrate_tokens:
                    self.books.join(kv, self.groups, self.spec, self._sinks_given)
                for g in self.groups:
                    cache = g.cache
                    kv.create_cache(g.cache, exist_ok=True, **g.spec(self.spec))
                if self.codec == "pq":
                    self._ready, self.transform = self.books.reconcile(kv, self.groups)
            except BaseException as e:
                kv.close()
                if isinstance(e, grpc.RpcError) and e.code() in SPEC_REFUSED:
                    named = " (this model, loaded from a local path, is named by its weights: model_id= names " \
                        "it)" if self._by_weights and "model_id" in (e.details() or "") else ""
                    raise ValueError(f"kvstore cache {cache!r}: the daemon refuses it: {e.code().name}: "
                                     f"{e.details()}{named}") from None
                raise
            self._kv = kv
        return self._kv

    def broken(self, err: BaseException) -> None:
        """Note a failed RPC: warn, drop the channel so the next request reconnects."""
        self.fallbacks += 1
        if isinstance(err, grpc.RpcError) and restarted(err):
            what = "kvstore daemon restarted (this request's sequences were of the daemon before)"
        elif isinstance(err, grpc.RpcError) and err.code() not in GONE:
            what = f"kvstore daemon refused a call ({err.code().name}: {err.details()})"
        else:
            what = f"kvstore daemon unreachable ({err.code().name if isinstance(err, grpc.RpcError) else repr(err)})"
        warnings.warn(f"{what}: continuing in-process", RuntimeWarning, stacklevel=3)
        if self._kv is not None:
            try:
                self._kv.close()
            except Exception:
                pass
            self._kv = None

    def close(self) -> None:
        """Detach from the model (its attention goes back to what it was) and the daemon."""
        for h in self._hooks:
            h.remove()
        restore(self._configs, self._old_attn)
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    # ------------------------------------------------------------- requests
    def cache_for(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  reuse_prefix: bool = True) -> KVStoreCache:
        """A cache for generating from input_ids [B, T], left-padded where
        attention_mask [B, T] is 0: each row is a daemon sequence of its own
        tokens only. A cached prefix (B == 1, no padding) is retrieved so that
        generate() only runs the rest. reuse_prefix=False: none is, and the daemon
        is not told the prompt's ids, so that the whole prompt runs (inputs_embeds,
        whose K/V then go without ids; hidden states of every prompt token). Falls
        back to an in-process cache if the daemon fails."""
        b, t = input_ids.shape
        pads, reuse_prefix = [0] * b, reuse_prefix and self.reuse
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(f"attention_mask: a 2-D mask [batch, tokens] (as generate() takes), got "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask is not None:
            mask = attention_mask.to(torch.long).cpu()
            pads = (t - mask.sum(-1)).tolist()
            if any(not bool(row[p:].all()) or bool(row[:p].any()) for row, p in zip(mask, pads)):
                raise ValueError("attention_mask: only left padding is supported (zeros, then ones, per row): "
                                 "tokenize with padding_side='left'")
            if any(p == t for p in pads):
                raise ValueError("attention_mask: a row has no tokens")
        seq_ids = [f"{self._prefix}-{next(self._ids)}" for _ in range(b)]
        try:
            kv = self.client()
            if self.codec == "pq" and self.books.changed(kv, self.groups):     # replaced since: again
                self._ready, self.transform = self.books.reconcile(kv, self.groups)
            if not self._ready:           # calibrating: in-process until TrainCodebooks (release())
                return KVStoreCache(self, [], input_ids[:, :0], None, local=True, pads=pads)
            if reuse_prefix and self.states is not None and b == 1 and not pads[0] and self._state_hits():
                return stateful_cache(self, kv, seq_ids, input_ids)
            for i, sid in enumerate(seq_ids):
                # A hit stands in for running the prompt's first tokens; a model whose layers
                # keep a recurrent state can only take one with the state there (above).
                by_ids = reuse_prefix and b == 1 and not pads[0] and not self.variant.has_state
                cached = self.groups.allocate(kv, sid, input_ids[i].tolist() if by_ids else [])
                if cached == 0:
                    continue
                if self.takes_codes(cached, t - cached):
                    self.prefix_runs["codes"] += 1
                    cache = KVStoreCache(self, seq_ids, input_ids[:, :cached], None, known_ids=input_ids)
                    cache.run_chunks(input_ids[:, cached:-1])       # generate() runs the last token
                    return cache
                self.prefix_runs["retrieve"] += 1
                # [L, P, Hkv, d] -> [L, 1, Hkv, P, d]; the model's dtype may not be the cache's
                prefix = tuple(x.transpose(1, 2).unsqueeze(1).to(self.model.dtype)
                               for x in self.retrieve(kv, sid, cached))
                return KVStoreCache(self, seq_ids, input_ids[:, :cached], prefix, known_ids=input_ids)
            return KVStoreCache(self, seq_ids, input_ids[:, :0], None, pads=pads, known_ids=input_ids if by_ids else None)
        except FALLBACK_ERRORS as e:
            self.broken(e)
            return KVStoreCache(self, [], input_ids[:, :0], None, local=True, pads=pads)

    def takes_codes(self, cached: int, rest: int) -> bool:
        """The rest of a prompt that hit `cached` tokens runs by the multi-token path. A hybrid
        model's ("auto") only when it fits one forward too: its forwards have a large fixed
        cost (docs/design.md, Prefix sharing)."""
        limit = min(codes_suffix_limit(cached), (self.chunk or 0) if self.variant.has_state else CODES_MAX_SUFFIX)
        return bool(self.chunk) and (self.prefix_path == "codes" or rest <= limit)

    def _state_hits(self) -> bool:
        """A hybrid model's prompt may take a prefix hit: snapshots are kept and the model
        continues its states in a multi-token forward (checked once, with the model)."""
        if self.states_off == "":
            self.states_off = continues_states(self.model)
        return self.states_off is None

    def retrieve(self, kv: KVStoreClient, sid: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, length, Hkv, d] of sid's first `length` tokens, on the model's device,
        as the model computed them (the client's transform undone): each group's from the
        first position its window still reads (what the daemon keeps), zeros before it
        (positions the windows mask out)."""
        ks, vs = [], []
        for g in self.groups:
            lo = g.first_needed(length)
            k, v = kv.retrieve(g.cache, sid, lo, length, device=self.model.device)
            ks.append(torch.nn.functional.pad(k, (0, 0, 0, 0, lo, 0)))
            vs.append(torch.nn.functional.pad(v, (0, 0, 0, 0, lo, 0)))
        k, v, t = self.groups.merge(ks), self.groups.merge(vs), self.transform
        if t is None:
            return k, v
        return tuple(torch.stack([t.inverse(x[l].float(), l, n) for l in range(self.num_layers)])
                     for x, n in ((k, "k"), (v, "v")))

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """model.generate with a daemon cache, freed afterwards. A batch of
        prompts of different lengths: left-padded, with its attention_mask. With
        inputs_embeds (what the model runs), or output_hidden_states (of every prompt
        token), the prompt takes no cached prefix (cache_for's reuse_prefix)."""
        input_ids = input_ids if input_ids is not None else kwargs.pop("inputs", None)     # generate()'s name
        hf_variants.check_generate(self.model, kwargs)
        embeds = kwargs.get("inputs_embeds")
        if input_ids is None and embeds is None:
            raise ValueError("input_ids: adapter.generate needs the prompt's input_ids (or inputs_embeds)")
        reuse = embeds is None and not hf_variants.generate_setting(self.model, kwargs, "output_hidden_states", False)
        ids = input_ids if input_ids is not None or embeds is None else \
            torch.zeros(embeds.shape[:2], dtype=torch.long)      # its shape alone: no ids reach the daemon
        cache = self.cache_for(ids, hf_variants.generate_mask(self.model, input_ids, kwargs), reuse_prefix=reuse)
        try:
            return self.model.generate(input_ids, past_key_values=cache, **kwargs)
        finally:
            cache.release()

    def calibration_sample(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [L, n, Hkv, d] (after RoPE, past the sinks) of a request run
        in-process while the cache has no codebooks: once calibrate_tokens are
        in, TrainCodebooks on them, and the daemon stores from then on."""
        if self._ready or not self.calibrate_tokens:
            return
        self._samples.append((k.float().cpu(), v.float().cpu()))
        if sum(x.shape[1] for x, _ in self._samples) < self.calibrate_tokens:
            return
        ks = torch.cat([x for x, _ in self._samples], dim=1)[:, :self.calibrate_tokens]
        vs = torch.cat([y for _, y in self._samples], dim=1)[:, :self.calibrate_tokens]
        try:
            kv = self.client()
            dt = getattr(torch, self.spec["dtype"])
            for g, gk, gv in zip(self.groups, self.groups.split(ks), self.groups.split(vs)):
                if not kv.get_cache(g.cache).has_codebooks:     # another worker may have trained them
                    kv.train_codebooks(g.cache, gk.to(dt).contiguous(), gv.to(dt).contiguous())
            self._ready, self._samples = True, []
        except FALLBACK_ERRORS as e:
            self.broken(e)

    def stats(self):
        """The daemon's CacheStats of this model's cache (None if unreachable); with
        several layer groups, their caches' as one (hf_groups.merge_stats): bytes and
        blocks summed, tokens and prefix hits the global group's."""
        got = self.stats_by_group()
        return None if got is None else merge_stats([s for _, s in got])

    def stats_by_group(self):
        """[(LayerGroup, its cache's CacheStats)] (None if unreachable)."""
        try:
            kv = self.client()
            return [(g, kv.stats(g.cache).caches[0]) for g in self.groups]
        except FALLBACK_ERRORS as e:
            self.broken(e)
            return None

    @staticmethod
    def _pre_forward(module, args, kwargs):
        set_decode_target(None)     # ones an exception left in an earlier forward
        set_prefill_check(None)
        cache = kwargs.get("past_key_values")
        if isinstance(cache, KVStoreCache):
            hf_variants.check_forward(module, kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            hf_masks.check_continues(cache, kwargs, ids if ids is not None else kwargs.get("inputs_embeds"))
            hf_masks.check_known_ids(cache, ids)
            if not cache.forwards and cache.length and hf_variants.forward_setting(module, kwargs, "output_hidden_states"):
                raise ValueError(f"output_hidden_states: the kvstore cache starts with {cache.length} cached tokens, so "
                                 "the forward's hidden states would cover the rest of the prompt only: make the "
                                 "cache with adapter.cache_for(input_ids, reuse_prefix=False)")
            cache.forwards += 1
            cache.begin_forward(ids)

    @staticmethod
    def _post_forward(module, args, output):
        check_all_taken()
