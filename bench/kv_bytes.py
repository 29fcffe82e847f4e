"""KV bytes per token of one long sequence: on paper, from the cache's own sizes
(CacheConfig), and measured, from a CPU engine's own accounting (the bytes its pools
hold after the sequence was appended, Stats' used_bytes). One table: one cache for every
layer (a block holds a token's K/V of all layers, sliding or not: a global layer keeps
every block). Per group: one cache per window, as the HF adapter makes them
(client/hf_groups.py); the cache of sliding layers releases the blocks that left its
window (engine/window.py), vLLM's hybrid allocator. The baseline is the fp16 codec with
one table, measured in the same run.

    python bench/kv_bytes.py                       # Gemma-3-1B-like: 26 layers, 5:1, window 512, 32K
    python bench/kv_bytes.py --codecs fp16         # the fp16 codec only (pq encodes 32K tokens on the CPU)
    python bench/kv_bytes.py --layers 62 --kv-heads 16 --head-dim 128 --window 1024 --paper-only
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine.engine import Engine


def windows(layers: int, window: int, pattern: int) -> tuple[int, ...]:
    """Gemma-3's layer_types: every pattern-th layer global, the others slide."""
    return tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers))


def stored_bytes(cfg: CacheConfig, context: int) -> int:
    """Bytes the pools hold for one sequence of `context` committed tokens, as the engine
    lays it out: sealed blocks (PQ codes, or fp16 for the fp16 codec) and, for pq, the
    fp16 sinks and tail blocks (core/sequence.py). Every layer keeps every token."""
    bs = cfg.block_size
    fp16_block = cfg.fp16_bytes_per_token() * bs
    if cfg.codec.kind == "fp16":
        return math.ceil(context / bs) * fp16_block
    sealed = max(0, math.ceil((context - cfg.sinks - cfg.residual - bs) / bs))
    tail = math.ceil((context - sealed * bs) / bs)        # sinks + the tail after the sealed blocks
    return sealed * cfg.bytes_per_block() + tail * fp16_block


def per_group_bytes(cfg: CacheConfig, context: int) -> int:
    """The same with a block table per layer group whose sliding layers free the blocks
    that left their window (the hybrid allocator): a sliding layer holds what a sequence
    of its window plus one block holds (for pq: sinks, fp16 tail and sealed codes), a
    global layer everything."""
    g, w = cfg.geometry, cfg.layer_windows
    per_layer = stored_bytes(cfg, context) / g.num_layers
    bs = cfg.block_size
    total = 0.0
    for win in w:
        if not win or win >= context:
            total += per_layer
        else:
            keep = min(context, (math.ceil(win / bs) + 1) * bs)
            total += stored_bytes(cfg, keep) / g.num_layers
    return int(total)


def measured(cfg: CacheConfig, context: int, split: bool, chunk: int = 512) -> list[tuple[str, int, int]]:
    """Append `context` tokens to one sequence, `chunk` at a time, in the caches one
    table (split False) or per-group tables (True) make -> [(cache, main blocks held,
    bytes held: Stats' used_bytes, fp16 tail blocks of pq included)] per cache."""
    lw = cfg.layer_windows
    groups = {0: list(range(len(lw)))} if not split else {}
    for i, w in enumerate(lw if split else ()):
        groups.setdefault(w, []).append(i)
    e, out = Engine(), []
    bs, g = cfg.block_size, cfg.geometry
    for w, layers in sorted(groups.items()):
        wins = tuple(lw[i] for i in layers)
        slides = all(wins)
        # Room for what the group holds at the end, plus one chunk in flight.
        need = (math.ceil((w + chunk + cfg.sinks + cfg.residual) / bs) + 4 if slides
                else math.ceil(context / bs) + 2)
        c = dataclasses.replace(cfg, name=f"g{w}" if split else "one", num_blocks=need, layer_windows=wins,
                                geometry=dataclasses.replace(g, num_layers=len(layers)))
        e.create_cache(c)
        if c.codec.kind == "pq":         # what the pools hold does not depend on the centroids
            gen = torch.Generator().manual_seed(0)
            shape = (len(layers), g.num_kv_heads, c.m, 256, g.head_dim // c.m)
            e.set_codebooks(c.name, Codebooks(k=torch.randn(shape, generator=gen), v=torch.randn(shape, generator=gen)))
        e.allocate(c.name, "t", "s", [])
        gen = torch.Generator().manual_seed(1)
        k = torch.randn(len(layers), chunk, g.num_kv_heads, g.head_dim, generator=gen).half()
        for _ in range(context // chunk):
            e.append(c.name, "t", ["s"], k, k, [chunk])
        st = e.stats(c.name)[c.name]
        out.append((c.name, st["main"].used, st["used_bytes"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--q-heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--pattern", type=int, default=6)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--codecs", default="fp16,pq4", help="measured: fp16, pq4 and/or pq2")
    ap.add_argument("--paper-only", action="store_true", help="skip the measurement")
    a = ap.parse_args()
    geo = ModelGeometry(a.layers, a.q_heads, a.kv_heads, a.head_dim)
    lw = windows(a.layers, a.window, a.pattern)
    rows = []
    for codec, m, sinks in (("fp16", 0, 0), ("pq", a.head_dim // 2, 32), ("pq", a.head_dim // 4, 32)):
        cfg = CacheConfig(name="b", model_id="bench", geometry=geo, codec=CodecConfig(kind=codec, num_subvectors=m),
                          num_blocks=1, sink_tokens=sinks, layer_windows=lw)
        label = codec if codec == "fp16" else f"pq {8 * 2 * m // a.head_dim // 2}-bit"
        rows.append((label, stored_bytes(cfg, a.context) / a.context, per_group_bytes(cfg, a.context) / a.context))
    base = rows[0][1]
    print(f"{a.layers} layers ({sum(1 for x in lw if x)} sliding, window {a.window}), {a.kv_heads} KV heads, "
          f"head_dim {a.head_dim}, context {a.context}: KV bytes per token")
    print(f"{'codec':<10} {'one table (now)':>16} {'vs fp16':>8} {'per group':>10} {'vs fp16':>8}")
    for label, now, grouped in rows:
        print(f"{label:<10} {now:16.0f} {base / now:7.2f}x {grouped:10.0f} {base / grouped:7.2f}x")
    if a.paper_only:
        return
    print(f"\nmeasured: a CPU engine's pools after appending {a.context} tokens (Stats used_bytes), "
          "paper figures beside")
    print(f"{'codec':<10} {'one table':>10} {'vs fp16':>8} {'per group':>10} {'vs fp16':>8} "
          f"{'paper':>7}  held per group cache (main blocks)")
    want = {"fp16": (0, "fp16", 0), "pq4": (1, "pq", a.head_dim // 2), "pq2": (2, "pq", a.head_dim // 4)}
    base = None
    for name in ["fp16"] + [c for c in a.codecs.split(",") if c != "fp16"]:
        row, codec, m = want[name]
        cfg = CacheConfig(name="b", model_id="bench", geometry=geo, codec=CodecConfig(kind=codec, num_subvectors=m),
                          num_blocks=1, sink_tokens=32 if codec == "pq" else 0, layer_windows=lw)
        t0 = time.perf_counter()
        one = sum(b for _, _, b in measured(cfg, a.context, split=False)) / a.context
        groups = measured(cfg, a.context, split=True)
        per = sum(b for _, _, b in groups) / a.context
        base = base or one
        held = ", ".join(f"{n}: {blocks}" for n, blocks, _ in groups)
        print(f"{rows[row][0]:<10} {one:10.0f} {base / one:7.2f}x {per:10.0f} {base / per:7.2f}x "
              f"{rows[row][2]:7.0f}  {held}  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
