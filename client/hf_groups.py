"""Layer groups: a block table per group of layers that attend through the same window or
chunk, as vLLM's hybrid allocator keeps them, by composition of daemon caches.

The daemon gives every layer of a cache one block table (a block id addresses the same
slot in every layer), so a cache frees the blocks that left the window only when every
one of its layers slides (docs/design.md, Sliding windows). The adapter therefore makes
one cache per window: the global layers in one, each window's sliding layers in one,
each chunk size's chunked layers (Llama 4) in one, and maps every model layer to (its
group's cache, its index there). A model with one group (no sliding layer, or every
layer with the same window) keeps one cache under the name it was given. A sequence
lives in every group's cache under the same id and the same committed length; its prefix
hit is the shortest of its groups'.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class LayerGroup:
    cache: str                   # the daemon cache that holds these layers
    layers: tuple[int, ...]      # model layer indices, in order: layer layers[i] is the cache's layer i
    windows: tuple[int, ...]     # their sliding windows, in that order; () when none slides
    chunks: tuple[int, ...] = ()     # their attention chunks, in that order; () when none is chunked

    @property
    def window(self) -> int:
        """The window the daemon frees by: its layers' largest when every one slides, else 0."""
        return max(self.windows) if self.windows and all(self.windows) else 0

    def spec(self, base: dict) -> dict:
        """CreateCache fields of this group's cache from the model's (base: every layer's)."""
        out = dict(base, num_layers=len(self.layers))
        out.pop("layer_windows", None)
        out.pop("layer_chunks", None)
        if self.windows:
            out["layer_windows"] = list(self.windows)
        if self.chunks:
            out["layer_chunks"] = list(self.chunks)
        sinks = out.pop("sink_logits", None)
        if sinks:       # per layer and query head, layer-major: this group's layers' rows
            h = base["num_q_heads"]
            out["sink_logits"] = [x for layer in self.layers for x in sinks[layer * h:(layer + 1) * h]]
        return out

    def first_needed(self, length: int) -> int:
        """The first position of a prefix of `length` tokens the group's layers still
        read when the next token comes (its window's), what the daemon keeps of it."""
        return max(0, length - self.window) if self.window else 0


class LayerGroups:
    """The groups of a model's layers by window or chunk (windows, chunks: per layer, ()
    when none slides / is chunked). split=False: one cache for every layer, whatever their
    windows (correct, but a cache with a global layer keeps every block: the baseline the
    groups are measured against)."""

    def __init__(self, cache: str, windows: tuple[int, ...], num_layers: int, split: bool = True,
                 chunks: tuple[int, ...] = ()):
        by: dict[tuple[int, int], list[int]] = {}
        for layer in range(num_layers):
            by.setdefault((windows[layer] if windows else 0, chunks[layer] if chunks else 0), []).append(layer)
        if len(by) == 1 or not split:
            self.groups = [LayerGroup(cache, tuple(range(num_layers)), tuple(windows), tuple(chunks))]
        else:       # global first: it holds the model's every token
            self.groups = [LayerGroup(f"{cache}.w{w}" if w else f"{cache}.c{c}" if c else f"{cache}.global",
                                      tuple(layers), (w,) * len(layers) if w else (), (c,) * len(layers) if c else ())
                           for (w, c), layers in sorted(by.items())]
        self.where = [(0, 0)] * num_layers           # model layer -> (group index, layer in its cache)
        for gi, g in enumerate(self.groups):
            for i, layer in enumerate(g.layers):
                self.where[layer] = (gi, i)

    def __iter__(self):
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def caches(self) -> list[str]:
        return [g.cache for g in self.groups]

    def allocate(self, kv, sid: str, prompt: list[int]) -> int:
        """Allocate sid in every group's cache -> its prefix hit: the shortest of the
        groups' (a group that hit more allocates again with the prompt cut there)."""
        hits = [kv.allocate(c, sid, prompt) for c in self.caches()]
        while len(set(hits)) > 1:
            m = min(hits)
            for i, c in enumerate(self.caches()):
                if hits[i] > m:       # a block past m may have gone since: the loop takes the new minimum
                    kv.free(c, [sid])
                    hits[i] = kv.allocate(c, sid, prompt[:m + 1] if m else [])
        return hits[0]

    def at(self, layer: int) -> tuple[LayerGroup, int]:
        """(the group of model layer `layer`, its index in the group's cache)."""
        gi, i = self.where[layer]
        return self.groups[gi], i

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [L, ...] (every model layer) -> each group's layers [len(layers), ...]."""
        if len(self.groups) == 1:
            return [x]
        return [x[list(g.layers)] for g in self.groups]

    def merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """split()'s inverse: each group's [len(layers), ...] -> [L, ...]."""
        if len(self.groups) == 1:
            return parts[0]
        out = parts[0].new_zeros((len(self.where),) + tuple(parts[0].shape[1:]))
        for g, p in zip(self.groups, parts):
            out[list(g.layers)] = p
        return out


# CacheStats fields that add up over the group caches (memory and work of the model's
# layers); the others (tokens, sequences, prefix hits) are the model's as the global
# group counts them (the first group: every token of every sequence).
_SUMMED = ("bytes_per_token", "fp16_bytes_per_token", "used_bytes", "sealed_blocks", "dedup_blocks",
           "attend_calls", "window_freed_blocks", "main_reserved_bytes", "main_used_bytes", "tail_reserved_bytes",
           "tail_used_bytes", "host_used_bytes", "reserved_bytes")
_POOLS = ("main", "tail")


def merge_stats(stats: list):
    """The CacheStats of the group caches -> one for the model: bytes and blocks summed,
    effective bytes per token too (each group's is its layers' bytes over the tokens its
    GPU pools hold; a token takes them in every group)."""
    if len(stats) == 1:
        return stats[0]
    out = type(stats[0])()
    out.CopyFrom(stats[0])
    for s in stats[1:]:
        for f in _SUMMED:
            setattr(out, f, getattr(out, f) + getattr(s, f))
        for p in _POOLS:
            for f in ("capacity", "used", "cached", "free", "evictions"):
                setattr(getattr(out, p), f, getattr(getattr(out, p), f) + getattr(getattr(s, p), f))
    out.compression_ratio = out.fp16_bytes_per_token / out.bytes_per_token if out.bytes_per_token else 0.0
    out.effective_bytes_per_token = sum(s.effective_bytes_per_token for s in stats)
    out.cache = "+".join(s.cache for s in stats)
    return out
