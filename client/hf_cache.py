"""KVStoreCache: a transformers Cache whose K/V live in the kvstore daemon.

Shapes follow transformers: key/value states [B, Hkv, n, d], queries
[B, Hq, n, d], attention outputs [B, n, Hq, d]. The daemon takes [n, Hkv, d]
per layer and [L, n, Hkv, d] for all layers.
"""
from __future__ import annotations

import grpc
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin

from .hf_layers import DaemonStateLayer, linear_fields, new_layers
from .hf_step import begin_layer, set_decode_target, set_prefill_check
from .session import restarted

# What makes the adapter fall back in-process: RPC failures of any status and
# the shared-memory arena failing (the daemon took its buffer with it).
FALLBACK_ERRORS = (grpc.RpcError, OSError, MemoryError)
# The daemon gone, stopping, restarted (the sequence lost with it), or too slow to answer.
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.NOT_FOUND)
# A cache the daemon refuses to create: refused on every request, so an error, not a fallback.
SPEC_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)


class KVStoreCache(Cache):
    """One request's cache: B daemon sequences (seq_ids), `length` committed
    tokens. After a fallback (`local`), `layers` are ordinary DynamicLayers and
    the base Cache does everything.

    A hybrid model's layers that keep a recurrent or convolution state (linear
    attention, Mamba, short convolutions) keep it here, in transformers' own cache
    layers, at their model index; the daemon's cache holds the layers with K/V
    (adapter.variant.kv_index maps one to the other), and `_step`, `_prefix` and
    the [L, ...] tensors sent to the daemon count those layers only."""

    def __init__(self, adapter, seq_ids: list[str], seen_ids: torch.Tensor,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None, local: bool = False,
                 pads: list[int] | None = None, known_ids: torch.Tensor | None = None):
        self.adapter, self.seq_ids, self.local = adapter, seq_ids, local
        self.known_ids = known_ids      # [1, n] the prompt ids the daemon holds (Allocate's), or None
        self.forwards = 0               # the caller's forwards so far (a hit's tokens came without one)
        # Row i's first pads[i] positions are left padding: never sent to the
        # daemon, whose sequence i holds positions [pads[i], length).
        self.pads = pads or [0] * seen_ids.shape[0]
        self.num_layers = adapter.num_layers        # the daemon's: the layers that keep K/V
        super().__init__(layers=new_layers(self, local))
        self.length = seen_ids.shape[1]
        self._ids = seen_ids                          # [B, length] token ids so far (for a recompute)
        self._cur_ids: torch.Tensor | None = None     # this forward's ids (forward pre-hook)
        self._prefix = prefix                         # [L, B, Hkv, P, d] x2: K/V of tokens [0, length), or None
        self._step: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        # keep_kv: a prefill's K/V (prefix included) stay as the next forward's prefix, so
        # that a prompt run in parts (hf_states.py) retrieves nothing it has just computed
        self.keep_kv = False
        # multi: a forward of several tokens after earlier ones may take the daemon's
        # multi-token path; False where the rest after a hit retrieves (KVStoreAdapter.takes_codes)
        self.multi = True
        self._kept: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self.boundaries = None        # a hybrid model's states at decode block boundaries (hf_states.py)
        self.released = False
        self.masks_checked: set = set()      # this forward's (hf_variants.check_call)

    # ------------------------------------------------------- Cache interface
    @property
    def is_compileable(self) -> bool:
        """Never: generate() compiles (CUDA graphs on a GPU) the forward of a cache whose
        every layer says it can be, and a daemon decode step is an RPC, as is a fallback."""
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx) if self.local else self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, layer_idx) if self.local else (self.length + query_length, 0)

    def check_live(self) -> None:
        """ValueError for a cache used after release(): its daemon sequences are gone."""
        if self.released:
            raise ValueError("past_key_values: this kvstore cache was released (its daemon sequences freed; "
                             "adapter.generate releases the cache it returns): for the next turn pass the whole "
                             "conversation to adapter.generate, or a cache from adapter.cache_for(input_ids) to "
                             "model.generate; the turns so far are cached blocks its prompt hits")

    def begin_forward(self, input_ids: torch.Tensor | None) -> None:
        self.check_live()
        self.masks_checked = set()
        if self.boundaries is not None:
            self.boundaries.before_forward(self)
        self._cur_ids = input_ids
        b = len(self.pads)
        if input_ids is not None and input_ids.shape[0] != b and input_ids.shape[0] % b == 0:
            # generate() expanded the prompts: a hybrid model's first layers may be state
            # layers, whose states must have the new rows before they run
            self.batch_repeat_interleave(input_ids.shape[0] // b)

    # Beam search and expanded batches (num_beams, num_return_sequences): generate()
    # repeats the prompt rows after the cache was made, then reorders them every step.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        src = [i // repeats for i in range(len(self.pads) * repeats)]
        self._rows(src)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(indices.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        if self.local:
            return super().crop(tokens_to_remove)
        raise ValueError("crop: assisted / speculative generation (assistant_model, prompt_lookup_num_tokens) "
                         "is not supported by the kvstore adapter: a daemon sequence cannot drop its last tokens")

    def _rows(self, src: list[int]) -> None:
        """Row i becomes what row src[i] was. In the daemon, a row taken more than once
        is forked (its sealed blocks shared), a row no one takes is freed. In-process
        K/V and states are picked by row: transformers' linear-attention layers reorder
        but neither repeat nor select rows, which generate() asks of them too."""
        self.check_live()
        pick = torch.tensor(src, dtype=torch.long)
        old = len(self.pads)
        self.pads = [self.pads[j] for j in src]
        if self._ids is not None:
            self._ids = self._ids[pick.to(self._ids.device)]
        if self._prefix is not None:
            self._prefix = tuple(x[:, pick.to(x.device)] for x in self._prefix)
        self._pick_states(pick, old)
        if self.local:
            for layer in self.layers:
                if isinstance(layer, DynamicLayer):
                    DynamicLayer.reorder_cache(layer, pick)       # its K/V; a hybrid layer's state above
            return
        ad, old, new, kept, forks = self.adapter, self.seq_ids, [], set(), []
        for j in src:
            if j in kept:
                forks.append((old[j], f"{ad._prefix}-{next(ad._ids)}"))
                new.append(forks[-1][1])
            else:
                kept.add(j)
                new.append(old[j])
        self.seq_ids = new
        gone = [sid for i, sid in enumerate(old) if i not in kept]
        try:
            kv = ad.client()
            for cache in ad.groups.caches():
                for sid, nid in forks:
                    kv.fork(cache, sid, nid)
                if gone:
                    kv.free(cache, gone)
        except FALLBACK_ERRORS as e:
            self._fall_back(e, 0)        # recomputes every row from its (reordered) ids

    def _pick_states(self, pick: torch.Tensor, rows: int) -> None:
        """The in-process states' row i becomes row pick[i] (their reorder_cache; the
        layers lack batch_select_indices). A state that has not `rows` rows is left: a
        layer before the first K/V layer ran generate()'s expanded rows already."""
        for layer in self.layers:
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                continue
            for states in (layer.conv_states, layer.recurrent_states):
                for i, x in states.items():
                    if x is not None and x.shape[0] == rows:
                        states[i] = x.index_select(0, pick.to(x.device))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        n = key_states.shape[-2]
        begin_layer()         # a layer's step begins: its attention may take it
        ad = self.adapter
        at = ad.variant.kv_index(layer_idx)      # the daemon's layer
        if at < 0:
            raise ValueError(f"layer {layer_idx}: the model stores K/V in a layer whose layer_types entry keeps "
                             "none (the kvstore cache holds only its attention layers)")
        if key_states.shape[1] != ad.num_kv_heads or key_states.shape[-1] != ad.head_dim:
            raise ValueError(f"layer {layer_idx}: the model's K/V have {key_states.shape[1]} heads of "
                             f"{key_states.shape[-1]}, its config says {ad.num_kv_heads} of {ad.head_dim} "
                             "(the kvstore cache's geometry)")
        if key_states.shape[0] != len(self.pads):
            b = len(self.pads)
            if at != 0 or key_states.shape[0] % b:
                raise ValueError(f"kvstore: a batch of {key_states.shape[0]} rows for a cache of {b} sequences")
            self.batch_repeat_interleave(key_states.shape[0] // b)     # generate() expanded the prompts
        if self.local:
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        else:
            self._step[at] = (key_states, value_states)
            if self.length > 0 and (n == 1 or self._multi(n)):
                set_decode_target(self, layer_idx, (key_states, value_states))   # the attention call sends them
                # decode_attention ends the forward after the last layer's call, so that a
                # fallback there still has the step's K/V and the length before it
                return key_states, value_states
            set_prefill_check(self, layer_idx, self.length + n)
            out = self._prefill_update(key_states, value_states, at, layer_idx)
        if at == self.num_layers - 1:
            self._end_forward(n)
        return out

    def _multi(self, n: int) -> bool:
        """A forward of n > 1 tokens after earlier ones goes to the daemon as one
        multi-token AppendAttend a layer (adapter.chunk: None for the Retrieve path), but
        for K/V already in hand (_prefix): those are attended in-process."""
        return self.multi and bool(self.adapter.chunk) and n <= self.adapter.chunk and max(self.pads) <= self.length \
            and self._prefix is None

    def run_chunks(self, ids: torch.Tensor, chunk: int | None = None) -> None:
        """Run the tokens ids [B, n] after this cache's through the model (no logits) in
        forwards of up to chunk tokens (adapter.chunk: each layer's chunk is one
        AppendAttend with query_tokens, attended by the daemon from the codes)."""
        base, dev = self.adapter.model.base_model, self.adapter.model.device
        chunk = chunk or self.adapter.chunk
        for lo in range(0, ids.shape[1], chunk):
            part = ids[:, lo:lo + chunk]
            # positions given: some models (Bamba) count from 0 without them, whatever the cache holds
            pos = self.positions(self.length, self.length + part.shape[1])
            self.begin_forward(part)
            base(input_ids=part.to(dev), past_key_values=self, use_cache=True, position_ids=pos.to(dev))

    def positions(self, lo: int, hi: int) -> torch.Tensor:
        """position_ids [B, hi - lo] of positions [lo, hi): from 0 at a row's first real
        token, as generate() numbers left-padded rows; 0 on the padding, which masks hide."""
        return (torch.arange(lo, hi)[None] - torch.tensor(self.pads)[:, None]).clamp(min=0)

    # -------------------------------------------------------------- prefill
    def _prefill_update(self, k: torch.Tensor, v: torch.Tensor, at: int, layer: int):
        """A forward of n tokens: exact attention in-process over the prefix
        (retrieved) and the new tokens; at the last layer, one Append. at: the
        daemon's layer, layer: the model's."""
        if at == 0 and self._prefix is None and self.length > 0:
            try:                                       # a continuation chunk: fetch what came before
                self._prefix = self._retrieve_all()
            except Exception as e:
                self._fall_back(e, 0)
                return super().update(k, v, layer)
        if self._prefix is not None:
            k = torch.cat([self._prefix[0][at], k], dim=-2)
            v = torch.cat([self._prefix[1][at], v], dim=-2)
        if self.keep_kv:
            self._kept[at] = (k, v)
        if at == self.num_layers - 1:
            try:
                self._append_all()
            except Exception as e:
                self._fall_back(e, at)               # the layers before this one get their step's K/V
                return super().update(*self._step[at], layer)
        return k, v

    def _retrieve_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [L, B, Hkv, length, d] of the tokens so far; zeros where a row is
        padded, or where a sliding layer's window no longer reaches (the attention
        mask hides those positions; the daemon freed them: KVStoreAdapter.retrieve)."""
        ad = self.adapter
        kv, none = ad.client(), (self.num_layers, 0, ad.num_kv_heads, ad.head_dim)
        ks, vs = [], []
        for sid, pad in zip(self.seq_ids, self.pads):
            # a row still in its padding (a chunked prefill) has nothing in the daemon yet
            real = max(0, self.length - pad)
            k, v = ad.retrieve(kv, sid, real) if real else (self._step[0][0].new_zeros(none),) * 2   # [L, P, Hkv, d]
            ks.append(torch.nn.functional.pad(k.transpose(1, 2), (0, 0, self.length - real, 0)))
            vs.append(torch.nn.functional.pad(v.transpose(1, 2), (0, 0, self.length - real, 0)))
        at = dict(device=self._step[0][0].device, dtype=self._step[0][0].dtype)   # the step's dtype may not be the cache's
        return torch.stack(ks, dim=1).to(**at), torch.stack(vs, dim=1).to(**at)    # [L, B, Hkv, P, d]

    def _append_all(self) -> None:
        """Send the step's new tokens of every layer, less left padding:
        [L, sum(counts), Hkv, d], row i's counts[i] real tokens after row i-1's."""
        n = self._step[0][0].shape[2]
        k = torch.stack([s[0] for s in self._step]).transpose(2, 3)            # [L, B, n, Hkv, d]
        v = torch.stack([s[1] for s in self._step]).transpose(2, 3)
        k, v = self._to_daemon(k, "k"), self._to_daemon(v, "v")
        # a model whose RoPE depends on the length takes no hit: its blocks go unindexed
        have_ids = self._cur_ids is not None and self._cur_ids.shape[-1] == n and self.adapter.reuse
        rows, ks, vs, ids = [], [], [], []
        for i, sid in enumerate(self.seq_ids):
            skip = min(n, max(0, self.pads[i] - self.length))        # padding inside this forward
            if skip == n:
                continue
            rows.append(sid)
            ks.append(k[:, i, skip:])
            vs.append(v[:, i, skip:])
            ids.append(self._cur_ids[i, skip:].tolist() if have_ids else [])
        if rows:
            groups, kv = self.adapter.groups, self.adapter.client()
            k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
            for g, gk, gv in zip(groups, groups.split(k), groups.split(v)):
                kv.append(g.cache, rows, gk, gv, counts=[x.shape[1] for x in ks], token_ids=ids if have_ids else None)

    def _to_daemon(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """x [L, ..., Hkv, d] -> the transformed K'/V' the daemon stores."""
        t = self.adapter.transform
        if t is None:
            return x
        return torch.stack([t.forward(x[l].float(), l, which) for l in range(x.shape[0])])

    # --------------------------------------------------------------- decode
    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float):
        """q [B, Hq, n, d], k/v [B, Hkv, n, d] (n: 1, a decode step, or a chunk of up to
        adapter.chunk tokens) -> (out [B, n, Hq, d], k, v), or (None, K, V) with the full
        in-process K/V after a fallback."""
        t = self.adapter.transform
        b, hq, n, d = q.shape
        model_layer, layer = layer, self.adapter.variant.kv_index(layer)     # the daemon's from here on
        if hq != self.adapter.num_q_heads:
            raise ValueError(f"layer {model_layer}: the model's queries have {hq} heads, its config says "
                             f"{self.adapter.num_q_heads} (the kvstore cache's geometry)")
        k1, v1 = k.transpose(1, 2).reshape(b * n, -1, d), v.transpose(1, 2).reshape(b * n, -1, d)   # [B*n, H, d]
        q1 = q.transpose(1, 2).reshape(b * n, hq, d)
        if t is not None:
            k1, v1 = t.forward(k1.float(), layer, "k"), t.forward(v1.float(), layer, "v")
            inv_k, hkv = t._inv["k"][layer].to(q1.device), self.adapter.num_kv_heads
            q1 = per_kv_head(q1.float(), hkv, lambda x: torch.einsum("bhgd,hde->bhge", x, inv_k))
        # The new tokens' ids go with the first layer's call of each group's cache: the
        # daemon hashes generated tokens as their blocks fill, for the next turn's prefix hit.
        group, at = self.adapter.groups.at(layer)
        ids = self._cur_ids[:, -n:].reshape(-1).tolist() \
            if at == 0 and self._cur_ids is not None and self._cur_ids.shape[-1] >= n and self.adapter.reuse else None
        try:
            out = self.adapter.client().append_attend(group.cache, at, self.seq_ids, k1, v1, q1,
                                                      scale=scaling or 0.0, token_ids=ids, query_tokens=n)
        except Exception as e:
            self._fall_back(e, layer)
            full_k, full_v = super().update(k, v, model_layer)
            if layer == self.num_layers - 1:
                self._end_forward(n)
            return None, full_k, full_v
        if layer == self.num_layers - 1:
            self._end_forward(n)
        out = out.to(q.device)          # a remote daemon answers in host memory
        if t is not None:
            inv_v, hkv = t._inv["v"][layer].to(q.device), self.adapter.num_kv_heads
            out = per_kv_head(out.float(), hkv, lambda x: torch.einsum("bhgd,hed->bhge", x, inv_v))
        return out.to(q.dtype).view(b, n, hq, d), k, v

    # ------------------------------------------------------------- fallback
    def _fall_back(self, err: BaseException, done_layers: int) -> None:
        """Switch to in-process layers: recompute the tokens before this forward
        with the model, then add this forward's tokens of the daemon's layers <
        done_layers. In-process states stay as they are: they hold the tokens
        before this forward, and this forward's in the layers it has run."""
        if not isinstance(err, FALLBACK_ERRORS):
            raise err
        if isinstance(err, grpc.RpcError) and err.code() not in GONE and not restarted(err):
            self._free()        # the daemon is up and refused a call: its sequences would wait for the lease
        self.adapter.broken(err)
        # Full layers, sliding ones too: this forward's masks were built for the placeholder
        # layers (every token), and a sliding layer's mask picks its window out of them;
        # a DynamicSlidingWindowLayer would hand attention fewer keys than the mask has.
        dyn = DynamicCache()
        dyn.layers = new_layers(self, local=True)
        kv_layers = self.adapter.kv_layers
        if self._prefix is not None:
            for i, j in enumerate(kv_layers):
                dyn.layers[j].update(self._prefix[0][i], self._prefix[1][i])
        elif self.length > 0:
            if self._ids is None or self._ids.shape[1] != self.length:
                raise RuntimeError("kvstore: cannot recompute the cache in-process: token ids unknown") from err
            set_decode_target(None)
            base, dev = self.adapter.model.base_model, self.adapter.model.device
            mask = (torch.arange(self.length)[None, :] >= torch.tensor(self.pads)[:, None]).long()   # [B, length]
            base(input_ids=self._ids.to(dev), attention_mask=mask.to(dev), past_key_values=dyn, use_cache=True,
                 position_ids=self.positions(0, self.length).to(dev))
        for i in range(done_layers):
            dyn.layers[kv_layers[i]].update(*self._step[i])
        fields = linear_fields()
        for j, ours in enumerate(self.layers):
            if isinstance(ours, DaemonStateLayer):       # dyn's K/V, our state
                dyn.layers[j].__dict__.update({f: getattr(ours, f) for f in fields
                                               if f not in ("device", "dtype") or getattr(ours, f) is not None})
            elif isinstance(ours, LinearAttentionCacheLayerMixin):
                dyn.layers[j] = ours
        self.layers, self.local = dyn.layers, True
        self.seq_ids = []

    def _end_forward(self, n: int) -> None:
        if self._ids is not None:
            self._ids = torch.cat([self._ids, self._cur_ids.to(self._ids.device)], dim=1) \
                if self._cur_ids is not None and self._cur_ids.shape[-1] == n else None
        self._cur_ids = None
        kept = self._kept
        self._prefix = None if not self.keep_kv or any(x is None for x in kept) or self.local else \
            (torch.stack([k for k, _ in kept]), torch.stack([v for _, v in kept]))
        self._kept = [None] * self.num_layers
        self._step = [None] * self.num_layers
        if not self.local:
            self.length += n

    def release(self) -> None:
        """Free the daemon sequences (best effort). An in-process request of an
        adapter still calibrating hands its K/V (past padding and sinks) over."""
        ad = self.adapter
        kv = [self.layers[j] for j in ad.kv_layers] if self.layers else []
        if self.local and not ad._ready and ad.calibrate_tokens and kv and kv[0].keys is not None:
            sinks = ad.spec["sink_tokens"]
            k = torch.stack([layer.keys for layer in kv])             # [L, B, Hkv, T, d]
            v = torch.stack([layer.values for layer in kv])
            for i, pad in enumerate(self.pads):
                rows = (k[:, i, :, pad + sinks:].transpose(1, 2), v[:, i, :, pad + sinks:].transpose(1, 2))
                if rows[0].shape[1]:
                    ad.calibration_sample(self._to_daemon(rows[0], "k"), self._to_daemon(rows[1], "v"))
        if self.boundaries is not None:
            self.boundaries.release(self)
        self._free()
        self.released = True

    def _free(self) -> None:
        if self.seq_ids and not self.local:
            try:
                for cache in self.adapter.groups.caches():
                    self.adapter.client().free(cache, self.seq_ids)
            except FALLBACK_ERRORS:
                pass
        self.seq_ids = []


def per_kv_head(x: torch.Tensor, hkv: int, fn) -> torch.Tensor:
    """Apply fn to x [B, Hq, d] viewed as [B, Hkv, groups, d] (q head h reads KV head h // groups)."""
    b, hq, d = x.shape
    return fn(x.reshape(b, hkv, hq // hkv, d)).reshape(b, hq, d)
