"""Time to first token of a hybrid model's prompt that shares a cached prefix, with the
adapter's state snapshots (client/hf_states.py) against every prompt run in full, in one
run.

    python bench/bench_hybrid_prefix.py [--device cuda] [--prefix 3072] [--question 512] [--answer 64] [--rounds 3]

A randomly initialised Qwen3.5-style model (Gated DeltaNet layers, a full-attention
layer every fourth; sizes by --hidden / --layers) generates through a daemon it starts
(codec fp16, its pools on --device). Each round draws a fresh shared prefix (a system prompt) and questions
after it; a row's time to first token is one generate() of one token. Rows, interleaved
round by round, each adapter with a cache of its own:
  cold         state_cache_bytes=0: every prompt runs in full (the baseline)
  first        the first prompt with a new prefix, snapshots on: its states are kept at
               its last block boundary (the price of keeping them)
  second       another question after the same prefix: the daemon has the prefix's K/V,
               the adapter no states there, so it runs in full, stopping at the prefix's
               end to keep them
  third        a third question: hits at the prefix's end (states restored, K/V
               retrieved, only the question run)
  again        the first prompt again: hits at its last block boundary
  next cold    a chat's next turn (the first prompt, its answer of --answer tokens,
               another question) with state_cache_bytes=0: run in full
  next         the same next turn with snapshots on: hits through the answer (the
               states at the last block boundary the answer reached)
Printed: the median TTFT of each row, its hit tokens, and its ratio to cold (next:
to next cold). The linear
layers run flash-linear-attention's kernels when it is installed (transformers' choice),
else transformers' PyTorch reference, whose prefill is slower: the ratios depend on it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from kvstore.client.hf import KVStoreAdapter
from kvstore.tools.demo import spawn_daemon


def model_of(args) -> torch.nn.Module:
    heads = args.hidden // 128
    config = transformers.Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=65536)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):         # a large model's weights made where they run
        return transformers.Qwen3_5ForCausalLM._from_config(config, dtype=dtype).eval()


def ttft(ad: KVStoreAdapter, ids: torch.Tensor) -> tuple[float, int]:
    before = ad.stats().prefix_hit_tokens
    with torch.no_grad():
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ad.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        if ids.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return dt, ad.stats().prefix_hit_tokens - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--question", type=int, default=256, help="tokens after the prefix")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--answer", type=int, default=64, help="tokens of the first prompt's answer (next rows)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix-path", default="auto", choices=("auto", "codes", "retrieve"),
                   help="the adapter's prefix_path for the rows with snapshots")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = model_of(args)
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(3, 32000, (1, n), generator=gen).to(args.device)

    rows: dict[str, list[tuple[float, int]]] = {k: [] for k in ("cold", "first", "second", "third", "again",
                                                                "next cold", "next")}
    # room for every round's prompts (a prefix, four questions, an answer): no eviction is timed
    blocks = (args.rounds + 1) * (args.prefix + 4 * args.question + args.answer) // 16 + 64
    with spawn_daemon(None, ("--device", args.device, "--log-level", "WARNING"), quiet=True) as target:
        def adapter(cache, **kw):
            return KVStoreAdapter(model, target, cache=cache, codec="fp16", num_blocks=blocks, max_sequences=4, **kw)
        cold = adapter("cold", state_cache_bytes=0)
        warm = adapter("warm", prefix_path=args.prefix_path)     # its first request checks the model once
        for r in range(-1, args.rounds):            # round -1 warms up every path
            head = tokens(args.prefix)              # a fresh prefix: nothing of earlier rounds hits
            first, second, third = (torch.cat([head, tokens(args.question)], dim=1) for _ in range(3))
            got = {"cold": ttft(cold, third), "first": ttft(warm, first), "second": ttft(warm, second),
                   "third": ttft(warm, third), "again": ttft(warm, first)}
            with torch.no_grad():       # the first turn's answer (untimed), then the next turn
                answer = warm.generate(first, max_new_tokens=args.answer, min_new_tokens=args.answer,
                                       do_sample=False, pad_token_id=0)
            turn = torch.cat([answer, tokens(args.question)], dim=1)
            got["next cold"], got["next"] = ttft(cold, turn), ttft(warm, turn)
            if r >= 0:
                for k, v in got.items():
                    rows[k].append(v)
        cold.close()
        warm.close()
    base = {k: statistics.median(t for t, _ in rows["next cold" if k.startswith("next") else "cold"])
            for k in rows}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    try:
        import fla  # noqa: F401
        linear = "flash-linear-attention"
    except ImportError:
        linear = "transformers' PyTorch reference"
    params = sum(p.numel() for p in model.parameters())
    print(f"Qwen3.5-style, hidden {args.hidden}, {args.layers} layers ({params / 1e6:,.0f} M parameters), {model.dtype}, "
          f"{name}, linear layers by "
          f"{linear}; prefix {args.prefix} + question {args.question} tokens; prefix_path {args.prefix_path}; "
          f"median of {args.rounds} rounds")
    print(f"{'row':<9} {'TTFT ms':>9} {'hit tokens':>11} {'vs cold':>8}")
    for k, res in rows.items():
        t = statistics.median(x for x, _ in res)
        print(f"{k:<9} {t * 1e3:>9.1f} {statistics.median(h for _, h in res):>11.0f} {t / base[k]:>7.2f}x")


if __name__ == "__main__":
    main()
