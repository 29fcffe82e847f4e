"""Shared builders and checks of the kernel tests: random PQ / paged cases, the fp64
reference of each, and the comparisons (explicit tolerances, outputs poisoned first).

(Named kernel_cases, not cases: pytest puts this folder on sys.path, so the module name
must not collide with a helper of another test folder.)
"""
import torch

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels.plan import pq_window_starts

POISON = float("nan")
HAS_CUDA = torch.cuda.is_available()


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tables(lens, bs, pool, gen):
    """Random disjoint block tables [B, max_blocks] int32 from a pool of `pool` blocks."""
    nblk = [(n + bs - 1) // bs for n in lens]
    assert sum(nblk) <= pool
    perm = torch.randperm(pool, generator=gen)
    t = torch.full((len(lens), max(nblk + [1])), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        t[b, :n] = perm[i:i + n]
        i += n
    return t


def split_lens(lens, bs):
    """Total lengths -> (sealed blocks, tail lengths): the tail is L % bs tokens, plus one
    block for every other sequence long enough (so tails of 0 to 2 * bs - 1 tokens)."""
    sealed, tails = [], []
    for i, n in enumerate(lens):
        t = n % bs + (bs if (i % 2 and n >= bs) else 0)
        sealed.append((n - t) // bs)
        tails.append(t)
    return sealed, tails


def make_pq_case(sealed_blocks, tails, hq, hkv, d, dsub, bs, tbs, dtype, device, seed=0):
    """The arguments of reference.pq_decode_attention (without scale): random codes,
    codebooks (fp16 for an fp32 case), fp16 tail and disjoint block tables."""
    gen = torch.Generator().manual_seed(seed)
    m = d // dsub
    cb_dt = dtype if dtype != torch.float32 else torch.float16
    nb = sum(sealed_blocks) + 2
    nt = sum((t + tbs - 1) // tbs for t in tails) + 2
    c = dict(
        q=torch.randn(len(tails), hq, d, generator=gen).to(dtype),
        k_codes=torch.randint(0, 256, (nb, hkv, bs, m), generator=gen, dtype=torch.uint8),
        v_codes=torch.randint(0, 256, (nb, hkv, m, bs), generator=gen, dtype=torch.uint8),
        k_codebook=torch.randn(hkv, m, 256, dsub, generator=gen).to(cb_dt),
        v_codebook=torch.randn(hkv, m, 256, dsub, generator=gen).to(cb_dt),
        sealed_tables=tables([n * bs for n in sealed_blocks], bs, nb, gen),
        sealed_lens=torch.tensor([n * bs for n in sealed_blocks], dtype=torch.int32),
        tail_k=torch.randn(nt, hkv, tbs, d, generator=gen).to(dtype),
        tail_v=torch.randn(nt, hkv, tbs, d, generator=gen).to(dtype),
        tail_tables=tables(tails, tbs, nt, gen),
        tail_lens=torch.tensor(tails, dtype=torch.int32))
    return {k: v.to(device) for k, v in c.items()}


RUN_ARGS = ("q", "k_codes", "v_codes", "k_codebook", "v_codebook", "sealed_tables", "tail_k", "tail_v",
            "tail_tables")


def pq_ref(c, scale, **kw):
    """(out, lse) of the case by reference.pq_decode_attention in fp64, on the CPU; kw:
    its sealed_starts, tail_starts, softcap."""
    c64 = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) for k, v in c.items()}
    return ref.pq_decode_attention(**c64, scale=scale, **kw)


def window_starts(c, window, sinks):
    """Each sequence's (sealed, tail) window starts in case c (plan.pq_window_starts; a
    sequence with no sealed blocks holds every token, sinks included, in its tail; window
    0: zeros)."""
    ss, ts = [], []
    for n_s, n_t in zip(c["sealed_lens"].tolist(), c["tail_lens"].tolist()):
        a, b = pq_window_starts(n_s + n_t, window, sinks if n_s else 0, n_s) if window else (0, 0)
        ss.append(a)
        ts.append(b)
    return ss, ts


def pq_steps(steps, seed, hq=4, hkv=2, d=64, dsub=2, dtype=torch.float16, device="cpu"):
    """A case with room for every decode step's lengths (steps: [(sealed blocks, tails)]
    per step), and at(i): the case at step i (its lengths). On CPU q is fp64."""
    most = [[max(col) for col in zip(*(st[j] for st in steps))] for j in (0, 1)]
    c = make_pq_case(*most, hq, hkv, d, dsub, 16, 16, dtype, device, seed=seed)
    if device == "cpu":
        c["q"] = c["q"].double()

    def at(i):
        sealed, tails = steps[i]
        return dict(c, sealed_lens=torch.tensor([16 * n for n in sealed], dtype=torch.int32),
                    tail_lens=torch.tensor(tails, dtype=torch.int32))
    return c, at


def plan_pq(c, backend="auto", **kw):
    """The router's plan for case c (its dtypes, lengths and geometry)."""
    return kernels.plan_decode("pq", c["sealed_lens"], c["tail_lens"], num_qo_heads=c["q"].shape[1],
                               num_kv_heads=c["k_codes"].shape[1], head_dim=c["q"].shape[2],
                               block_size=c["k_codes"].shape[2], tail_block_size=c["tail_k"].shape[2],
                               device=c["q"].device, dtype=c["q"].dtype, kv_dtype=c["tail_k"].dtype,
                               codebook_dtype=c["k_codebook"].dtype, backend=backend, **kw)


def run_pq(plan, c, scale, codebook_image=None):
    """plan.run_pq on case c into NaN-poisoned out / lse."""
    out = torch.full_like(c["q"], POISON)
    lse = torch.full(c["q"].shape[:2], POISON, device=c["q"].device)
    plan.run_pq(*[c[k] for k in RUN_ARGS], scale, out=out, lse=lse, codebook_image=codebook_image)
    return out, lse


def check_attn(out, lse, ro, rl, tol):
    """out / lse against the fp64 reference: every element written, relative error of out
    under tol, lse finite exactly where the reference's is and within 10 * tol."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten output"
    err = rel(out.cpu(), ro)
    assert err < tol, err
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    if fin.any():
        assert (lse.cpu().double()[fin] - rl[fin]).abs().max().item() < 10 * tol


def check_encode(x, cb, slots, bs, device, encode):
    """encode(x, cb, slots, k_codes= / v_codes=) on device against
    reference.pq_encode_to_slots: near-ties may differ (fp32 rounding, 8 packed index
    bits), on under 1 % of codes, and then the chosen centroid is as close as the
    reference's to ~1e-4 relative."""
    nb, (n, hkv, _), m = 1 + int(slots.max()) // bs, x.shape, cb.shape[1]
    for kind, shape in (("k_codes", (nb, hkv, bs, m)), ("v_codes", (nb, hkv, m, bs))):
        got = torch.full(shape, 7, dtype=torch.uint8, device=device)
        want = got.cpu().clone()
        encode(x.to(device), cb.to(device), slots.to(device), **{kind: got})
        ref.pq_encode_to_slots(x, cb, slots, **{kind: want})
        diff = got.cpu() != want
        assert diff.float().mean().item() < 0.01, kind
        if diff.any():
            codes = ref.pq_encode(x, cb)
            sl = slots.long()
            g = (got.cpu()[sl // bs, :, sl % bs, :] if kind == "k_codes"
                 else got.cpu().permute(0, 3, 1, 2)[sl // bs, sl % bs])
            xs = x.double().reshape(n, hkv, m, -1)
            h = torch.arange(hkv).view(1, hkv, 1)
            j = torch.arange(m).view(1, 1, m)
            dg = ((cb.double()[h, j, g.long()] - xs) ** 2).sum(-1)
            dr = ((cb.double()[h, j, codes.long()] - xs) ** 2).sum(-1)
            assert (dg - dr).max().item() <= 1e-4 * (xs ** 2).sum(-1).max().item() + 1e-6
