"""Triton kernels vs kernels/reference.py.

Without CUDA the kernels run in Triton's interpreter (tiny fp16/fp32 shapes):
tests/conftest.py sets TRITON_INTERPRET before any test module imports triton. GPU
tests (`-m gpu`) cover the full parameter grid including bf16.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")

from kernel_cases import (POISON, RUN_ARGS, check_attn, check_encode, make_pq_case,  # noqa: E402
                          plan_pq, pq_ref)
from kernel_cases import tables as make_tables  # noqa: E402

from kvstore import kernels  # noqa: E402
from kvstore.kernels import reference as ref  # noqa: E402
from kvstore.kernels.triton import decode as triton_decode  # noqa: E402
from kvstore.kernels.triton import dequantize, encode, slot_write  # noqa: E402

cpu_only = pytest.mark.skipif(HAS_CUDA or not INTERPRET,
                              reason="interpreter tests: CPU with TRITON_INTERPRET=1")


def test_the_interpreter_tests_run_without_cuda():
    # every cpu_only test below skips when triton was imported before TRITON_INTERPRET was
    # set (tests/conftest.py sets it first): a CPU run must not skip them all unseen
    assert HAS_CUDA or INTERPRET, "triton was imported without TRITON_INTERPRET: the interpreter tests would skip"


def gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(f))


def run_pq(c, scale, target_ctas=None):
    """The Triton plan of case c (backend="triton": on the CPU too), run into poisoned buffers."""
    from kernel_cases import run_pq as run
    return run(plan_pq(c, backend="triton", target_ctas=target_ctas), c, scale)


def plan_paged(lens, q, kc, **kw):
    return kernels.plan_decode("paged", lens, num_qo_heads=q.shape[1], num_kv_heads=kc.shape[1],
                               head_dim=q.shape[2], block_size=kc.shape[2], device=q.device,
                               dtype=q.dtype, backend="triton", **kw)


def run_paged(q, kc, vc, tables, lens, scale, target_ctas=None):
    plan = plan_paged(lens, q, kc, target_ctas=target_ctas)
    out = torch.full_like(q, POISON)
    lse = torch.full(q.shape[:2], POISON, device=q.device)
    return plan.run_paged(q, kc, vc, tables, scale, out=out, lse=lse)


# ------------------------------------------------------------------ CPU (interpreter)

@cpu_only
@pytest.mark.parametrize("hq,hkv,d,dsub,bs,sealed,tails,dtype", [
    (4, 1, 64, 2, 16, [4, 8], [5, 0], torch.float16),
    (6, 2, 64, 4, 32, [0, 8], [17, 3], torch.float32),
    (3, 3, 64, 2, 16, [3], [33], torch.float16),
    (8, 1, 128, 4, 64, [5, 0], [1, 0], torch.float16),
])
def test_pq_decode_cpu(hq, hkv, d, dsub, bs, sealed, tails, dtype):
    c = make_pq_case(sealed, tails, hq, hkv, d, dsub, bs, 16, dtype, "cpu")
    out, lse = run_pq(c, d ** -0.5, target_ctas=4 * hkv)
    ro, rl = pq_ref(c, d ** -0.5)
    check_attn(out, lse, ro, rl, 2e-3)


@cpu_only
@pytest.mark.parametrize("hq,hkv,d,bs,lens,dtype", [
    (4, 2, 64, 16, [1, 54, 97], torch.float16),
    (3, 1, 64, 32, [300, 0], torch.float32),
])
def test_paged_decode_cpu(hq, hkv, d, bs, lens, dtype):
    gen = torch.Generator().manual_seed(1)
    nb = sum((n + bs - 1) // bs for n in lens) + 1
    kc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    vc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    tables = make_tables(lens, bs, nb, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out, lse = run_paged(q, kc, vc, tables, lens_t, 0.125, target_ctas=2 * hkv)
    ro, rl = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, lens_t, 0.125)
    check_attn(out, lse, ro, rl, 2e-3)


def _update_cases(device, dtype):
    """Two steps of one batch: the second with other lengths and tables (pools of
    the same sizes, so a graph's buffers can hold either)."""
    kw = dict(hq=4, hkv=2, d=64, dsub=2, bs=16, tbs=16, dtype=dtype, device=device)
    first = make_pq_case([4, 0, 2], [5, 17, 0], seed=11, **kw)
    second = make_pq_case([5, 1, 0], [3, 0, 30], seed=12, **kw)
    assert all(first[k].shape == second[k].shape for k in ("k_codes", "tail_k"))
    return first, second


def _run_updated(first, second, scale, target_ctas):
    """A plan with room for update(), run on `first`, updated to `second`'s lengths
    with second's tables copied into first's table buffers (what a graph sees)."""
    plan = plan_pq(first, backend="triton", target_ctas=target_ctas, spare_items=3)
    st = torch.zeros(3, 16, dtype=torch.int32, device=first["q"].device)
    tt = torch.zeros_like(st)
    out = torch.full_like(first["q"], POISON)
    lse = torch.full(first["q"].shape[:2], POISON, device=first["q"].device)
    results, ptrs = [], (plan.items.data_ptr(), plan.o_part.data_ptr())
    for c in (first, second):
        if c is second:
            plan.update(c["sealed_lens"], c["tail_lens"])
        st.zero_()
        tt.zero_()
        st[:, :c["sealed_tables"].shape[1]] = c["sealed_tables"].clamp_min(0)
        tt[:, :c["tail_tables"].shape[1]] = c["tail_tables"].clamp_min(0)
        plan.run_pq(c["q"], c["k_codes"], c["v_codes"], c["k_codebook"], c["v_codebook"], st,
                    c["tail_k"], c["tail_v"], tt, scale, out=out, lse=lse)
        results.append((out.clone(), lse.clone()))
    assert (plan.items.data_ptr(), plan.o_part.data_ptr()) == ptrs
    return plan, results


@cpu_only
def test_plan_update_cpu():
    first, second = _update_cases("cpu", torch.float16)
    plan, results = _run_updated(first, second, 0.125, target_ctas=2)
    for c, (out, lse) in zip((first, second), results):
        ro, rl = pq_ref(c, 0.125)
        check_attn(out, lse, ro, rl, 2e-3)
    # the paged plan: same buffers, new lengths
    lens = [40, 3]
    gen = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(8, 1, 16, 64, generator=gen).half() for _ in range(2))
    q = torch.randn(2, 2, 64, generator=gen).half()
    plan = plan_paged([5, 5], q, kc, target_ctas=2, spare_items=2)
    plan.update(lens)
    tables = torch.tensor([[0, 1, 2], [5, 0, 0]], dtype=torch.int32)
    out, lse = plan.run_paged(q, kc, vc, tables, 0.125)
    ro, rl = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), tables,
                                        torch.tensor(lens), 0.125)
    check_attn(out, lse, ro, rl, 2e-3)


@cpu_only
def test_plan_update_errors():
    kw = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16, tail_block_size=16,
              device="cpu", dtype=torch.float16, backend="triton")
    plan = kernels.plan_decode("pq", [16], [5], spare_items=1, **kw)
    with pytest.raises(ValueError, match="batch of 1"):
        plan.update([16, 16], [1, 1])
    with pytest.raises(ValueError, match="sealed_lens"):
        plan.update([15], [1])
    tight = kernels.plan_decode("pq", [0, 0], [5, 5], spare_items=0, **kw)
    with pytest.raises(ValueError, match="room for"):     # tails > 4096 split: 8 items > 4
        tight.update([16, 16], [9000, 9000])
    tight.update([16, 16], [5, 5])                         # 4 items fit


@cpu_only
@pytest.mark.parametrize("dsub,dtype", [(2, torch.float16), (4, torch.float32)])
def test_pq_encode_cpu(dsub, dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 2, 64, generator=gen).to(dtype)
    cb = torch.randn(2, 64 // dsub, 256, dsub, generator=gen)
    check_encode(x, cb, torch.randperm(8 * 16, generator=gen)[:37], 16, "cpu", encode.pq_encode_to_slots)


@cpu_only
def test_gather_pq_blocks_cpu():
    c = make_pq_case([3, 2], [0, 0], 2, 2, 64, 2, 16, 16, torch.float16, "cpu")
    ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    args = (c["k_codes"], c["v_codes"], c["k_codebook"], c["v_codebook"], ids)
    for got, want in zip(dequantize.gather_pq_blocks(*args), ref.gather_pq_blocks(*args)):
        assert torch.equal(got, want)


def test_launcher_errors():
    c = make_pq_case([2], [3], 4, 2, 64, 2, 16, 16, torch.float16, "cpu")
    plan = plan_pq(c, backend="triton")
    assert isinstance(plan, triton_decode.TritonDecodePlan) and plan.item_width == 4
    good = [c[k] for k in RUN_ARGS]
    for i, name, bad in [(0, "q", c["q"][:, :2]), (1, "k_codes", c["k_codes"].int()),
                         (5, "sealed_tables", c["sealed_tables"].long()),
                         (3, "k_codebook", c["k_codebook"].float())]:
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=name):
            plan.run_pq(*args, 0.1)
    with pytest.raises(ValueError, match="num_qo_heads"):
        kernels.plan_decode("paged", [4], num_qo_heads=3, num_kv_heads=2, head_dim=64, block_size=16,
                            device="cpu", dtype=torch.float16, backend="triton")


# ------------------------------------------------------------------------------ GPU

GPU_LENS = [1, 54, 97, 1000, 4096 + 13, 32768]


# Every head_dim, bit width and dtype meets every GQA group size and every block size
# (in four pairings): the full cross product, 192 cases of one Triton compile each,
# took half of the GPU suite's time.
GPU_GROUPS = [(1, 64), (3, 32), (4, 16), (8, 32)]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,dsub", [(64, 2), (128, 2), (128, 4), (256, 2), (256, 4)])
@pytest.mark.parametrize("g,bs", GPU_GROUPS)
def test_pq_decode_gpu(dtype, d, dsub, g, bs):
    hkv = 2
    lens = GPU_LENS if (d, g, bs) == (128, 4, 16) else [1, 54, 97, 2000]
    sealed = [n // bs for n in lens]
    tails = [n % bs + (bs if i % 2 else 0) for i, n in enumerate(lens)]
    c = make_pq_case(sealed, tails, g * hkv, hkv, d, dsub, bs, 16, dtype, "cuda", seed=d + g + bs)
    out, lse = run_pq(c, d ** -0.5)
    ro, rl = pq_ref(c, d ** -0.5)
    check_attn(out, lse, ro, rl, 1e-2 if dtype == torch.bfloat16 else 2e-3)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g,bs", GPU_GROUPS)
def test_paged_decode_gpu(dtype, d, g, bs):
    hkv = 2
    lens = GPU_LENS if (d, g, bs) == (128, 4, 16) else [1, 54, 97, 2000, 0]
    gen = torch.Generator().manual_seed(d + g + bs)
    nb = sum((n + bs - 1) // bs for n in lens) + 1
    kc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    vc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), g * hkv, d, generator=gen).to(dtype)
    tables = make_tables(lens, bs, nb, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out, lse = run_paged(q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(), lens_t, d ** -0.5)
    ro, rl = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), tables, lens_t,
                                        d ** -0.5)
    check_attn(out, lse, ro, rl, 1e-2 if dtype == torch.bfloat16 else 2e-3)


@gpu
@pytest.mark.parametrize("d,dsub", [(64, 2), (128, 2), (128, 4), (256, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pq_encode_gpu(d, dsub, dtype):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(1000, 4, d, generator=gen).to(dtype)
    cb = torch.randn(4, d // dsub, 256, dsub, generator=gen)
    check_encode(x, cb, torch.randperm(100 * 16, generator=gen)[:1000], 16, "cuda", encode.pq_encode_to_slots)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dsub", [2, 4])
def test_gather_and_router_gpu(dtype, dsub):
    c = make_pq_case([30, 7], [40, 3], 8, 2, 128, dsub, 16, 16, dtype, "cuda")
    ids = torch.tensor([5, 0, 17, 36], dtype=torch.int32, device="cuda")
    args = (c["k_codes"], c["v_codes"], c["k_codebook"], c["v_codebook"], ids)
    for got, want in zip(kernels.gather_pq_blocks(*args),
                         ref.gather_pq_blocks(*[a.cpu() for a in args])):
        assert torch.equal(got.cpu(), want)
    out, lse = kernels.pq_decode_attention(**c, scale=0.09)
    ro, rl = pq_ref(c, 0.09)
    check_attn(out, lse, ro, rl, 1e-2 if dtype == torch.bfloat16 else 2e-3)


@gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_plan_update_graph_gpu(backend):
    from kvstore.kernels.cuda import build
    if backend == "cuda" and not build.available():
        pytest.skip("cupy missing")
    first, second = _update_cases("cuda", torch.float16)
    plan = plan_pq(first, backend=backend, spare_items=3)
    st = torch.zeros(3, 16, dtype=torch.int32, device="cuda")
    tt = torch.zeros_like(st)
    bufs = {k: first[k].clone() for k in ("q", "k_codes", "v_codes", "k_codebook", "v_codebook",
                                         "tail_k", "tail_v")}
    out = torch.empty_like(first["q"])
    lse = torch.empty(first["q"].shape[:2], device="cuda")
    # The codebooks change between steps here: their image (the CUDA plan's bulk-copy
    # staging) is rebuilt in place by its owner, as the engine does, so the graph reads it.
    words = kernels.codebook_images(first["k_codebook"][None], first["v_codebook"][None], 4)
    img = None if words is None else kernels.layer_images(words, 4, 2)[0]

    def load(c):
        for k, v in bufs.items():
            v.copy_(c[k])
        if words is not None:
            kernels.codebook_images(bufs["k_codebook"][None], bufs["v_codebook"][None], 4, words)
        st.zero_()
        tt.zero_()
        st[:, :c["sealed_tables"].shape[1]] = c["sealed_tables"].clamp_min(0)
        tt[:, :c["tail_tables"].shape[1]] = c["tail_tables"].clamp_min(0)

    def attend():
        plan.run_pq(bufs["q"], bufs["k_codes"], bufs["v_codes"], bufs["k_codebook"],
                    bufs["v_codebook"], st, bufs["tail_k"], bufs["tail_v"], tt, 0.125,
                    out=out, lse=lse, codebook_image=img)
    load(first)
    attend()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        attend()
    for c in (second, first):
        load(c)
        plan.update(c["sealed_lens"], c["tail_lens"])
        out.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        ro, rl = pq_ref(c, 0.125)
        check_attn(out, lse, ro, rl, 4e-3)


def _write_case(device, dtype):
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(5, 3, 64, generator=gen).to(dtype)
    v = torch.randn(5, 3, 64, generator=gen).to(dtype)
    kc = torch.zeros(4, 3, 16, 64, dtype=dtype)
    slots = torch.tensor([2, 0, 3, 2, 1]) * 16 + torch.tensor([0, 15, 7, 1, 9])
    return [t.to(device) for t in (k, v, kc, kc.clone(), slots)]


def _check_write(device, dtype):
    k, v, kc, vc, slots = _write_case(device, dtype)
    slot_write.write_slots(k, v, kc, vc, slots)
    wk, wv = (t.cpu().clone() for t in (kc, vc))
    rk, rv, rkc, rvc, rs = _write_case("cpu", dtype)
    ref.write_slots(rk, rv, rkc, rvc, rs)
    assert torch.equal(wk, rkc) and torch.equal(wv, rvc)
    assert torch.equal(rkc[2, :, 1], rk[3]) and torch.equal(rvc[0, :, 15], rv[1])
    assert int((rkc != 0).any(-1).sum()) == 5 * 3          # nothing else written
    with pytest.raises(ValueError, match="slots"):
        slot_write.write_slots(k, v, kc, vc, slots[:4])
    with pytest.raises(ValueError, match="k_cache"):
        slot_write.write_slots(k, v, kc[:, :2], vc, slots)


@cpu_only
def test_write_slots_cpu():
    _check_write("cpu", torch.float16)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_slots_gpu(dtype):
    _check_write("cuda", dtype)
