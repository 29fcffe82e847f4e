"""kvstore-eval's checks of its rows before the model runs them: files there, codebooks
that fit the model and their flag, and the rows that measure nothing of the codec."""
from __future__ import annotations

import argparse
import os

from .models import geometry_of

DAEMON_BLOCK = 16        # block_size of the backend daemon's caches (evaluate.DaemonQuantizer's default)


def fitting(lm, rows: list, given: list) -> None:
    """ValueError naming the flag of the first row whose codebooks do not fit the model
    (geometry; the model id for a model named by its hub id), whose transform the
    adapter would refuse, or whose bit width is not its flag's: found before any row
    runs, by the adapter's own checks (hf_codebooks)."""
    from kvstore.client.hf_codebooks import check_model
    from kvstore.errors import InvalidArgument
    g = geometry_of(lm.model)
    for r in rows:
        if r.codebooks is None:
            continue
        flag = f"--row {r.label}: cb" if given else "--codebooks2" if "2-bit" in r.label else "--codebooks"
        try:
            cb, _ = r.load()
        except ValueError as e:         # the transform rule
            raise ValueError(f"{f'--row {r.label}' if given else flag}: {r.codebooks}: {e}") from None
        want = None if given else 2 if flag == "--codebooks2" else 4
        if want is not None and cb.bits != want:
            raise ValueError(f"{flag}: {r.codebooks} holds {cb.bits}-bit codebooks; --codebooks takes 4-bit "
                             "(M = d/2), --codebooks2 2-bit (M = d/4)")
        try:
            check_model(cb, lm.model_id, os.path.exists(lm.model_id),
                        (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim))
        except (InvalidArgument, ValueError) as e:
            raise ValueError(f"{flag}: {r.codebooks}: {e}") from None


def unquantized_rows(model, rows: list, window: int) -> list[str]:
    """Protocol i rows that measure nothing of the codec, one line each: no query of a
    window this short, or of a model whose every layer slides over no more than the
    fp16 tail, reads a code, so their perplexity is fp16's."""
    from .models import text_config
    c = text_config(model)
    slide = getattr(c, "sliding_window", None)
    every = slide and all(t == "sliding_attention" for t in getattr(c, "layer_types", None) or ["sliding_attention"])
    out = []
    for r in rows:
        if r.codebooks is None or r.protocol != "i":
            continue
        first = r.sinks + r.residual + DAEMON_BLOCK       # the first token a query may read as a code
        if window <= first:
            out.append(f"{r.label}: a query reads codes only past token {first} (sinks {r.sinks} + R "
                       f"{r.residual} + block {DAEMON_BLOCK}); windows of {window} tokens read none: it equals fp16")
        elif every and slide <= r.residual + DAEMON_BLOCK:
            out.append(f"{r.label}: every layer attends over the last {slide} tokens, all in the fp16 tail "
                       f"(R {r.residual} + block {DAEMON_BLOCK}): it equals fp16")
    return out


def check_files(args: argparse.Namespace, given: list) -> None:
    """FileNotFoundError naming the flag of the first codebook or transform file
    that is not there: found before the model loads, not when its row comes
    after minutes of the rows before it. given: the --row rows."""
    named = [("--codebooks", args.codebooks), ("--codebooks2", args.codebooks2)]
    named += [(f"--row {r.label}: cb", r.codebooks) for r in given]
    named += [(f"--row {r.label}: transform", r.transform) for r in given if r.transform not in ("auto", "none")]
    for flag, path in named:
        if path and not os.path.isfile(path):
            raise FileNotFoundError(f"{flag}: no such file {path}")


def skipped_rows(args: argparse.Namespace) -> list[str]:
    """What the default rows leave out for want of codebooks, one line each."""
    if args.row:
        return []
    return ([] if args.codebooks else ["no --codebooks: the 4-bit rows are skipped"]) + \
           ([] if args.codebooks2 else ["no --codebooks2: the 2-bit row is skipped"])
