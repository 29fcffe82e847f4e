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
    key (the tokens up to a boundary, chained per block) -> {model layer: its fields}.

    The first snapshot takes the whole budget at once, pinned where the states are on a
    GPU, and cuts it into slots of that snapshot's size (every snapshot of a model has
    the same shapes, B = 1). Keeping a snapshot is then an asynchronous copy into a free
    slot, or into the least recently used one's: no request pins memory, which costs
    ~0.9 ms per MiB on an H200 host, 17 ms for each snapshot of a 1.4 B Qwen3.5-style
    model (docs/design.md, Prefix sharing)."""

    def __init__(self, block_size: int, max_bytes: int):
        self.block_size, self.max_bytes = block_size, max_bytes
        self._snaps: OrderedDict[bytes, tuple[dict, int]] = OrderedDict()      # key -> (snapshot, slot)
        self._lock = threading.Lock()       # requests of one adapter may run on several threads
        self._memory: torch.Tensor | None = None      # uint8 [slots * slot_bytes]
        self.slot_bytes = 0
        self._free: list[int] = []
        self._written: dict[int, list] = {}           # slot -> CUDA events after the copies into it
        self.hits = self.stored = self.evicted = 0

    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def bytes(self) -> int:
        return len(self._snaps) * self.slot_bytes

    def keys(self, tokens: list[int], known: list[bytes] = ()) -> list[bytes]:
        """keys[i]: the key of tokens[:(i + 1) * block_size], for every full block; `known`:
        the keys of a prefix of tokens already, which the chain goes on from."""
        out, bs = list(known), self.block_size
        h = out[-1] if out else b""
        arr = np.asarray(tokens, dtype=np.int64)
        for i in range(len(out), len(tokens) // bs):
            h = hashlib.blake2b(h + arr[i * bs:(i + 1) * bs].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def longest(self, keys: list[bytes], limit: int) -> int:
        """The tokens of the longest boundary <= limit with a snapshot held; 0 when none."""
        with self._lock:
            for i in range(min(limit // self.block_size, len(keys)) - 1, -1, -1):
                if keys[i] in self._snaps:
                    return (i + 1) * self.block_size
        return 0

    def holds(self, key: bytes) -> bool:
        """The store has key's states (now its most recently used)."""
        with self._lock:
            if key in self._snaps:
                self._snaps.move_to_end(key)
                return True
        return False

    def copy_out(self, key: bytes) -> dict | None:
        """key's snapshot with its states copied to the devices they came from (their slot
        is free to be written again once this returns); None when not held (gone since)."""
        with self._lock:
            got = self._snaps.get(key)
            if got is None:
                return None
            self._snaps.move_to_end(key)
            snap, slot = got
            for ev in self._written.get(slot, ()):          # written from another stream, say
                ev.synchronize()
            out = _map_states(snap, lambda x, fields: x.to(fields["device"] or "cpu", copy=True, non_blocking=True))
            _synchronize(out)
            return out

    def put(self, key: bytes, states: dict) -> None:
        """Copy states ({model layer: fields}, on any device) into a slot under key. The
        copy is queued on the states' streams, before any later kernel there updates them."""
        size = _slot_size(states)
        with self._lock:
            if key in self._snaps:
                self._snaps.move_to_end(key)
                return
            if self._memory is None:
                slots = self.max_bytes // size if size else 0
                if not slots:
                    raise ValueError(f"state_cache_bytes={self.max_bytes} holds no snapshot of this model's "
                                     f"states ({size} bytes)")
                pinned = bool(_cuda_devices(states))
                self._memory = _host_bytes(slots * size, pinned)
                self.slot_bytes, self._free = size, list(range(slots - 1, -1, -1))
            if size > self.slot_bytes:
                log.warning("kvstore: a snapshot of %d bytes does not fit the %d-byte slots; not kept",
                            size, self.slot_bytes)
                return
            if not self._free:
                _, (_, slot) = self._snaps.popitem(last=False)
                self._free.append(slot)
                self.evicted += 1
            slot = self._free.pop()
            for ev in self._written.pop(slot, ()):        # a copy into it may still be queued
                ev.synchronize()
            at = slot * self.slot_bytes

            def into(x, fields):
                nonlocal at
                n = x.numel() * x.element_size()
                view = self._memory[at:at + n].view(x.dtype).view(x.shape)
                at += _aligned(n)
                return view.copy_(x.detach(), non_blocking=True)
            snap = _map_states(states, into)
            self._written[slot] = [torch.cuda.current_stream(d).record_event() for d in _cuda_devices(states)]
            self._snaps[key] = (snap, slot)
            self.stored += 1


ALIGN = 16      # a slot's tensors start at multiples of this: views of any dtype


def _host_bytes(n: int, pinned: bool) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=pinned)


def _tensors(fields: dict):
    for f in STATE_KINDS:
        for x in fields[f].values():
            if x is not None:
                yield x


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _slot_size(states: dict) -> int:
    return sum(_aligned(x.numel() * x.element_size()) for fields in states.values() for x in _tensors(fields))


def _cuda_devices(states: dict) -> set:
    return {x.device for fields in states.values() for x in _tensors(fields) if x.is_cuda}


def _synchronize(states: dict) -> None:
    for d in _cuda_devices(states):
        torch.cuda.current_stream(d).synchronize()


def _map_states(snap: dict, fn) -> dict:
    """The snapshot with fn(x, the layer's fields) applied to each of its state tensors;
    other fields as they are."""
    return {j: {f: {i: None if x is None else fn(x, fields) for i, x in v.items()} if f in STATE_KINDS else v
                for f, v in fields.items()} for j, fields in snap.items()}


def take(cache, copy_to=None) -> dict:
    """Row 0's state layers (a cache of one sequence): the live tensors, or copy_to's copies."""
    names = linear_fields()
    fields = {j: {f: copy.copy(getattr(layer, f)) for f in names} for j, layer in enumerate(cache.layers)
              if isinstance(layer, LinearAttentionCacheLayerMixin)}
    return fields if copy_to is None else _map_states(fields, lambda x, _: copy_to(x))


def _keep(ad, key: bytes, states) -> None:
    """Put states() in the adapter's store under key; nothing when it holds key already
    (the same tokens: the same states). Host memory refused (pinned memory past a
    locked-memory limit, say) or a budget too small for one snapshot: the adapter keeps no
    states from then on, saying why, and the request goes on without."""
    if ad.states.holds(key):
        return
    try:
        ad.states.put(key, states())
    except (RuntimeError, ValueError) as e:
        ad.states_off = f"keeping the states failed: {e}"
        log.warning("kvstore: %s; prompts of this model take no prefix hit from now on", ad.states_off)


class DecodeBoundaries:
    """The states at the last block boundary a request's decode steps crossed, for the
    next turn of a chat, which sends this prompt and the answer back: the daemon holds
    the answer's K/V (the decode steps send their token ids), and this snapshot lets the
    next prompt hit through the answer rather than at this prompt's end. Copied on the
    device before each forward that starts at a boundary (the states then hold exactly the
    tokens before it) and when the request ends, into one buffer; put in the store then."""

    def __init__(self, start: int, keys: list[bytes]):
        self.start = start          # the prompt's boundaries are kept already (stateful_cache)
        self.keys = keys            # the prompt's block keys, which the answer's go on from
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
            for j, fields in take(cache).items():      # the same shapes: copied in place
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
        keys = ad.states.keys(cache._ids[0, :self.at].tolist(), self.keys[:self.at // ad.states.block_size])
        _keep(ad, keys[-1], lambda: snap)


def restore(cache, snap: dict) -> None:
    """Put a snapshot's states (StateSnapshots.copy_out's, on their devices) into a fresh
    cache's state layers."""
    for j, fields in snap.items():
        layer = cache.layers[j]
        for f, value in fields.items():
            setattr(layer, f, dict(value) if f in STATE_KINDS else copy.copy(value))


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
    reach = hit = ad.groups.allocate(kv, sid, ids)
    snap, known = None, len(ids)        # the prompt ids the daemon holds
    while hit:      # the daemon's K/V reach past the states held: hit where they end
        held = store.longest(keys, hit)
        if held == hit and (snap := store.copy_out(keys[hit // bs - 1])) is not None:
            break
        for c in ad.groups.caches():
            kv.free(c, [sid])
        known = held + 1 if held else 0
        hit = ad.groups.allocate(kv, sid, ids[:known])
    cache = KVStoreCache(ad, seq_ids, input_ids[:, :hit], None, known_ids=input_ids[:, :known])
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
    cache.boundaries = DecodeBoundaries(cache.length, keys)
    return cache
