"""Experiment (session 5, did not pay: bench/ACCURACY.md row 23): fine-tune PQ centroids
against the attention output.

    python bench/acc_s5/finetune_centroids.py bench/cb/opq2-pq4.safetensors out-pq4.safetensors


k-means places each centroid to minimise the (q-aware) reconstruction error
of the rows assigned to it, every row weighted alike. What the model feels is
different: a score error matters in proportion to the attention it moves, and
most attention goes to few keys (the query's own token and its neighbours,
which MILLION's protocol quantizes too). So, per layer, starting from the
k-means centroids, Adam moves the layer's K and V centroids to lower

    || (attn(q, K^, V^) - attn(q, K, V)) W_o^T ||^2

over sampled queries of calibration windows, every key quantized (the hardest
case; the product's protocol reads the same codes for its older keys). The
codes are re-assigned by nearest centroid at every step, which is what the
daemon's encoder does, so the loss is the one the deployed codec gives. The
transform (q-aware + OPQ) stays fixed: only centroids move, the daemon and the
kernels need nothing new.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kvstore.codec.codebooks import Codebooks


class QKVRecorder:
    """Attention handler (kvstore.tools.hooks.attention_handler) that keeps every
    layer's q, k, v (after RoPE) of each window in fp16, then attends exactly."""

    def __init__(self, num_layers: int):
        self.qkv: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_layers)]

    def __call__(self, layer: int, q, k, v, scaling: float):
        from kvstore.tools.hooks import exact_attention
        self.qkv[layer].append((q[0].half(), k[0].half(), v[0].half()))     # [Hq|Hkv, n, d]
        return exact_attention(q, k, v, scaling)


def record(model, wins: list[list[int]]) -> QKVRecorder:
    from tqdm import tqdm

    from kvstore.tools.hooks import attention_handler
    rec = QKVRecorder(model.config.num_hidden_layers)
    with torch.no_grad(), attention_handler(model, rec):
        for w in tqdm(wins, desc="fine-tuning windows", file=sys.stderr):
            model.model(input_ids=torch.tensor([w]), use_cache=False)
    return rec


def nearest(x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """x [n, H, M, dsub], cent [H, M, C, dsub] -> codes [n, H, M] (nearest centroid, L2)."""
    dist = (cent * cent).sum(-1)[None] - 2 * torch.einsum("nhmd,hmcd->nhmc", x, cent)
    return dist.argmin(-1)


def dequant(cent: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """cent [H, M, C, dsub], codes [n, H, M] -> [n, H, M, dsub]."""
    h, m = cent.shape[:2]
    return cent[torch.arange(h)[None, :, None], torch.arange(m)[None, None, :], codes]


@dataclass(slots=True)
class LayerProblem:
    """One layer's fine-tuning data: per window q [Hq, n, d], k, v [Hkv, n, d]
    (fp32, model space) and k, v in the stored space [n, Hkv, M, dsub]
    (transformed, rounded to fp16 as the daemon stores them)."""
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    kt: list[torch.Tensor]
    vt: list[torch.Tensor]
    ak_inv: torch.Tensor            # [Hkv, d, d]: stored -> model space (x A^-T)
    av_inv: torch.Tensor
    wo: torch.Tensor                # [hidden, Hq * d]
    scaling: float

    @staticmethod
    def build(qkv, ak, av, wo, m: int, scaling: float) -> "LayerProblem":
        q, k, v, kt, vt = [], [], [], [], []
        for qw, kw, vw in qkv:
            hkv, n, d = kw.shape
            q.append(qw.float())
            k.append(kw.float())
            v.append(vw.float())
            kt.append(torch.einsum("hnd,hed->nhe", kw.float(), ak).half().float().reshape(n, hkv, m, d // m))
            vt.append(torch.einsum("hnd,hed->nhe", vw.float(), av).half().float().reshape(n, hkv, m, d // m))
        return LayerProblem(q, k, v, kt, vt, torch.linalg.inv(ak.double()).float(),
                            torch.linalg.inv(av.double()).float(), wo.float(), scaling)

    def loss(self, i: int, rows: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor) -> torch.Tensor:
        """Mean squared o_proj-space error of window i's queries `rows` with every key quantized."""
        q, k, v = self.q[i], self.k[i], self.v[i]
        hkv, n, d = k.shape
        groups = q.shape[0] // hkv
        with torch.no_grad():
            codes_k, codes_v = nearest(self.kt[i], ck), nearest(self.vt[i], cv)
        kh = torch.einsum("nhe,hde->hnd", dequant(ck, codes_k).reshape(n, hkv, d), self.ak_inv)
        vh = torch.einsum("nhe,hde->hnd", dequant(cv, codes_v).reshape(n, hkv, d), self.av_inv)
        qs = q[:, rows]
        causal = torch.arange(n)[None, :] <= rows[:, None]                      # [nq, n]

        def attend(kk, vv):
            s = (qs @ kk.repeat_interleave(groups, 0).transpose(1, 2)) * self.scaling
            return s.masked_fill(~causal, float("-inf")).softmax(-1) @ vv.repeat_interleave(groups, 0)

        with torch.no_grad():
            ref = attend(k, v)
        diff = (attend(kh, vh) - ref).transpose(0, 1).reshape(len(rows), -1)       # [nq, Hq * d]
        return (diff @ self.wo.T).pow(2).sum(-1).mean()


def finetune_layer(problem: LayerProblem, ck: torch.Tensor, cv: torch.Tensor, steps: int, lr: float = 3e-3,
                   queries: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """-> (K centroids, V centroids [Hkv, M, C, dsub], loss before, loss after),
    the losses on a fixed held-out draw of queries of the same windows."""
    gen = torch.Generator().manual_seed(seed)
    nwin = len(problem.q)

    def draw(i):
        n = problem.q[i].shape[1]
        return torch.randperm(n, generator=gen)[:queries].sort().values

    held = [draw(i) for i in range(nwin)]

    def held_loss(a, b):
        with torch.no_grad():
            return sum(problem.loss(i, held[i], a, b).item() for i in range(nwin)) / nwin

    pk, pv = torch.nn.Parameter(ck.float().clone()), torch.nn.Parameter(cv.float().clone())
    before = held_loss(pk, pv)
    opt = torch.optim.Adam([pk, pv], lr=lr)
    for s in range(steps):
        opt.zero_grad()
        problem.loss(s % nwin, draw(s % nwin), pk, pv).backward()
        opt.step()
    after = held_loss(pk, pv)
    if after > before:          # never hand back worse centroids than k-means gave
        return ck.float().clone(), cv.float().clone(), before, before
    return pk.detach(), pv.detach(), before, after


def finetune(model, rec: QKVRecorder, cb: Codebooks, transform, steps: int, lr: float = 3e-3,
             queries: int = 256, log=None) -> tuple[Codebooks, list[tuple[float, float]]]:
    """All layers -> (codebooks, [(loss before, after)] per layer). `transform`
    (kvstore.codec.transform.Transform) is the one the codebooks were trained under."""
    from tqdm import tqdm
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    m = cb.k.shape[2]
    new_k, new_v, losses = cb.k.clone(), cb.v.clone(), []
    for layer in tqdm(range(len(rec.qkv)), desc=f"fine-tune M={m}", file=sys.stderr):
        wo = model.model.layers[layer].self_attn.o_proj.weight.detach()
        eye = torch.eye(d).expand(cb.k.shape[1], d, d)
        ak = transform.k[layer] if transform is not None else eye
        av = transform.v[layer] if transform is not None else eye
        problem = LayerProblem.build(rec.qkv[layer], ak, av, wo, m, d ** -0.5)
        k, v, before, after = finetune_layer(problem, cb.k[layer], cb.v[layer], steps, lr, queries, seed=layer)
        new_k[layer], new_v[layer] = k, v
        losses.append((before, after))
        if log:
            log(f"layer {layer}: attention-output loss {before:.4g} -> {after:.4g} ({after / max(before, 1e-30):.3f})")
    return Codebooks(k=new_k, v=new_v), losses


if __name__ == "__main__":
    import argparse

    from kvstore.codec.transform import Transform, transform_path
    from kvstore.tools import models, text
    p = argparse.ArgumentParser()
    p.add_argument("cb_in")
    p.add_argument("cb_out")
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--queries", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(2)
    model, tok = models.load_smollm2()
    all_w = text.windows(tok(text.read_text(text.CALIB_DIRS)).input_ids, 2048)
    step = max(1, len(all_w) // a.windows)
    cb, tr = Codebooks.load(a.cb_in), Transform.load(transform_path(a.cb_in))
    out, _ = finetune(model, record(model, all_w[3::step][:a.windows]), cb, tr, a.steps, a.lr, a.queries, log=print)
    out.save(a.cb_out)
    tr.save(transform_path(a.cb_out))
