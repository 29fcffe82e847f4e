"""Decode attention on the daemon's CPU device, one sequence at a time: the
math of reference.py (fp32, GQA grouping, sealed PQ tokens before tail
tokens), laid out so a tiny decode step is a handful of torch ops instead of
reference.py's few dozen (per-op overhead dominates at these shapes).

Attention over sealed and tail tokens together equals reference.py's merge
of the two partial results by log-sum-exp; tests/test_latency_paths.py
checks it against the reference.
"""
from __future__ import annotations

import torch


def gather_tokens(pool: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """pool [nb, Hkv, bs, d]; the first n tokens of blocks (long [nblk]) -> [Hkv, n, d] fp32."""
    sel = pool.index_select(0, blocks)                                    # [nblk, Hkv, bs, d]
    h, d = sel.shape[1], sel.shape[3]
    return sel.transpose(0, 1).reshape(h, -1, d)[:, :n].float()


def dequantize_tokens(k_codes: torch.Tensor, v_codes: torch.Tensor, k_codebook: torch.Tensor,
                      v_codebook: torch.Tensor, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sealed PQ blocks -> K, V [Hkv, len(blocks) * bs, d] fp32, as
    reference.gather_pq_blocks (one flat gather from the codebook per side).

    k_codes [nb, Hkv, bs, M], v_codes [nb, Hkv, M, bs] uint8;
    codebooks [Hkv, M, 256, dsub]."""
    ids = torch.tensor(blocks, dtype=torch.long)
    hkv, m, c, dsub = k_codebook.shape
    # code of (head h, sub-vector j) -> row (h * M + j) * 256 + code of the [Hkv * M * 256, dsub] codebook
    base = (torch.arange(hkv * m, dtype=torch.long) * c).view(hkv, 1, m)
    kc = k_codes.index_select(0, ids).transpose(0, 1).reshape(hkv, -1, m)                 # [Hkv, n, M]
    vc = v_codes.index_select(0, ids).permute(1, 0, 3, 2).reshape(hkv, -1, m)
    n = kc.shape[1]
    k = k_codebook.reshape(-1, dsub).index_select(0, (kc.long() + base).reshape(-1)).view(hkv, n, m * dsub)
    v = v_codebook.reshape(-1, dsub).index_select(0, (vc.long() + base).reshape(-1)).view(hkv, n, m * dsub)
    return k.float(), v.float()


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, d]; k, v [Hkv, n, d] fp32 (n >= 1) -> out [Hq, d] fp32. softcap > 0: scores
    s become softcap * tanh(s / softcap) (reference.attention_dense). One query token:
    attend_causal with T = 1, whose mask then hides nothing."""
    return attend_causal(q[None], k, v, scale, softcap, sinks)[0]


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, d] (the sequence's T newest tokens); k, v [Hkv, n, d] fp32 (n >= T, the
    T new tokens last) -> out [T, Hq, d] fp32: query i sees tokens [0, n - T + i]
    (reference.pq_multi_attention). sinks [Hq] fp32: learned sink logits, one more
    score a head with a zero value (-inf: none), as gpt-oss's eager attention."""
    t, hq, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    g = hq // hkv
    qg = (q.float() * scale).view(t, hkv, g, d).transpose(0, 1).reshape(hkv, t * g, d)
    s = torch.bmm(qg, k.transpose(1, 2)).view(hkv, t, g, n)                 # [Hkv, T, g, n]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]    # [T, n]
    s = s.masked_fill(~seen[None, :, None, :], float("-inf"))
    if sinks is not None:
        z = sinks.float().view(hkv, 1, g, 1).expand(hkv, t, g, 1)
        p = torch.softmax(torch.cat([s, z], dim=-1), dim=-1)[..., :n].contiguous()
    else:
        p = torch.softmax(s, dim=-1)
    out = torch.bmm(p.view(hkv, t * g, n), v)                                 # [Hkv, T * g, d]
    return out.view(hkv, t, g, d).transpose(0, 1).reshape(t, hq, d)
