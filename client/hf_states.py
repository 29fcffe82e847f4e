"""Prefix hits for hybrid models: the recurrent states at a prompt's block boundaries.

The daemon holds a cached prefix's K/V, which is all an attention layer needs to skip
those tokens. A linear-attention, Mamba or convolution layer needs the state it had
reached at the prefix's end instead, and that is not in the daemon. The adapter keeps
those states in host memory, as snapshots at some of a prompt's block boundaries (below),
each keyed by the tokens up to its boundary (chained per block, as the daemon's prefix hashes are). A byte budget
bounds them, and the least recently used go first. A hit is then the longest prefix
for which the daemon has the K/V and the adapter has the states (vLLM's hybrid prefix
caching, which keeps Mamba states at block boundaries in its block pool, does the same).

A prompt's prefill stops where a later prompt may want to start:
- at the end of the daemon's hit, when that hit reaches past the states held (another
  process, or an evicted snapshot): the next prompt sharing that prefix hits;
- at the prompt's last block boundary: the same prompt again hits there.
So it runs in at most three forwards, and each boundary's states are copied to host
memory as they are. While it decodes, the states at the last block boundary its answer
crossed are copied on the device, and go to host memory when the request ends
(DecodeBoundaries): the next turn of a chat, which sends the prompt and the answer back,
hits through the answer.

The snapshots are per adapter (per process): other processes share the K/V, and each
computes a prefix's states once. A model whose multi-token forward does not start
from the states in its cache (transformers' Jamba runs a prompt's Mamba scan from
zero), or that keeps them outside the cache (RecurrentGemma, in its modules), takes no
hit: `continues_states` finds that out with the model once.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections import OrderedDict

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

from .hf_cache import KVStoreCache
from .hf_layers import linear_fields

log = logging.getLogger("kvstore.hf")
STATE_KINDS = ("conv_states", "recurrent_states")


class StateSnapshots:
    """The states of a model's state layers at prompt block boundaries, in host memory:
    key (the tokens up to a boundary, chained per block) -> {model layer: its fields}."""

    def __init__(self, block_size: int, max_bytes: int):
        self.block_size, self.max_bytes = block_size, max_bytes
        self._snaps: OrderedDict[bytes, tuple[dict, int]] = OrderedDict()
        self._lock = threading.Lock()       # requests of one adapter may run on several threads
        self.bytes = 0
        self.hits = self.stored = self.evicted = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def keys(self, tokens: list[int]) -> list[bytes]:
        """keys[i]: the key of tokens[:(i + 1) * block_size], for every full block."""
        out, h = [], b""
        bs = self.block_size
        arr = np.asarray(tokens, dtype=np.int64)
        for i in range(len(tokens) // bs):
            h = hashlib.blake2b(h + arr[i * bs:(i + 1) * bs].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def longest(self, keys: list[bytes], limit: int) -> tuple[int, dict | None]:
        """(tokens, snapshot) of the longest boundary <= limit tokens with a snapshot
        held; (0, None) when none."""
        with self._lock:
            for i in range(min(limit // self.block_size, len(keys)) - 1, -1, -1):
                got = self._snaps.get(keys[i])
                if got is not None:
                    self._snaps.move_to_end(keys[i])
                    return (i + 1) * self.block_size, got[0]
        return 0, None

    def put(self, key: bytes, snap: dict) -> None:
        n = snapshot_bytes(snap)
        if n > self.max_bytes:
            return
        with self._lock:
            old = self._snaps.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            while self._snaps and self.bytes + n > self.max_bytes:
                _, (_, m) = self._snaps.popitem(last=False)
                self.bytes -= m
                self.evicted += 1
            self._snaps[key] = (snap, n)
            self.bytes += n
            self.stored += 1


def _tensors(fields: dict):
    for f in STATE_KINDS:
        for x in fields[f].values():
            if x is not None:
                yield x


def snapshot_bytes(snap: dict) -> int:
    return sum(x.numel() * x.element_size() for fields in snap.values() for x in _tensors(fields))


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of x. From a GPU: into pinned memory, asynchronously; the copy is
    ordered on the stream before the next forward's kernels update x, and a restore
    copies back on that stream, so nothing waits for it."""
    if x.device.type != "cuda":
        return x.detach().clone()
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x.detach(), non_blocking=True)


def _map_states(snap: dict, fn) -> dict:
    """The snapshot with fn applied to each of its state tensors; other fields as they are."""
    return {j: {f: {i: None if x is None else fn(x) for i, x in v.items()} if f in STATE_KINDS else v
                for f, v in fields.items()} for j, fields in snap.items()}


def take(cache, copy_to=None) -> dict:
    """Row 0's state layers (a cache of one sequence) as copies (default: on the host)."""
    names = linear_fields()
    fields = {j: {f: copy.copy(getattr(layer, f)) for f in names} for j, layer in enumerate(cache.layers)
              if isinstance(layer, LinearAttentionCacheLayerMixin)}
    return _map_states(fields, copy_to or _to_host)


def _keep(ad, key: bytes, snapshot) -> None:
    """Put snapshot() (host copies) in the adapter's store. Pinned host memory refused (a
    locked-memory limit, say): the adapter keeps no states from then on, saying why, and
    the request goes on without."""
    try:
        snap = snapshot()
    except RuntimeError as e:
        ad.states_off = f"keeping the states failed: {e}"
        log.warning("kvstore: %s; prompts of this model take no prefix hit from now on", ad.states_off)
        return
    ad.states.put(key, snap)


class DecodeBoundaries:
    """The states at the last block boundary a request's decode steps crossed, for the
    next turn of a chat, which sends this prompt and the answer back: the daemon holds
    the answer's K/V (the decode steps send their token ids), and this snapshot lets the
    next prompt hit through the answer rather than at this prompt's end. Copied on the
    device before each forward that starts at a boundary (the states then hold exactly the
    tokens before it) and when the request ends, into one buffer; handed to the host store
    then."""

    def __init__(self, start: int):
        self.start = start          # the prompt's boundaries are kept already (stateful_cache)
        self.at, self.snap = 0, None

    def before_forward(self, cache) -> None:
        bs = cache.adapter.states.block_size
        n = cache.length
        if n <= self.start or n % bs or n == self.at or len(cache.pads) != 1 or cache.pads[0] or cache.local \
                or cache._ids is None or cache._ids.shape[1] != n:
            return
        if self.snap is None:
            self.snap = take(cache, copy_to=lambda x: x.detach().clone())
        else:
            for j, fields in take(cache, copy_to=lambda x: x).items():      # the same shapes: copied in place
                for f in STATE_KINDS:
                    for i, x in fields[f].items():
                        if x is not None:
                            self.snap[j][f][i].copy_(x)
        self.at = n

    def release(self, cache) -> None:
        self.before_forward(cache)      # a request ending on a boundary: the states there
        ad = cache.adapter
        if not self.at or cache.local or ad.states_off is not None or cache._ids is None:
            return
        snap, self.snap = self.snap, None
        _keep(ad, ad.states.keys(cache._ids[0, :self.at].tolist())[-1], lambda: _map_states(snap, _to_host))


def restore(cache, snap: dict) -> None:
    """Put a snapshot's states into a fresh cache's state layers, on their devices."""
    for j, fields in snap.items():
        layer = cache.layers[j]
        for f, value in fields.items():
            if f in STATE_KINDS:
                value = {i: None if x is None else x.to(fields["device"] or "cpu", copy=True, non_blocking=True)
                         for i, x in value.items()}
            else:
                value = copy.copy(value)
            setattr(layer, f, value)


def continues_states(model) -> str | None:
    """None when the model's multi-token forward starts from the states its cache holds
    (what a prompt continuing a cached prefix needs); else why not. For one layer of each
    stateful layer type: zeroing that layer's conv or recurrent state must change the
    output of a 4-token forward after 4 others. A model that ignores the state there
    (it starts from zero) gives the same bits either way."""
    try:
        return _continues_states(model)
    except Exception as e:          # the request that follows runs in full, and meets it too
        return f"the check failed: {e!r}"


def _continues_states(model) -> str | None:
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    first = {}
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = (torch.arange(8, device=model.device) * 7 + 3).remainder(vocab)[None]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
        want = model(input_ids=ids[:, 4:], past_key_values=copy.deepcopy(cache), use_cache=True).logits
        for j, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                first.setdefault(types[j], j)
        for t, j in first.items():
            if all(x is None for kind in STATE_KINDS for x in getattr(cache.layers[j], kind).values()):
                return (f"layer {j} ({t}) keeps its state outside the cache (in the model's modules), where "
                        "no snapshot can restore it")
            for kind in STATE_KINDS:
                states = getattr(cache.layers[j], kind)
                if all(x is None for x in states.values()):
                    continue
                probe = copy.deepcopy(cache)
                for x in getattr(probe.layers[j], kind).values():
                    if x is not None:
                        x.zero_()
                got = model(input_ids=ids[:, 4:], past_key_values=probe, use_cache=True).logits
                if torch.equal(got, want):
                    return (f"layer {j} ({t}) starts a multi-token forward from zero {kind.replace('_', ' ')}, "
                            "not from its cache's")
    return None


def stateful_cache(ad, kv, seq_ids: list[str], input_ids: torch.Tensor) -> KVStoreCache:
    """The cache of one prompt (input_ids [1, T], no padding) of a hybrid model: a hit
    where both the daemon's K/V and a snapshot of the states reach, the prompt run up to
    its boundaries (module docstring), the rest left to generate()."""
    store, sid = ad.states, seq_ids[0]
    ids = input_ids[0].tolist()
    bs = store.block_size
    keys = store.keys(ids)
    reach = hit = ad._allocate(kv, sid, ids)
    held, snap = store.longest(keys, hit)
    while hit > held:       # the daemon's K/V reach past the states held: hit where they end
        for c in ad.groups.caches():
            kv.free(c, [sid])
        hit = ad._allocate(kv, sid, ids[:held + 1] if held else [])
        held, snap = store.longest(keys, hit)
    cache = KVStoreCache(ad, seq_ids, input_ids[:, :hit], None)
    # After a hit the rest runs by the multi-token path (adapter.takes_codes), or retrieves
    # the prefix once; each part's K/V computed in-process stay as the next part's prefix.
    codes = bool(hit) and ad.takes_codes(hit, len(ids) - hit)
    if hit:
        restore(cache, snap)
        store.hits += 1
        ad.prefix_runs["codes" if codes else "retrieve"] += 1
    cache.keep_kv, cache.multi = not codes, codes or not hit
    last = (len(ids) - 1) // bs * bs
    for stop in sorted({reach, last}):
        if stop <= cache.length or cache.local:
            continue
        cache.run_chunks(input_ids[:, cache.length:stop], chunk=None if codes else stop - cache.length)
        if not cache.local and ad.states_off is None:
            _keep(ad, keys[stop // bs - 1], lambda: take(cache))
    cache.keep_kv = False
    cache.boundaries = DecodeBoundaries(cache.length)
    return cache
