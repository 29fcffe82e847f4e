"""Pure-torch reference kernels: the contract the Triton kernels must meet.

Layouts (docs/design.md, Data model), per layer:
  fp16 block pool    k_cache, v_cache  [num_blocks, Hkv, block_size, d]
  PQ K codes         k_codes           [num_blocks, Hkv, block_size, M] uint8
  PQ V codes         v_codes           [num_blocks, Hkv, M, block_size] uint8
  codebook           [Hkv, M, 256, dsub] with dsub = d // M
Query head h reads KV head h // (Hq // Hkv) (HF `repeat_kv` grouping).

Every attention returns (out [B, Hq, d] in q's dtype, lse [B, Hq] fp32) so that
partial results over disjoint key sets merge exactly (`merge_attention`).
Computation is fp32 (fp64 if the inputs are fp64); rows with no keys give
out = 0 and lse = -inf.

Sliding windows: every attention takes per-sequence start indices (`starts`,
`sealed_starts`, `tail_starts`): only tokens [start, len) of each range are read.
The caller maps a layer's window onto them (plan.window_starts). softcap > 0
replaces every score s (already scaled) by softcap * tanh(s / softcap), as
Gemma-2's attn_logit_softcapping does.
"""
from __future__ import annotations

import torch


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------- PQ codec

def pq_encode(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest centroid per sub-vector.

    x: [N, Hkv, d] float; codebook: [Hkv, M, C, dsub] -> codes [N, Hkv, M] uint8.
    Ties go to the lowest centroid index (torch.argmin), as in the kernel.
    """
    n, hkv, d = x.shape
    _, m, c, dsub = codebook.shape
    assert m * dsub == d and c <= 256
    acc = _acc_dtype(codebook)
    cb = codebook.to(acc).reshape(1, hkv, m, c, dsub)
    # ||x - c||^2 without the ||x||^2 term, which is constant per row:
    # fl(||c||^2 - 2 fl(fl(x0 c0) + fl(x1 c1) ...)), the coordinates added in order.
    norms = (cb * cb).sum(-1)                                    # [1, Hkv, M, C]
    coords = [cb[..., j].contiguous() for j in range(dsub)]
    codes = torch.empty(n, hkv, m, dtype=torch.uint8, device=x.device)
    # A few tokens at a time, one coordinate at a time: temporaries of ~1 MiB that stay in
    # cache, where [N, Hkv, M, C, dsub] products at once made a CPU prefill's encode
    # memory-bound (8-10x slower at 368 tokens of SmolLM2's geometry).
    step = max(1, (1 << 18) // (hkv * m * c))
    for lo in range(0, n, step):
        xs = x[lo:lo + step].to(acc).reshape(-1, hkv, m, 1, dsub)
        dot = xs[..., 0] * coords[0]
        for j in range(1, dsub):
            dot += xs[..., j] * coords[j]
        codes[lo:lo + step] = torch.sub(norms, dot, alpha=2.0).argmin(-1)    # [n', Hkv, M]
    return codes


def pq_dequantize(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """codes: [N, Hkv, M] uint8; codebook: [Hkv, M, C, dsub] -> [N, Hkv, M*dsub]."""
    n, hkv, m = codes.shape
    dsub = codebook.shape[-1]
    idx = codes.long()                                           # [N, Hkv, M]
    h = torch.arange(hkv).view(1, hkv, 1)
    j = torch.arange(m).view(1, 1, m)
    return codebook[h, j, idx].reshape(n, hkv, m * dsub)


def pq_encode_to_slots(x: torch.Tensor, codebook: torch.Tensor, slots: torch.Tensor,
                       k_codes: torch.Tensor | None = None,
                       v_codes: torch.Tensor | None = None) -> None:
    """Encode x [N, Hkv, d] and write the codes of token i into slot slots[i].

    slot = block_id * block_size + offset. Exactly one of k_codes
    [nb, Hkv, bs, M] (row-wise) or v_codes [nb, Hkv, M, bs] (transposed).
    """
    write_codes_to_slots(pq_encode(x, codebook), slots, k_codes, v_codes)


def write_codes_to_slots(codes: torch.Tensor, slots: torch.Tensor,
                         k_codes: torch.Tensor | None = None,
                         v_codes: torch.Tensor | None = None) -> None:
    """codes [N, Hkv, M] uint8 -> slots, as pq_encode_to_slots."""
    assert (k_codes is None) != (v_codes is None)
    slots = slots.long()
    if k_codes is not None:
        bs = k_codes.shape[2]
        k_codes[slots // bs, :, slots % bs, :] = codes
    else:
        bs = v_codes.shape[3]
        # advanced indices separated by a slice: result dims are [N, Hkv, M]
        v_codes.permute(0, 3, 1, 2)[slots // bs, slots % bs] = codes


def gather_pq_blocks(k_codes: torch.Tensor, v_codes: torch.Tensor,
                     k_codebook: torch.Tensor, v_codebook: torch.Tensor,
                     block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize whole blocks -> K, V [n_blocks * bs, Hkv, d] in codebook dtype."""
    kc = k_codes[block_ids.long()]                               # [n, Hkv, bs, M]
    vc = v_codes[block_ids.long()].transpose(2, 3)               # [n, Hkv, bs, M]
    n, hkv, bs, m = kc.shape
    kc = kc.permute(0, 2, 1, 3).reshape(n * bs, hkv, m)
    vc = vc.permute(0, 2, 1, 3).reshape(n * bs, hkv, m)
    return pq_dequantize(kc, k_codebook), pq_dequantize(vc, v_codebook)


def gather_fp16_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, Hkv, bs, d] pools -> K, V [n_blocks * bs, Hkv, d]."""
    k = k_cache[block_ids.long()].permute(0, 2, 1, 3)
    v = v_cache[block_ids.long()].permute(0, 2, 1, 3)
    return k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])


# ---------------------------------------------------------------- attention

def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q [Hq, d]; k, v [n, Hkv, d] -> out [Hq, d] (acc dtype), lse [Hq]."""
    hq, d = q.shape
    n, hkv, _ = k.shape
    acc = _acc_dtype(q)
    if n == 0:
        return (torch.zeros(hq, d, dtype=acc, device=q.device),
                torch.full((hq,), float("-inf"), dtype=acc, device=q.device))
    g = hq // hkv
    qg = q.to(acc).view(hkv, g, d)
    s = torch.einsum("hgd,nhd->hgn", qg, k.to(acc)) * scale     # [Hkv, g, n]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("hgn,nhd->hgd", p, v.to(acc))
    return out.reshape(hq, d), lse.reshape(hq)


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor,
                    o2: torch.Tensor, lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial softmax-attention results over disjoint key sets.

    o*: [..., d]; lse*: [...]. An empty side has lse = -inf and is ignored.
    """
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def fold_sink_logits(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with learned sink logits (gpt-oss) from attention without them, in
    place: one more key a head with score z and a zero value turns out into
    out * Z / (Z + e^z) = out * sigmoid(lse - z), Z = e^lse. out [..., Hq, d], lse
    [..., Hq] fp32 (natural log), sinks [Hq] fp32, finite: a head without a sink takes
    float32's lowest (sink_table), which leaves its output as it is, and a row with no
    keys (lse -inf) at 0, where -inf would make it NaN. Three elementwise launches (the
    product in fp32, rounded once into out's dtype) that a CUDA graph captures after
    the kernels (their cost: docs/kernels.md, bench/bench_sink_logits.py)."""
    return out.mul_(torch.sigmoid(lse - sinks).unsqueeze(-1))


def sink_table(values, rows: int, device=None) -> torch.Tensor:
    """Sink logits (per row of Hq, -inf where none) as fold_sink_logits takes them:
    [rows, Hq] fp32 with -inf as float32's lowest."""
    t = torch.tensor(values, dtype=torch.float32).view(rows, -1)
    return t.clamp_(min=torch.finfo(torch.float32).min).to(device)


def _start(starts, b: int) -> int:
    return 0 if starts is None else int(starts[b])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, starts=None, softcap: float = 0.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 paged decode attention.

    q [B, Hq, d]; k_cache, v_cache [nb, Hkv, bs, d]; block_tables [B, max_blocks]
    int32; seq_lens [B] int32 (tokens); starts [B] (None: zeros): sequence b attends
    to its tokens [starts[b], seq_lens[b]) -> out [B, Hq, d] (q dtype), lse [B, Hq] fp32.
    """
    bs = k_cache.shape[2]
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        nblk = (n + bs - 1) // bs
        k, v = gather_fp16_blocks(k_cache, v_cache, block_tables[b, :nblk])
        lo = _start(starts, b)
        o, l = attention_dense(q[b], k[lo:n], v[lo:n], scale, softcap)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


def pq_decode_attention(q: torch.Tensor,
                        k_codes: torch.Tensor, v_codes: torch.Tensor,
                        k_codebook: torch.Tensor, v_codebook: torch.Tensor,
                        sealed_tables: torch.Tensor, sealed_lens: torch.Tensor,
                        tail_k: torch.Tensor, tail_v: torch.Tensor,
                        tail_tables: torch.Tensor, tail_lens: torch.Tensor,
                        scale: float, sealed_starts=None, tail_starts=None,
                        softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over PQ-coded sealed blocks plus an fp16 paged tail.

    q [B, Hq, d]; k_codes [nb, Hkv, bs, M] u8; v_codes [nb, Hkv, M, bs] u8;
    k/v_codebook [Hkv, M, 256, dsub]; sealed_tables [B, S] int32;
    sealed_lens [B] int32 (tokens, multiple of bs); tail_k/v [nt, Hkv, bs, d];
    tail_tables [B, T] int32; tail_lens [B] int32; sealed_starts, tail_starts [B]
    (None: zeros): only sealed tokens [sealed_starts[b], sealed_lens[b]) and tail
    tokens [tail_starts[b], tail_lens[b]) are attended to.
    Token order: sealed tokens, then tail tokens.
    -> out [B, Hq, d] (q dtype), lse [B, Hq] fp32.
    """
    bs = k_codes.shape[2]
    tbs = tail_k.shape[2]
    outs, lses = [], []
    for b in range(q.shape[0]):
        ns, nt = int(sealed_lens[b]), int(tail_lens[b])
        assert ns % bs == 0, "sealed length must be whole blocks"
        ks, vs = gather_pq_blocks(k_codes, v_codes, k_codebook, v_codebook,
                                  sealed_tables[b, : ns // bs])
        kt, vt = gather_fp16_blocks(tail_k, tail_v, tail_tables[b, : (nt + tbs - 1) // tbs])
        s0, t0 = _start(sealed_starts, b), _start(tail_starts, b)
        o1, l1 = attention_dense(q[b], ks[s0:], vs[s0:], scale, softcap)
        o2, l2 = attention_dense(q[b], kt[t0:nt], vt[t0:nt], scale, softcap)
        o, l = merge_attention(o1, l1, o2, l2)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


def check_write_slots(k, v, k_cache, v_cache, slots) -> None:
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [n, Hkv, d], got {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    n, hkv, d = k.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[1] != hkv or t.shape[3] != d:
            raise ValueError(f"{name} must be [nb, {hkv}, bs, {d}], got {tuple(t.shape)}")
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if slots.dim() != 1 or slots.numel() != n or slots.dtype not in (torch.int32, torch.int64) \
            or slots.device != k.device:
        raise ValueError(f"slots must be [{n}] int32/int64 on {k.device}, got "
                         f"{tuple(slots.shape)} {slots.dtype} on {slots.device}")


def write_slots(k, v, k_cache, v_cache, slots) -> None:
    """k, v [n, Hkv, d] -> k_cache/v_cache [nb, Hkv, bs, d] at slot = block * bs + offset
    (vLLM's slot_mapping)."""
    check_write_slots(k, v, k_cache, v_cache, slots)
    bs = k_cache.shape[2]
    blocks, offsets = slots.long() // bs, slots.long() % bs
    # [nb, Hkv, bs, d]: the two advanced indices around a slice give [n, Hkv, d]
    k_cache[blocks, :, offsets, :] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets, :] = v.to(v_cache.dtype)


# ------------------------------------------------------ multi-token queries

def causal_tail_lens(lens: torch.Tensor, t: int, i: int) -> torch.Tensor:
    """What query i of t new tokens sees of ranges whose last t tokens are those new
    tokens (already written, as AppendAttend writes a step's tokens before it attends):
    all but the t - 1 - i newest."""
    return lens - (t - 1 - i)


def _stack_queries(results) -> tuple[torch.Tensor, torch.Tensor]:
    results = list(results)
    return torch.stack([o for o, _ in results], dim=1), torch.stack([l for _, l in results], dim=1)


def pq_multi_attention(q: torch.Tensor,
                       k_codes: torch.Tensor, v_codes: torch.Tensor,
                       k_codebook: torch.Tensor, v_codebook: torch.Tensor,
                       sealed_tables: torch.Tensor, sealed_lens: torch.Tensor,
                       tail_k: torch.Tensor, tail_v: torch.Tensor,
                       tail_tables: torch.Tensor, tail_lens: torch.Tensor,
                       scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """T query tokens per sequence over PQ-coded sealed blocks plus an fp16 tail whose
    last T tokens are the T new tokens (written before attention), causal among them:
    query i sees every sealed token, and the tail less its T - 1 - i newest tokens.

    q [B, T, Hq, d]; everything else as pq_decode_attention (tail_lens count the new
    tokens, each >= T) -> out [B, T, Hq, d] (q dtype), lse [B, T, Hq] fp32. No sliding
    windows (each query would need its own start): the router refuses them."""
    t = q.shape[1]
    assert bool((tail_lens >= t).all()), "the T new tokens are the tail's last T"
    return _stack_queries(
        pq_decode_attention(q[:, i], k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                            tail_k, tail_v, tail_tables, causal_tail_lens(tail_lens, t, i), scale,
                            softcap=softcap)
        for i in range(t))


def paged_multi_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 paged attention of T query tokens per sequence whose last T tokens are the
    new ones, causal among them: q [B, T, Hq, d]; the rest as paged_decode_attention
    -> out [B, T, Hq, d] (q dtype), lse [B, T, Hq] fp32."""
    t = q.shape[1]
    assert bool((seq_lens >= t).all()), "the T new tokens are each sequence's last T"
    return _stack_queries(
        paged_decode_attention(q[:, i], k_cache, v_cache, block_tables, causal_tail_lens(seq_lens, t, i),
                               scale, softcap=softcap)
        for i in range(t))


# ------------------------------------------------------------- checksums

def check_xxh3_rows(rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.dtype != torch.uint8:
        raise ValueError(f"rows must be [n, width] uint8, got {tuple(rows.shape)} {rows.dtype}")


def xxh3_64_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [n, width] uint8 -> int64 [n] on rows' device: XXH3-64 (seed 0) of
    each row, the bits of the unsigned hash as a signed int64. The reference is
    xxhash's own C code on the CPU (what the tiers store beside each value)."""
    import xxhash            # with the tiers' extra (pyproject.toml): the kernels need it nowhere else
    check_xxh3_rows(rows)
    host = rows.cpu().numpy()
    sums = [xxhash.xxh3_64_intdigest(host[i]) for i in range(host.shape[0])]
    return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in sums], dtype=torch.int64, device=rows.device)
