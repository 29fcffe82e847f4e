"""KV bytes per token of one long sequence, from the cache's own sizes (CacheConfig):
what kvstore stores today (one block table for every layer: a block holds a token's K/V
of all layers, sliding or not), against the per-group tables of vLLM's hybrid allocator
(sliding layers keep only their window), which kvstore does not implement yet. The
baseline is the fp16 codec with one table, computed in the same run.

    python bench/kv_bytes.py                       # Gemma-3-1B-like: 26 layers, 5:1, window 512
    python bench/kv_bytes.py --layers 62 --kv-heads 16 --head-dim 128 --window 1024 --context 32768
"""
from __future__ import annotations

import argparse
import math

from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--q-heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--pattern", type=int, default=6)
    ap.add_argument("--context", type=int, default=32768)
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


if __name__ == "__main__":
    main()
