"""Sliding windows and logit soft-capping in the kernels: the reference against
attention over the tokens in position order with transformers' window mask, the
window -> start-index mapping of a PQ sequence's layout, and every GPU backend (CUDA C++
where it takes the geometry, Triton; Triton also under the interpreter on CPU) against
the reference, eagerly and under CUDA-graph replay after update(). The CUDA C++ plan's
windowed work items on the CPU: test_cuda_window_plan.py.

Without CUDA the Triton kernels run in the interpreter, which tests/conftest.py sets up.
"""
import math

import pytest
import torch

from test_triton_kernels import HAS_CUDA, INTERPRET, cpu_only, gpu  # noqa: F401
from kernel_cases import POISON, RUN_ARGS, check_attn, make_pq_case, pq_ref, pq_steps, window_starts
from kernel_cases import tables as make_tables

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels.cuda import attention as cuda_attention
from kvstore.kernels.cuda import build
from kvstore.kernels.plan import pq_window_starts, window_start

HAS_CUDA_CXX = HAS_CUDA and build.available()


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


# ---------------------------------------------------- every backend (Triton, CUDA C++)

def _image(c):
    """Case c's codebook image as its owner builds it (None where no kernel reads one)."""
    words = kernels.codebook_images(c["k_codebook"][None], c["v_codebook"][None], c["q"].shape[1])
    return None if words is None else kernels.layer_images(words, c["q"].shape[1], c["k_codebook"].shape[-1])[0]


def _plan(c, lens, starts, softcap, backend, **kw):
    return kernels.plan_decode("pq", *lens, *starts, num_qo_heads=c["q"].shape[1],
                               num_kv_heads=c["k_codes"].shape[1], head_dim=c["q"].shape[2],
                               block_size=c["k_codes"].shape[2], tail_block_size=c["tail_k"].shape[2],
                               device=c["q"].device, dtype=c["q"].dtype, kv_dtype=c["tail_k"].dtype,
                               codebook_dtype=c["k_codebook"].dtype, backend=backend, softcap=softcap, **kw)


def _windowed_pq(c, window, sinks, softcap, backend="triton", image=None, **kw):
    """Plan and run case c with each sequence's window; -> (plan, out, lse, (ss, ts))."""
    ss, ts = window_starts(c, window, sinks)
    plan = _plan(c, (c["sealed_lens"], c["tail_lens"]), (ss, ts), softcap, backend, **kw)
    out = torch.full_like(c["q"], POISON)
    lse = torch.full(c["q"].shape[:2], POISON, device=c["q"].device)
    plan.run_pq(*[c[k] for k in RUN_ARGS], 0.2, out=out, lse=lse, codebook_image=image)
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

def _tol(backend, dtype):
    """Relative error bound of out, as each backend's own tests have it (CUDA C++:
    test_cuda_attention.py)."""
    if backend == kernels.CUDA:
        return 2.5e-2 if dtype == torch.bfloat16 else 4e-3
    return 2e-2 if dtype == torch.bfloat16 else 3e-3


def _backends_for(c):
    """The GPU backends that take case c: Triton, and the CUDA C++ kernels where they apply."""
    ok = HAS_CUDA_CXX and cuda_attention.supports(
        num_qo_heads=c["q"].shape[1], num_kv_heads=c["k_codes"].shape[1], head_dim=c["q"].shape[2],
        block_size=c["k_codes"].shape[2], device=c["q"].device, dtype=c["q"].dtype,
        kv_dtype=c["tail_k"].dtype, codebook_dtype=c["k_codebook"].dtype)
    return (kernels.TRITON, kernels.CUDA) if ok else (kernels.TRITON,)


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("d,dsub,hq,hkv", [(64, 2, 8, 2), (128, 4, 8, 1), (256, 2, 8, 1), (128, 2, 4, 4),
                                           (64, 4, 6, 2), (128, 2, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window,sinks,softcap", [
    (100, 0, 0.0),        # long sequence: start inside the tail, past every PQ token
    (700, 32, 0.0),       # mid-tile in the sealed blocks, sinks outside the window
    (333, 32, 50.0),      # mid-tile and Gemma-2's cap
    (0, 0, 30.0),         # soft-cap alone
    (60, 16, 0.0),        # short sequences: into the sinks; the long one inside its tail
])
def test_pq_window_softcap_gpu(backend, d, dsub, hq, hkv, dtype, window, sinks, softcap):
    c = make_pq_case([40, 3, 0], [150, 21, 9], hq, hkv, d, dsub, 16, 16, dtype, "cuda", seed=9)
    c["q"] = c["q"] * 4
    if backend not in _backends_for(c):
        pytest.skip("the CUDA C++ kernels do not take this geometry")
    tol = _tol(backend, dtype)
    ss, ts = window_starts(c, window, sinks)
    ro, rl = pq_ref(c, 0.2, sealed_starts=ss, tail_starts=ts, softcap=softcap)
    if softcap:       # the cap changes the answer: the comparison can tell
        assert (pq_ref(c, 0.2, sealed_starts=ss, tail_starts=ts)[0] - ro).norm() > 1e-2 * ro.norm()
    if backend == kernels.TRITON:
        plan, out, lse, _ = _windowed_pq(c, window, sinks, softcap, backend="triton")
        assert type(plan).__name__ == "TritonDecodePlan"
        check_attn(out, lse, ro, rl, tol)
        return
    # the router's own choice, both codebook stagings (bulk copies of the image on sm_90,
    # registers), one wave of items and many small items
    for image in ((_image(c), None) if dsub == 2 else (None,)):
        for ctas in (None, 2 * hkv):
            plan, out, lse, _ = _windowed_pq(c, window, sinks, softcap, backend="auto", image=image,
                                             target_ctas=ctas)
            assert isinstance(plan, cuda_attention.CudaPQPlan) and plan.windowed
            check_attn(out, lse, ro, rl, tol)


GRAPH_STEPS = [([30, 3, 0], [40, 21, 9]), ([30, 3, 0], [41, 22, 10]), ([32, 4, 0], [26, 23, 11]),
               ([40, 4, 1], [150, 30, 18])]


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dsub,dtype", [(2, torch.float16), (4, torch.bfloat16), (2, torch.bfloat16)])
def test_pq_window_graph_update_gpu(backend, dsub, dtype):
    """A windowed, soft-capped plan captured in a CUDA graph, then update()d to each
    step's lengths and starts and replayed: what the daemon's decode graphs do."""
    c, at = pq_steps(GRAPH_STEPS, seed=14, hq=16, hkv=4, d=128, dsub=dsub, dtype=dtype, device="cuda")
    c["q"] = c["q"] * 4
    if backend not in _backends_for(c):
        pytest.skip("the CUDA C++ kernels do not take this geometry")
    window, cap, tol = 200, 30.0, _tol(backend, dtype)
    c0 = at(0)
    plan = _plan(c0, (c0["sealed_lens"].tolist(), c0["tail_lens"].tolist()), window_starts(c0, window, 16), cap,
                 backend, spare_items=16)
    assert type(plan).__name__ == ("CudaPQPlan" if backend == kernels.CUDA else "TritonDecodePlan")
    out = torch.full_like(c["q"], POISON)
    lse = torch.full(c["q"].shape[:2], POISON, device="cuda")
    args = [c[k] for k in RUN_ARGS]
    img = _image(c) if backend == kernels.CUDA else None
    plan.run_pq(*args, 0.2, out=out, lse=lse, codebook_image=img)     # compiles outside the capture
    torch.cuda.synchronize()
    s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            plan.run_pq(*args, 0.2, out=out, lse=lse, codebook_image=img)
    for step in range(len(GRAPH_STEPS)):
        cs = at(step)
        ss, ts = window_starts(cs, window, 16)
        plan.update(cs["sealed_lens"].tolist(), cs["tail_lens"].tolist(), ss, ts)
        out.fill_(POISON)
        lse.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        check_attn(out, lse, *pq_ref(cs, 0.2, sealed_starts=ss, tail_starts=ts, softcap=cap), tol)


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
