"""Codebooks files: show what one says about itself, or convert a file of
the old format (tensors only, its transform in a file beside it) into one
that describes itself (kvstore.pq.v2: codebooks, transform, model id,
geometry, bits, sinks, what it was calibrated on).

    python -m kvstore.tools.codebooks show smollm2-pq4.safetensors
    python -m kvstore.tools.codebooks convert OLD.safetensors --model-id ID [--transform T] --out NEW
"""
from __future__ import annotations

import argparse
import os
import sys

from kvstore.codec.codebooks import Codebooks
from kvstore.codec.transform import Transform, transform_path


def show(path: str) -> None:
    cb = Codebooks.load(path)
    L, hkv, m, _, dsub = cb.k.shape
    print(f"{path}: sha256 {cb.sha256()}\n  {L} layers, {hkv} KV heads, head_dim {m * dsub}, M={m} "
          f"({cb.bits} bits an element)")
    if cb.info is None:
        beside = transform_path(path)
        print(f"  old format: no description; transform {'beside it: ' + beside if os.path.exists(beside) else 'unknown'}")
        return
    i = cb.info
    print(f"  model {i.model_id or '(any)'}, num_q_heads {i.num_q_heads or '(not recorded)'}, "
          f"sink tokens {i.sink_tokens}, transform {'included' if cb.transform_k is not None else 'none'}\n"
          f"  calibrated on: {i.calibrated_on or '(not recorded)'}")


def convert(src: str, out: str, model_id: str, transform: str | None, num_q_heads: int, sinks: int,
            calibrated_on: str) -> None:
    cb = Codebooks.load(src)
    if cb.info is not None:
        raise SystemExit(f"{src}: already describes itself (model {cb.info.model_id!r})")
    tp = transform or transform_path(src)
    if transform is None and not os.path.exists(tp):
        tp = "none"
    t = Transform.load(tp) if tp != "none" else None
    new = Codebooks(cb.k, cb.v, t.k if t else None, t.v if t else None).describe(
        model_id=model_id, num_q_heads=num_q_heads, sink_tokens=sinks, calibrated_on=calibrated_on)
    sha = new.save(out)
    print(f"{out}: sha256 {sha}, transform {'from ' + tp if t else 'none'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvstore.tools.codebooks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show")
    s.add_argument("path")
    c = sub.add_parser("convert")
    c.add_argument("src")
    c.add_argument("--out", required=True)
    c.add_argument("--model-id", required=True, help="the model the codebooks were calibrated on")
    c.add_argument("--transform", help="its transform file (default: the one beside SRC, if any); 'none': none")
    c.add_argument("--num-q-heads", type=int, default=0)
    c.add_argument("--sinks", type=int, default=0)
    c.add_argument("--calibrated-on", default="", help="what the calibration text was")
    args = p.parse_args(argv)
    from kvstore.errors import KVStoreError
    try:
        if args.cmd == "show":
            show(args.path)
        else:
            convert(args.src, args.out, args.model_id, args.transform, args.num_q_heads, args.sinks,
                    args.calibrated_on)
    except (KVStoreError, OSError) as e:      # not a codebooks file, or not there: its message, not a traceback
        p.error(f"{args.path if args.cmd == 'show' else args.src}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
