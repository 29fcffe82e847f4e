"""Perplexity cost of codebooks the daemon trains on the fly (the HF
adapter's calibrate_tokens) against offline codebooks (kvstore-calibrate),
measured in one run on the same windows.

    python -m kvstore.tools.calibrate --bits 4 --windows 8 --out bench/results/offline-pq{bits}.safetensors
    python bench/ppl_on_the_fly.py --offline bench/results/offline-pq4.safetensors [--tokens 1024]

SmolLM2-135M-Instruct, codec pq 4-bit, 32 fp16 sinks. On the fly: an adapter
with no codebooks file serves its first requests in-process (prompts of 512
tokens from the calibration text, the Python docs' library/ howto/
reference/) until it has --tokens K/V rows past the sinks, which go to
TrainCodebooks; GetCodebooks then reads back what the cache uses. Both sets
are evaluated with kvstore-eval's sim backend on --windows windows of
--window tokens of tutorial/ (never calibrated on), protocol i (R = 128) and
protocol ii; printed: perplexity and the change against fp16 and against
the offline codebooks.
"""
from __future__ import annotations

import argparse
import os

import torch

from kvstore.client.hf import KVStoreAdapter
from kvstore.tools.demo_model import spawn_daemon
from kvstore.tools.evaluate import Row, run
from kvstore.tools.models import SMOLLM2_MODEL_ID, load_smollm2
from kvstore.tools.text import CALIB_DIRS, EVAL_DIRS, read_text, windows

OUT = os.path.join(os.path.dirname(__file__), "results")


def train_on_the_fly(model, tok, target: str, tokens: int, prompt_len: int = 512) -> str:
    """The adapter's calibrate_tokens on the first prompts of the calibration text -> the codebooks file's path."""
    ad = KVStoreAdapter(model, target, cache="otf", codec="pq", calibrate_tokens=tokens, sink_tokens=32,
                        model_id=SMOLLM2_MODEL_ID, num_blocks=256, max_sequences=4)
    ids = tok(read_text(CALIB_DIRS)).input_ids
    kv = ad.client()
    n = 0
    with torch.no_grad():
        while not kv.get_cache("otf").has_codebooks:
            prompt = torch.tensor([ids[n * prompt_len:(n + 1) * prompt_len]])
            ad.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
            n += 1
    path = os.path.join(OUT, f"otf-{tokens}-pq4.safetensors")
    with open(path, "wb") as f:
        f.write(kv.get_codebooks("otf"))
    print(f"on the fly: trained after {n} prompts of {prompt_len} tokens -> {path}", flush=True)
    ad.close()
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--offline", required=True, help="kvstore-calibrate's 4-bit codebooks")
    p.add_argument("--tokens", type=int, default=1024, help="calibrate_tokens of the on-the-fly adapter")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(OUT, exist_ok=True)
    model, tok = load_smollm2()
    with spawn_daemon() as target:
        otf = train_on_the_fly(model, tok, target, args.tokens)
    wins = windows(tok(read_text(EVAL_DIRS)).input_ids, args.window, args.windows)
    rows = [Row("fp16", None, "ii")]
    for label, cb in (("offline", args.offline), (f"on the fly ({args.tokens} tokens)", otf)):
        rows += [Row(f"{label}, protocol i", cb, "i", 32, 128), Row(f"{label}, protocol ii", cb, "ii")]
    res = run(model, wins, rows, "sim", log=lambda s: print(s, flush=True))
    ppl = {row.label: x for row, x, _ in res}
    print(f"\n{len(wins)} windows of {args.window} tokens of {', '.join(EVAL_DIRS)}; 4-bit, 32 sinks, R = 128 (protocol i)")
    print("| codebooks | protocol | perplexity | vs fp16 | vs offline |\n|---|---|---|---|---|")
    for row, x, delta in res:
        off = ppl.get(f"offline, protocol {row.protocol}") if row.codebooks else None
        vs = f"{100 * (x / off - 1):+.2f} %" if off else "-"
        print(f"| {row.label.rsplit(',', 1)[0]} | {row.protocol if row.codebooks else '-'} | {x:.4f} | "
              f"{delta:+.2f} % | {vs} |")


if __name__ == "__main__":
    main()
