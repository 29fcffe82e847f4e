"""`kvstore-eval`: perplexity of a model with its KV cache in the daemon.

For each 2,048-token window (starting with the tokenizer's BOS where it uses
one) the model runs one forward pass whose attention quantizes every layer's
K/V on the way (so layer l sees the outputs that the quantized cache gave
layers < l), then runs the model's own attention (kvstore.tools.hooks: its
windows, soft-capping, scaling and sinks unchanged) over the keys with a mask
narrowed to say, per query, which keys come dequantized and which exact:

  protocol i  (the product's)  query t reads dequantized K/V for positions
               older than its fp16 tail and exact ones inside it. The tail is
               the daemon's: after t+1 tokens, sealed = ceil((t+1-R-bs)/bs)
               blocks, so R < tail <= R + bs. Optional fp16 sink tokens
               (positions < S) are never quantized.
  protocol ii (MILLION's)      every key, the query's own included, is
               dequantized.

Quantization goes through the daemon (backend "daemon": the window's K/V are
appended to a one-layer cache per layer and retrieved dequantized) or through
an in-process copy of the codec (backend "sim": the same codebooks, encode and
masks; fast, for exploring). Keys are [K_deq; K_exact] with a [W, 2W] mask.

    python -m kvstore.tools.evaluate --codebooks smollm2-pq4.safetensors --codebooks2 smollm2-pq2.safetensors
    python -m kvstore.tools.evaluate --model ~/models/gemma-3-1b --text eval/*.txt --codebooks gemma-pq4.safetensors

`--model` and `--text` as kvstore-calibrate's (default text: the python3.11-doc
EVAL_DIRS, never calibrated on).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvstore.codec.codebooks import Codebooks
from kvstore.codec.transform import Transform, load_codebooks

from .args import DefaultsFormatter, bounded, reachable
from .eval_checks import DAEMON_BLOCK, check_files, fitting, skipped_rows, unquantized_rows
from .hooks import AttentionCall, attention_handler, check_routed, exact_attention
from .models import MODEL_HELP, check_window, geometry_of, load_model
from .text import EVAL_DIRS, TEXT_HELP, default_text, read_text, token_windows

# ------------------------------------------------------------- quantizers
class SimQuantizer:
    """The codec in-process: fp16 storage, nearest centroid per sub-vector
    (as kernels.reference.pq_encode; faiss's encoder when faiss is there, which
    is ~25x faster on CPU), centroids read back in fp16."""

    def __init__(self, cb: Codebooks, transform: Transform | None = None):
        self.cb, self.t = cb, transform
        self.norms = {w: (getattr(cb, w) ** 2).sum(-1) for w in ("k", "v")}      # [L, Hkv, M, 256]
        self._faiss: dict[tuple[int, str], list] = {}

    def _codes(self, xs: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """xs [n, Hkv, d] fp32 -> codes [n, Hkv, M]."""
        cb = getattr(self.cb, which)[layer]                                       # [Hkv, M, 256, dsub]
        h, m, c, dsub = cb.shape
        try:
            import faiss
        except ImportError:
            dist = self.norms[which][layer] - 2 * torch.einsum("nhmd,hmcd->nhmc", xs.reshape(-1, h, m, dsub), cb)
            return dist.argmin(-1)
        if (layer, which) not in self._faiss:
            pqs = []
            for i in range(h):
                pq = faiss.ProductQuantizer(m * dsub, m, 8)
                faiss.copy_array_to_vector(cb[i].contiguous().numpy().ravel(), pq.centroids)
                pqs.append(pq)
            self._faiss[(layer, which)] = pqs
        pqs = self._faiss[(layer, which)]
        codes = [pqs[i].compute_codes(xs[:, i].contiguous().numpy()) for i in range(h)]
        return torch.from_numpy(np.stack(codes, 1)).long()

    def _roundtrip(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        cb = getattr(self.cb, which)[layer]
        h, m, c, dsub = cb.shape
        xs = (self.t.forward(x, layer, which) if self.t else x).half().float()   # what the daemon stores
        codes = self._codes(xs, layer, which)                                     # [n, Hkv, M]
        deq = cb.half().float()[torch.arange(h)[:, None], torch.arange(m)[None], codes]   # [n, Hkv, M, dsub]
        deq = deq.reshape(x.shape)
        return self.t.inverse(deq, layer, which) if self.t else deq

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v [n, Hkv, d] -> dequantized k, v [n, Hkv, d] fp32."""
        return self._roundtrip(k.float(), layer, "k"), self._roundtrip(v.float(), layer, "v")


class DaemonQuantizer:
    """The daemon's codec: one one-layer cache per model layer (codebooks of
    that layer); a window is appended (plus block_size zero tokens so every
    real token after the `sinks` fp16 sink tokens is sealed), retrieved
    dequantized (the sinks exact), and freed."""

    def __init__(self, kv, tag: str, model, cb: Codebooks | None, transform: Transform | None = None,
                 block_size: int = DAEMON_BLOCK, window: int = 2048, sinks: int = 0):
        self.kv, self.t, self.bs = kv, transform, block_size
        g = geometry_of(model)
        self.names = [f"{tag}-L{l}" for l in range(g.num_layers)]
        m = cb.k.shape[2] if cb is not None else 0
        for l, name in enumerate(self.names):
            kv.create_cache(name, f"eval/{tag}", num_layers=1, num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads,
                            head_dim=g.head_dim, codec="pq" if cb is not None else "fp16", num_subvectors=m,
                            block_size=block_size, residual=0, num_blocks=window // block_size + 4,
                            max_sequences=1, exist_ok=True, sink_tokens=sinks)
            if cb is not None and not kv.get_cache(name).has_codebooks:
                kv.set_codebooks(name, Codebooks(k=cb.k[l:l + 1], v=cb.v[l:l + 1]).to_bytes())
        self.calls = 0

    def close(self) -> tuple[int, int]:
        """Delete the row's caches (a --target daemon is the user's) -> (tokens appended
        to them, blocks sealed)."""
        mine = [c for c in self.kv.stats().caches if c.cache in self.names]
        for name in self.names:
            self.kv.delete_cache(name, force=True)
        return sum(c.appended_tokens for c in mine), sum(c.sealed_blocks for c in mine)

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        n, h, d = k.shape
        if self.t:
            k, v = self.t.forward(k.float(), layer, "k"), self.t.forward(v.float(), layer, "v")
        pad = torch.zeros(self.bs, h, d)
        name, sid = self.names[layer], f"w{self.calls}"
        self.calls += 1
        self.kv.allocate(name, sid, [])
        try:
            self.kv.append(name, [sid], torch.cat([k.float(), pad])[None], torch.cat([v.float(), pad])[None])
            kh, vh = self.kv.retrieve(name, sid, 0, n)
        finally:
            self.kv.free(name, [sid])
        kh, vh = kh[0].float(), vh[0].float()
        return (self.t.inverse(kh, layer, "k"), self.t.inverse(vh, layer, "v")) if self.t else (kh, vh)


# -------------------------------------------------------------- protocols
def sealed_boundary(n: int, residual: int, block_size: int) -> torch.Tensor:
    """[n]: for query t, tokens [0, b[t]) are sealed (PQ) once t+1 tokens are
    committed, by the daemon's rule (tail <= R + block_size tokens)."""
    t1 = torch.arange(1, n + 1)
    return (((t1 - residual - block_size).clamp_min(0) + block_size - 1) // block_size) * block_size


def mixed_mask(n: int, boundary: torch.Tensor, sinks: int) -> torch.Tensor:
    """[n, 2n] bool over keys [K_deq; K_exact]: query t reads deq j for
    sinks <= j < boundary[t], exact j for j <= t otherwise."""
    j = torch.arange(n)[None]
    t = torch.arange(n)[:, None]
    b = boundary[:, None]
    deq = (j >= sinks) & (j < b) & (j <= t)
    exact = (j <= t) & ~deq
    return torch.cat([deq, exact], dim=1)


class QuantizedAttention:
    """Attention handler: quantize this layer's K/V, then attend by protocol."""

    def __init__(self, quant, protocol: str, residual: int = 128, block_size: int = 16, sinks: int = 0):
        assert protocol in ("i", "ii")
        self.quant, self.protocol, self.R, self.bs, self.sinks = quant, protocol, residual, block_size, sinks
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, n: int) -> torch.Tensor:
        if n not in self._masks:
            b = sealed_boundary(n, self.R, self.bs) if self.protocol == "i" else torch.arange(1, n + 1)
            self._masks[n] = mixed_mask(n, b, self.sinks)
        return self._masks[n]

    def __call__(self, call: AttentionCall) -> torch.Tensor:
        q, k, v = call.query, call.key, call.value
        assert q.shape[0] == 1, "one window at a time"
        kh, vh = self.quant(call.layer, k[0].transpose(0, 1).cpu(), v[0].transpose(0, 1).cpu())   # [n, Hkv, d]
        kh = kh.transpose(0, 1)[None].to(q.device, q.dtype)
        vh = vh.transpose(0, 1)[None].to(q.device, q.dtype)
        if self.protocol == "ii" and self.sinks == 0:
            return call.attend(kh, vh)
        return call.attend(torch.cat([kh, k], dim=2), torch.cat([vh, v], dim=2), allow=self.mask(k.shape[2]))


def window_nll(model, wins: list[list[int]], handler, desc: str = "") -> torch.Tensor:
    """-> [len(wins)] summed next-token NLL per window (len(w) - 1 scored tokens).
    The logits are the model's whole forward's (final soft-capping included)."""
    from tqdm import tqdm
    out = []
    dev = next(model.parameters()).device
    with torch.no_grad(), attention_handler(model, handler):
        for w in tqdm(wins, desc=desc, file=sys.stderr, leave=False):
            ids = torch.tensor([w], device=dev)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            check_routed(model)
            out.append(F.cross_entropy(logits, ids[0, 1:], reduction="sum").cpu())
    return torch.stack(out)


# -------------------------------------------------------------------- CLI
@dataclass(slots=True)
class Row:
    label: str
    codebooks: str | None       # None: fp16
    protocol: str = "i"
    sinks: int = 0
    residual: int = 128
    transform: str = "auto"      # auto: <codebooks>.transform.safetensors if present; none; or a path

    @staticmethod
    def parse(spec: str) -> "Row":
        """LABEL=key=val,key=val with keys cb, proto, sinks, R, transform ("fp16=" for the baseline)."""
        cut = re.search(r"=(?=(?:cb|proto|sinks|R|transform)=|$)", spec)
        if cut is None:
            raise ValueError(f"--row {spec!r}: expected LABEL=cb=PATH,...")
        label, rest = spec[:cut.start()], spec[cut.end():]
        kw = dict(p.split("=", 1) for p in rest.split(",") if p)
        if kw.get("proto", "i") not in ("i", "ii"):
            raise ValueError(f"--row {spec!r}: proto must be i or ii, got {kw['proto']!r}")
        try:
            sinks, residual = int(kw.get("sinks", 0)), int(kw.get("R", 128))
        except ValueError:
            raise ValueError(f"--row {spec!r}: sinks and R must be integers") from None
        return Row(label, kw.get("cb") or None, kw.get("proto", "i"), sinks, residual, kw.get("transform", "auto"))

    def load(self) -> tuple[Codebooks | None, Transform | None]:
        """The row's codebooks and the transform K/V go through, by the adapter's rule
        (hf_codebooks.chosen_transform): ValueError naming transform where they disagree."""
        if self.codebooks is None:
            return None, None
        from kvstore.client.hf_codebooks import chosen_transform
        cb, beside = load_codebooks(self.codebooks)
        given = None if self.transform == "auto" else "none" if self.transform == "none" \
            else Transform.load(self.transform)
        return cb, chosen_transform(cb, beside, given)


def default_rows(cb4: str | None, cb2: str | None, sinks: int, residual: int) -> list[Row]:
    rows = [Row("fp16", None, "ii")]
    if cb4:
        rows += [Row("pq 4-bit, protocol i", cb4, "i", sinks, residual), Row("pq 4-bit, protocol ii", cb4, "ii")]
    if cb2:
        rows += [Row("pq 2-bit, protocol i", cb2, "i", sinks, residual)]
    return rows


def run(model, wins, rows: list[Row], backend: str, kv=None, log=print) -> list[tuple[Row, float, float]]:
    """-> [(row, ppl, delta % vs the first row)]."""
    results, base = [], None
    scored = sum(len(w) - 1 for w in wins)
    for i, row in enumerate(rows):
        t0 = time.time()
        cb, tr = row.load()
        if backend == "daemon":
            quant = DaemonQuantizer(kv, f"eval{i}-{os.getpid()}", model, cb, tr, window=len(wins[0]), sinks=row.sinks)
        elif cb is None:
            quant = None
        else:
            quant = SimQuantizer(cb, tr)
        # The daemon keeps its sink tokens in fp16 itself; only the sim fakes them in the mask.
        handler = exact_attention_handler if quant is None else QuantizedAttention(
            quant, row.protocol, row.residual, sinks=0 if backend == "daemon" else row.sinks)
        try:
            nll = window_nll(model, wins, handler, desc=row.label)
        finally:
            if backend == "daemon":
                appended, sealed = quant.close()
        if backend == "daemon":
            log(f"  daemon: {len(quant.names)} caches of this row, {appended:,} tokens appended, "
                f"{sealed:,} blocks sealed; deleted")
        ppl = math.exp(nll.sum().item() / scored)
        base = base if base is not None else ppl
        results.append((row, ppl, 100 * (ppl / base - 1)))
        log(f"{row.label:40s} ppl {ppl:8.4f}  delta {100 * (ppl / base - 1):+7.3f} %   ({time.time() - t0:.0f} s)")
    return results


exact_attention_handler = exact_attention


def format_table(results, scored: int, backend: str) -> str:
    lines = ["| config | protocol | sinks | R | perplexity | delta vs fp16 |", "|---|---|---|---|---|---|"]
    for row, ppl, delta in results:
        proto = "-" if row.codebooks is None else row.protocol
        lines.append(f"| {row.label} | {proto} | {row.sinks} | {row.residual if proto == 'i' else '-'} "
                     f"| {ppl:.4f} | {delta:+.2f} % |")
    lines.append(f"\n{scored:,} scored tokens, backend {backend}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore-eval", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsFormatter)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--text", nargs="+", help=f"evaluation text, {TEXT_HELP} (default: the python3.11-doc "
                   f"{', '.join(EVAL_DIRS)} folder `make text` fetches); never the calibration text")
    p.add_argument("--codebooks", help="4-bit codebooks (M = d/2) from kvstore-calibrate")
    p.add_argument("--codebooks2", help="2-bit codebooks (M = d/4)")
    p.add_argument("--row", action="append", default=[], help="extra row: LABEL=cb=PATH,proto=i|ii,sinks=S,R=R,"
                   "transform=auto|none|PATH (sinks 0, R 128, transform auto unless given; replaces the default "
                   "rows; the first row is the baseline)")
    p.add_argument("--sinks", type=int, default=32, help="fp16 sink tokens of the default rows' protocol i, "
                   "the adapter's default")
    p.add_argument("--residual", type=int, default=128, help="fp16 tail R of the default rows")
    p.add_argument("--window", type=bounded(int, 2), default=2048, help="tokens a window")
    p.add_argument("--windows", type=bounded(int, 1), default=20,
                   help="windows of the evaluation text (20 -> 40,940 tokens)")
    p.add_argument("--backend", choices=["daemon", "sim"], default="daemon",
                   help="daemon: through a kvstore daemon; sim: the codec in-process, faster, "
                        "close to the daemon's, not the same (docs/accuracy.md says why)")
    p.add_argument("--target", help="daemon to use (default: start one on a temp socket)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="where the model runs (the codec runs on the CPU either way)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:                            # every check before the model: fail fast
        given = [Row.parse(s) for s in args.row]
        check_files(args, given)
        text = read_text(args.text or default_text(EVAL_DIRS))
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    rows = given or default_rows(args.codebooks, args.codebooks2, args.sinks, args.residual)
    if args.backend == "daemon":
        for r in rows:       # the daemon keeps whole blocks of sink tokens (its cache's block_size)
            if r.sinks % DAEMON_BLOCK:
                p.error(f"{'--sinks' if not given else f'--row {r.label}: sinks'}: {r.sinks} is not a multiple "
                        f"of the daemon cache's block_size {DAEMON_BLOCK} (--backend sim takes any count)")
        if args.target:
            reachable(p, args.target)
    for line in skipped_rows(args):
        print(f"note: {line}", flush=True)
    try:
        lm = load_model(args.model)
        check_window(lm.model, args.window)
        fitting(lm, rows, given)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    model, tok = lm.model.to(args.device), lm.tok
    wins = token_windows(tok, text, args.window, args.windows)
    if len(wins) < args.windows:
        print(f"note: the text holds {len(wins)} windows of {args.window} tokens, not {args.windows}", flush=True)
    if not wins:
        p.error(f"--text: shorter than one window of {args.window} tokens")
    for line in unquantized_rows(model, rows, args.window):
        print(f"note: {line}", flush=True)
    scored = sum(len(w) - 1 for w in wins)
    print(f"model {lm.model_id}; evaluation text: {', '.join(args.text or EVAL_DIRS)}; {len(wins)} windows of {args.window}, {scored:,} scored tokens",
          flush=True)
    with _daemon(args.target if args.backend == "daemon" else "") as kv:
        try:
            results = run(model, wins, rows, args.backend, kv, log=lambda s: print(s, flush=True))
        except ValueError as e:      # check_routed: found on the first row's first window
            p.error(str(e))
    print()
    print(format_table(results, scored, args.backend))


@contextlib.contextmanager
def _daemon(target: str | None):
    """None/'' for no daemon; a target to connect to; else start one."""
    if target == "":
        yield None
        return
    from kvstore.client import KVStoreClient
    if target:
        with KVStoreClient(target) as kv:
            yield kv
        return
    from .demo_model import spawn_daemon
    with spawn_daemon() as target, KVStoreClient(target) as kv:
        yield kv


if __name__ == "__main__":
    main()
