"""End-to-end fine-tuning of PQ centroids against the model's own next-token
distribution (`kvstore-calibrate --finetune-steps N`, or this module's CLI).

k-means places a centroid where the rows that chose it are, each row weighted
alike. What perplexity feels is different, and every proxy of it we tried
(attention-weighted metrics, one layer's output error) lowered the proxy and
raised perplexity. So the loss here is the measured thing itself: KL(p_exact || p_quantized) of the next-token
distribution over calibration windows, with every layer's K/V quantized the
way MILLION's protocol does (every key, the query's own included), which also
covers the product's protocol (its older keys read the same codes).

Codes are the nearest centroid under the current centroids at every step (what
the daemon's encoder will write), from the fp16 value the daemon stores. The
gradient reaches a centroid through the tokens that chose it, and reaches the
earlier layers' centroids through the residual stream by a straight-through
estimate (d k^ / d k = I). The model and the transform stay fixed, so the
result is an ordinary codebook file: the daemon and the kernels need nothing
new. One 2,048-token step takes ~0.3 s on an H100 and ~50 s on 2 CPU cores.

    python -m kvstore.tools.finetune SRC.safetensors OUT.safetensors --device cuda [--steps 600] [--lr 1e-3]

`--model` and `--text` as kvstore-calibrate's (default: SmolLM2 and the
python3.11-doc calibration folders).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstore.codec.codebooks import Codebooks
from kvstore.codec.transform import Transform, load_codebooks

from .hooks import AttentionCall, attention_handler
from .models import MODEL_HELP, load_model
from .text import CALIB_DIRS, TEXT_HELP, default_text, read_text, token_windows


@dataclass(frozen=True, slots=True)
class FinetuneConfig:
    steps: int = 600
    lr: float = 1e-3            # Adam, cosine decay to 0; 3e-3 did half as well on held-out KL
    val_windows: int = 4        # the last calibration windows, held out
    every: int = 50             # held-out KL printed every this many steps
    train_v: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: must be a positive number, got {self.lr}")
        if self.val_windows < 1:
            raise ValueError(f"val_windows: must be >= 1, got {self.val_windows}")
        if self.every < 1:
            raise ValueError(f"every: must be >= 1, got {self.every}")


class STEQuantizer:
    """Attention handler (kvstore.tools.hooks.attention_handler): every key and
    value through transform -> nearest centroid -> learnable centroid (+ the
    straight-through term) -> inverse transform, then the model's own attention."""

    def __init__(self, cb: Codebooks, t: Transform, dev: torch.device, train_v: bool = True):
        self.t = t
        self.k = torch.nn.Parameter(cb.k.clone().to(dev))
        self.v = torch.nn.Parameter(cb.v.clone().to(dev), requires_grad=train_v)
        self.exact = False

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in (self.k, self.v) if p.requires_grad]

    def codebooks(self) -> Codebooks:
        return Codebooks(k=self.k.detach().float().cpu().clone(), v=self.v.detach().float().cpu().clone())

    def _q(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """x [n, Hkv, d] -> dequantized [n, Hkv, d]."""
        c = getattr(self, which)[layer]                         # [Hkv, M, 256, dsub]
        h, m, _, dsub = c.shape
        xs = self.t.forward(x, layer, which).reshape(-1, h, m, dsub)
        with torch.no_grad():
            xr = xs.half().float()                              # the daemon encodes what it stores: fp16
            dist = (c * c).sum(-1) - 2 * torch.einsum("nhmd,hmcd->nhmc", xr, c)
            codes = dist.argmin(-1)                             # [n, Hkv, M]
        deq = c[torch.arange(h, device=c.device)[:, None], torch.arange(m, device=c.device)[None], codes]
        deq = deq + (xs - xs.detach())
        return self.t.inverse(deq.reshape(x.shape), layer, which)

    def __call__(self, call: AttentionCall) -> torch.Tensor:
        if self.exact:
            return call.attend()
        q, k, v, layer = call.query, call.key, call.value, call.layer
        k = self._q(k[0].transpose(0, 1), layer, "k").transpose(0, 1)[None].to(q.dtype)
        v = self._q(v[0].transpose(0, 1), layer, "v").transpose(0, 1)[None].to(q.dtype)
        return call.attend(k, v)


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)


def kl(model, quant: STEQuantizer, ids: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_exact || p_quantized); run under attention_handler(model, quant)."""
    with torch.no_grad():
        quant.exact = True
        try:
            lp_ref = _logprobs(model, ids)
        finally:
            quant.exact = False
    lp = _logprobs(model, ids)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean()


def finetune(model, cb: Codebooks, transform: Transform, wins: torch.Tensor, cfg: FinetuneConfig,
             device: torch.device | str = "cpu", log=print) -> tuple[Codebooks, list[float]]:
    """wins: [n, window] token ids (n > cfg.val_windows). -> (fine-tuned
    codebooks, held-out KL at step 0 and at every cfg.every steps)."""
    if wins.dim() != 2 or wins.shape[0] <= cfg.val_windows:
        raise ValueError(f"wins: need [n > {cfg.val_windows}, window] token ids, got {tuple(wins.shape)}")
    if cb.k.shape[:2] != transform.k.shape[:2]:
        raise ValueError(f"transform: {tuple(transform.k.shape[:2])} (layers, KV heads), "
                         f"codebooks have {tuple(cb.k.shape[:2])}")
    dev = torch.device(device)
    # the caller's model comes back where it was, with its parameters' flags as they were
    home = next(model.parameters()).device
    flags = [(prm, prm.requires_grad) for prm in model.parameters()]
    try:
        model.to(dev)
        for prm, _ in flags:
            prm.requires_grad_(False)
        return _finetune(model, cb, transform, wins, cfg, dev, log)
    finally:
        model.to(home)
        for prm, flag in flags:
            prm.requires_grad_(flag)


def _finetune(model, cb, transform, wins, cfg, dev, log):
    torch.manual_seed(cfg.seed)
    t = Transform(k=transform.k.to(dev), v=transform.v.to(dev))
    quant = STEQuantizer(cb, t, dev, train_v=cfg.train_v)
    wins = wins.to(torch.int64)
    n = wins.shape[0] - cfg.val_windows
    val = [wins[i][None].to(dev) for i in range(n, wins.shape[0])]
    order = torch.randperm(n).tolist()

    def val_kl() -> float:
        with torch.no_grad():
            return sum(kl(model, quant, ids).item() for ids in val) / len(val)

    opt = torch.optim.Adam(quant.params(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    t0 = time.time()
    history = []
    with attention_handler(model, quant):
        history.append(val_kl())
        log(f"step 0 val KL {history[0]:.5f}")
        run = 0.0
        for s in range(1, cfg.steps + 1):
            loss = kl(model, quant, wins[order[(s - 1) % n]][None].to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run = loss.item() if s == 1 else 0.95 * run + 0.05 * loss.item()
            if s % cfg.every == 0 or s == cfg.steps:
                history.append(val_kl())
                log(f"step {s} train KL (ema) {run:.5f} val KL {history[-1]:.5f} "
                    f"({history[-1] / history[0] - 1:+.1%}) {(time.time() - t0) / s:.2f} s/step")
    return quant.codebooks(), history


def calibration_windows(tok, text: str, window: int = 2048) -> torch.Tensor:
    """All non-overlapping windows of the calibration text (never the evaluation
    text), BOS first where the tokenizer uses one."""
    return torch.tensor(token_windows(tok, text, window))


def ids_dtype(vocab: int) -> torch.dtype:
    """The narrowest dtype that holds every id below `vocab`."""
    return torch.uint16 if vocab <= 1 << 16 else torch.int32


def parser() -> argparse.ArgumentParser:
    d = FinetuneConfig()        # slots: the class attributes are descriptors, not the defaults
    p = argparse.ArgumentParser(prog="python -m kvstore.tools.finetune", description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?",
                   help="codebooks from kvstore-calibrate (its .transform.safetensors beside it)")
    p.add_argument("out", nargs="?")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--every", type=int, default=d.every)
    p.add_argument("--val", type=int, default=d.val_windows, help="held-out calibration windows")
    p.add_argument("--k-only", action="store_true", help="leave the V centroids as they are")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ids", help="pre-tokenized calibration windows ([n, window], from --dump-ids)")
    p.add_argument("--model", "--gguf", dest="model", help=MODEL_HELP)
    p.add_argument("--text", nargs="+", help=f"calibration text, {TEXT_HELP} (default: the python3.11-doc "
                   f"{', '.join(CALIB_DIRS)} folders `make text` fetches)")
    p.add_argument("--dump-ids", metavar="FILE", help="tokenize the calibration text into FILE and exit "
                   "(for a GPU box that has neither the text nor the tokenizer)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if not args.dump_ids and not (args.src and args.out):
        p.error("src and out are required (only --dump-ids runs without them)")
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    model, tok = lm.model, lm.tok
    if args.ids:
        wins = torch.load(args.ids)
    else:
        wins = calibration_windows(tok, read_text(args.text or default_text(CALIB_DIRS)), args.window)
    if args.dump_ids:
        # uint16 where every id fits (SmolLM2's 49,152), else int32 (Gemma's 262K would wrap)
        torch.save(wins.to(ids_dtype(max(len(tok), int(wins.max()) + 1))), args.dump_ids)
        print(f"{args.dump_ids}: {tuple(wins.shape)} calibration windows", flush=True)
        return
    cfg = FinetuneConfig(steps=args.steps, lr=args.lr, val_windows=args.val, every=args.every,
                         train_v=not args.k_only)
    cb, t = load_codebooks(args.src)
    if t is None:
        raise SystemExit(f"{args.src}: no transform in or beside it (fine-tuning needs one)")
    print(f"{wins.shape[0]} calibration windows of {wins.shape[1]}; {cfg.steps} steps, lr {cfg.lr}, "
          f"{'K and V' if cfg.train_v else 'K only'}, {args.device}", flush=True)
    out, _ = finetune(model, cb, t, wins, cfg, args.device, log=lambda s: print(s, flush=True))
    src = cb.info
    out = Codebooks(out.k, out.v, t.k, t.v).describe(
        model_id=src.model_id if src else "", num_q_heads=src.num_q_heads if src else 0,
        sink_tokens=src.sink_tokens if src else 0,
        calibrated_on=f"{src.calibrated_on if src else args.src}; fine-tuned {cfg.steps} steps")
    sha = out.save(args.out)
    print(f"wrote {args.out} sha256 {sha[:8]} (transform included)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
