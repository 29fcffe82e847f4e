"""Sliding windows and logit soft-capping in the kernels: the reference against
attention over the tokens in position order with transformers' window mask, the
window -> start-index mapping of a PQ sequence's layout, the Triton kernels (the
interpreter on CPU, every shape on GPU) and the router's choice against the
reference.

Triton's interpreter must be set up before triton is first imported: this module
defers to test_triton_kernels.py's set-up by importing it first.
"""
import math

import pytest
import torch

from test_triton_kernels import HAS_CUDA, INTERPRET, cpu_only, gpu  # noqa: F401  (sets TRITON_INTERPRET)
from kernel_cases import POISON, RUN_ARGS, check_attn, make_pq_case, plan_pq, pq_ref
from kernel_cases import tables as make_tables

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels.plan import pq_window_starts, window_start


def _hf_window_mask(length: int, window: int) -> torch.Tensor:
    """transformers' sliding-window overlay for the query at position length - 1
    (masking_utils.sliding_window_overlay: kv_idx > q_idx - window), causal."""
    kv = torch.arange(length)
    q_idx = length - 1
    return (kv > q_idx - window) & (kv <= q_idx)


def _positional(c, sinks: int):
    """The PQ case's K/V in position order, as core/sequence.py lays a sequence out:
    the tail table's first sinks tokens, the sealed tokens, then the rest of the tail."""
    bs, tbs = c["k_codes"].shape[2], c["tail_k"].shape[2]
    ns, nt = int(c["sealed_lens"][0]), int(c["tail_lens"][0])
    ks, vs = ref.gather_pq_blocks(c["k_codes"], c["v_codes"], c["k_codebook"].double(),
                                  c["v_codebook"].double(), c["sealed_tables"][0, :ns // bs])
    kt, vt = ref.gather_fp16_blocks(c["tail_k"].double(), c["tail_v"].double(),
                                    c["tail_tables"][0, :math.ceil(nt / tbs)])
    s0 = sinks if ns else 0
    k = torch.cat([kt[:s0], ks, kt[s0:nt]])
    v = torch.cat([vt[:s0], vs, vt[s0:nt]])
    return k, v


def test_window_start_is_transformers_boundary():
    # the query at position L - 1 reads exactly the last `window` positions, itself included
    for length in (1, 5, 16, 17, 40):
        for window in (1, 4, 16, 64):
            mask = _hf_window_mask(length, window)
            lo = window_start(length, window)
            assert mask.nonzero().flatten().tolist() == list(range(lo, length))
    assert window_start(100, 0) == 0       # no window


@pytest.mark.parametrize("sinks,sealed_blocks,tail,window", [
    (0, 4, 20, 10),       # window inside the tail
    (0, 4, 20, 30),       # window reaches into the sealed blocks, mid-block
    (0, 4, 20, 84),       # exactly everything
    (16, 3, 21, 7),       # sinks present but outside the window
    (16, 3, 21, 40),      # window in the sealed blocks: no sink read
    (16, 3, 21, 75),      # window reaches into the sinks
    (16, 0, 13, 5),       # no sealed blocks yet
    (16, 0, 30, 20),
])
def test_pq_window_matches_positional_mask(sinks, sealed_blocks, tail, window):
    bs = 16
    c = make_pq_case([sealed_blocks], [tail], 4, 2, 64, 2, bs, bs, torch.float64, "cpu", seed=3)
    c["k_codebook"], c["v_codebook"] = c["k_codebook"].double(), c["v_codebook"].double()
    k, v = _positional(c, sinks)
    length = k.shape[0]
    mask = _hf_window_mask(length, window)
    want, want_lse = ref.attention_dense(c["q"][0], k[mask], v[mask], 0.3)
    ss, ts = pq_window_starts(length, window, sinks, sealed_blocks * bs)
    got, lse = ref.pq_decode_attention(**c, scale=0.3, sealed_starts=[ss], tail_starts=[ts])
    assert torch.allclose(got[0], want, atol=1e-12) and torch.allclose(lse[0].double(), want_lse, atol=1e-6)
    # and the window changes the answer where it leaves tokens out
    if mask.sum() < length:
        full, _ = ref.pq_decode_attention(**c, scale=0.3)
        assert not torch.allclose(full, got)


def test_paged_window_and_softcap_reference():
    gen = torch.Generator().manual_seed(4)
    bs, hq, hkv, d = 16, 4, 2, 32
    lens = [1, 37, 70]
    nb = sum(math.ceil(n / bs) for n in lens)
    kc, vc = (torch.randn(nb, hkv, bs, d, generator=gen, dtype=torch.float64) for _ in range(2))
    q = torch.randn(3, hq, d, generator=gen, dtype=torch.float64) * 4
    tables = make_tables(lens, bs, nb, gen)
    window, cap = 24, 5.0
    starts = [window_start(n, window) for n in lens]
    out, _ = ref.paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), 0.5, starts=starts, softcap=cap)
    for b, n in enumerate(lens):
        k, v = ref.gather_fp16_blocks(kc, vc, tables[b, :math.ceil(n / bs)])
        k, v = k[:n][_hf_window_mask(n, window)], v[:n][_hf_window_mask(n, window)]
        # Gemma-2's eager attention: scores * scale, / cap, tanh, * cap, softmax
        s = torch.einsum("hgd,nhd->hgn", q[b].view(hkv, hq // hkv, d), k) * 0.5
        p = torch.softmax(torch.tanh(s / cap) * cap, dim=-1)
        want = torch.einsum("hgn,nhd->hgd", p, v).reshape(hq, d)
        assert torch.allclose(out[b], want, atol=1e-12)


# ------------------------------------------------------------------ Triton

def _windowed_pq(c, window, sinks, softcap, backend="triton", **kw):
    """Plan and run case c with each sequence's window; -> (out, lse, (ss, ts))."""
    bs = c["k_codes"].shape[2]
    ss, ts = [], []
    for n_s, n_t in zip(c["sealed_lens"].tolist(), c["tail_lens"].tolist()):
        length = n_s + n_t
        a, b = pq_window_starts(length, window, sinks if n_s else 0, n_s) if window else (0, 0)
        ss.append(a)
        ts.append(b)
    plan = kernels.plan_decode("pq", c["sealed_lens"], c["tail_lens"], ss, ts, num_qo_heads=c["q"].shape[1],
                               num_kv_heads=c["k_codes"].shape[1], head_dim=c["q"].shape[2], block_size=bs,
                               tail_block_size=c["tail_k"].shape[2], device=c["q"].device, dtype=c["q"].dtype,
                               kv_dtype=c["tail_k"].dtype, codebook_dtype=c["k_codebook"].dtype,
                               backend=backend, softcap=softcap, **kw)
    out = torch.full_like(c["q"], POISON)
    lse = torch.full(c["q"].shape[:2], POISON, device=c["q"].device)
    plan.run_pq(*[c[k] for k in RUN_ARGS], 0.2, out=out, lse=lse)
    return plan, out, lse, (ss, ts)


@cpu_only
@pytest.mark.parametrize("window,sinks,softcap", [(20, 0, 0.0), (45, 16, 0.0), (0, 0, 3.0), (37, 0, 2.5)])
def test_triton_pq_window_softcap_cpu(window, sinks, softcap):
    c = make_pq_case([4, 1, 0], [21, 17, 9], 4, 2, 64, 2, 16, 16, torch.float16, "cpu", seed=5)
    c["q"] = c["q"] * 6          # scores large enough for the cap to bite
    plan, out, lse, (ss, ts) = _windowed_pq(c, window, sinks, softcap, target_ctas=4)
    c64 = {k: (v.double() if v.is_floating_point() else v) for k, v in c.items()}
    ro, rl = ref.pq_decode_attention(**c64, scale=0.2, sealed_starts=ss, tail_starts=ts, softcap=softcap)
    check_attn(out, lse, ro, rl, 2e-3)
    if window or softcap:        # the window / cap changed the answer: the test can tell
        plain, _ = pq_ref(c, 0.2)
        assert (plain - ro).norm() > 1e-2 * ro.norm()


@cpu_only
def test_triton_paged_window_update_cpu():
    """A paged plan with starts, updated to new lengths and starts (what a decode graph does)."""
    gen = torch.Generator().manual_seed(6)
    bs, hkv, d = 16, 1, 64
    kc, vc = (torch.randn(10, hkv, bs, d, generator=gen).half() for _ in range(2))
    q = (torch.randn(2, 2, d, generator=gen) * 5).half()
    tables = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 0]], dtype=torch.int32)
    plan = kernels.plan_decode("paged", [20, 5], [4, 0], num_qo_heads=2, num_kv_heads=hkv, head_dim=d,
                               block_size=bs, device="cpu", dtype=q.dtype, backend="triton", target_ctas=2,
                               spare_items=2, softcap=4.0)
    for lens in ([20, 5], [55, 40]):
        starts = [window_start(n, 17) for n in lens]
        plan.update(lens, starts)
        out, lse = plan.run_paged(q, kc, vc, tables, 0.125)
        ro, rl = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, torch.tensor(lens),
                                            0.125, starts=starts, softcap=4.0)
        check_attn(out, lse, ro, rl, 2e-3)


def test_plan_refuses_bad_starts_and_softcap():
    kw = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16, device="cpu", dtype=torch.float16,
              backend="triton")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="starts"):
        kernels.plan_decode("paged", [5], [6], **kw)          # a start past the length
    with pytest.raises(ValueError, match="softcap"):
        kernels.plan_decode("paged", [5], softcap=float("nan"), **kw)
    with pytest.raises(ValueError, match="paged"):
        kernels.plan_decode("paged", [5], [0], [0], **kw)


def test_router_entry_points_window_on_cpu():
    """router.pq_decode_attention / paged_decode_attention pass windows and soft-cap on
    (the reference off the GPU)."""
    c = make_pq_case([3], [20], 2, 1, 64, 2, 16, 16, torch.float32, "cpu", seed=8)
    a = kernels.pq_decode_attention(*[c[k] for k in ("q", "k_codes", "v_codes", "k_codebook", "v_codebook",
                                                     "sealed_tables", "sealed_lens", "tail_k", "tail_v",
                                                     "tail_tables", "tail_lens")], 0.2, [10], [0], 3.0)
    b = ref.pq_decode_attention(**c, scale=0.2, sealed_starts=[10], tail_starts=[0], softcap=3.0)
    assert torch.equal(a[0], b[0])


# -------------------------------------------------------------------- GPU

@gpu
def test_router_sends_windows_and_softcap_to_triton_gpu():
    """Where the CUDA C++ kernels take the geometry, a window or a soft-cap still goes to Triton."""
    geo = dict(device="cuda", num_qo_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
               dtype=torch.float16)
    assert kernels.decode_backend("pq", windowed=True, **geo) == kernels.TRITON
    assert kernels.decode_backend("pq", softcap=30.0, **geo) == kernels.TRITON
    with pytest.raises(ValueError, match="sliding window"):
        kernels.decode_backend("pq", windowed=True, backend="cuda", **geo)


@gpu
@pytest.mark.parametrize("d,dsub,hq,hkv", [(64, 2, 8, 2), (128, 4, 8, 1), (256, 2, 8, 1), (128, 2, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window,sinks,softcap", [(100, 0, 0.0), (700, 32, 0.0), (333, 32, 50.0), (0, 0, 30.0)])
def test_triton_pq_window_softcap_gpu(d, dsub, hq, hkv, dtype, window, sinks, softcap):
    c = make_pq_case([40, 3, 0], [150, 21, 9], hq, hkv, d, dsub, 16, 16, dtype, "cuda", seed=9)
    c["q"] = c["q"] * 4
    plan, out, lse, (ss, ts) = _windowed_pq(c, window, sinks, softcap, backend="auto")
    assert type(plan).__name__ == "TritonDecodePlan"
    c64 = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) for k, v in c.items()}
    ro, rl = ref.pq_decode_attention(**c64, scale=0.2, sealed_starts=ss, tail_starts=ts, softcap=softcap)
    check_attn(out, lse, ro, rl, 2e-2 if dtype == torch.bfloat16 else 3e-3)


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_paged_window_softcap_gpu(d, dtype):
    gen = torch.Generator().manual_seed(10)
    bs, hq, hkv = 16, 8, 2
    lens = [1, 54, 97, 1500]
    nb = sum(math.ceil(n / bs) for n in lens) + 1
    kc, vc = (torch.randn(nb, hkv, bs, d, generator=gen).to(dtype) for _ in range(2))
    q = (torch.randn(len(lens), hq, d, generator=gen) * 3).to(dtype)
    tables = make_tables(lens, bs, nb, gen)
    for window, cap in ((40, 0.0), (513, 20.0), (0, 20.0)):
        starts = [window_start(n, window) for n in lens]
        got = kernels.paged_decode_attention(q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(),
                                             torch.tensor(lens), d ** -0.5, starts=starts, softcap=cap)
        ro, rl = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, torch.tensor(lens),
                                            d ** -0.5, starts=starts, softcap=cap)
        check_attn(*got, ro, rl, 2e-2 if dtype == torch.bfloat16 else 3e-3)
