"""CUDA C++ PQ decode attention (kernels/cuda/) vs kernels/reference.py in fp64.

GPU tests (`pytest -m gpu tests/kernels`) skip where CUDA or cupy is missing; the CPU
ones check the partition, the instantiation names and the codebook image layout.
Outputs are poisoned with NaN before every run (kernel_cases.run_pq).
"""
import pytest
import torch
from kernel_cases import (HAS_CUDA, RUN_ARGS, check_attn, make_pq_case, plan_pq, pq_ref, run_pq,
                          split_lens)

from kvstore import kernels
from kvstore.kernels import tunables
from kvstore.kernels.cuda import attention as cuda_attention
from kvstore.kernels.cuda import build, images
from kvstore.kernels.triton import decode as triton_decode

HAS = HAS_CUDA and build.available()


def gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS, reason="needs CUDA + cupy")(f))


def make_case(lens, hq, hkv, d, dsub, bs, tbs, dtype, seed):
    """Total lengths -> a CUDA case (kernel_cases.split_lens)."""
    return make_pq_case(*split_lens(lens, bs), hq, hkv, d, dsub, bs, tbs, dtype, "cuda", seed)


def image(c):
    """The case's codebook image as an owner builds it (None where no kernel reads one)."""
    words = kernels.codebook_images(c["k_codebook"][None], c["v_codebook"][None], c["q"].shape[1])
    if words is None:
        return None
    return kernels.layer_images(words, c["q"].shape[1], c["k_codebook"].shape[-1])[0]


def run(c, scale, target_ctas=None, with_image=True):
    plan = plan_pq(c, backend="cuda", target_ctas=target_ctas)
    out, lse = run_pq(plan, c, scale, codebook_image=image(c) if with_image else None)
    return plan, out, lse


CASES = [(g, d, dsub, bs, dt) for g in (1, 3, 4, 8) for d in (64, 128) for dsub in (2, 4)
         for bs in (16, 32) for dt in (torch.float16, torch.bfloat16)
         if dt == torch.float16 or (bs == 16 and d == 128)]
# the config's larger block sizes (64, 128): other shifts and masks for a token's block
CASES += [(4, 128, 2, 128, torch.float16), (4, 128, 2, 64, torch.float16),
          (1, 64, 2, 128, torch.bfloat16), (8, 64, 4, 128, torch.float16),
          (3, 128, 4, 64, torch.bfloat16), (8, 128, 2, 128, torch.float16)]
# dsub 4: each GP with fewer query heads than its rows hold (padded heads, GP 8 at d 64)
CASES += [(2, 128, 4, 16, torch.bfloat16), (6, 64, 4, 16, torch.float16), (5, 128, 4, 32, torch.float16)]
# d 256 (sm_90: two CTAs of a cluster exchange partial scores): every GP, both dsub and dtypes
CASES += [(4, 256, 2, 16, torch.float16), (4, 256, 4, 16, torch.bfloat16), (1, 256, 2, 32, torch.bfloat16),
          (8, 256, 4, 16, torch.float16), (3, 256, 2, 64, torch.float16), (6, 256, 4, 16, torch.float16),
          (8, 256, 2, 16, torch.bfloat16), (2, 256, 4, 128, torch.float16)]


@gpu
@pytest.mark.parametrize("g,d,dsub,bs,dtype", CASES)
def test_pq_decode_cuda(g, d, dsub, bs, dtype):
    if d == 256 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("head_dim 256 runs as thread block clusters: sm_90+")
    hkv = 2
    lens = [1, 54, 97, 1000, 0, 33]
    if g == 4 or (g == 8 and d >= 128):
        lens.append(32768)
    c = make_case(lens, g * hkv, hkv, d, dsub, bs, 16, dtype, seed=g * 100 + d + dsub + bs)
    tol = 4e-3 if dtype == torch.float16 else 2.5e-2
    ro, rl = pq_ref(c, d ** -0.5)
    for ctas in (None, 4 * hkv):
        # the codebooks as bulk copies of the image (sm_90) and staged through registers
        for with_image in (True, False):
            plan, out, lse = run(c, d ** -0.5, target_ctas=ctas, with_image=with_image)
            assert isinstance(plan, cuda_attention.CudaPQPlan)
            check_attn(out, lse, ro, rl, tol)


def test_attn_variant_names():
    # CPU: the launcher's instantiation keys, as attention.cu declares pq_attn / pq_merge
    assert cuda_attention._attn_name(128, 2, False, 12, 4, True, False, False) == \
        "pq_attn<128, 2, false, 12, 4, true, false, false>"
    assert cuda_attention._attn_name(64, 4, True, 8, 8, False, True, True) == \
        "pq_attn<64, 4, true, 8, 8, false, true, true>"
    assert cuda_attention._merge_name(64, True) == "pq_merge<64, true>"
    # two tiles a step (attention.cu PAIR): a trailing template argument, the default one unnamed
    assert cuda_attention._attn_name(128, 4, False, 12, 4, True, False, False, 2) == \
        "pq_attn<128, 4, false, 12, 4, true, false, false, 2>"
    assert cuda_attention._attn_name(256, 4, False, 12, 4, False, False, True, 2) == \
        "pq_attn_split<256, 4, false, 12, 4, false, true, 2>"
    # d 256: the cluster build; two CTAs of d 128's tables, a shorter ring past 8 warps
    # and the score exchange, within the 227 KiB a block may have. Its bulk-copy build
    # names every trailing argument
    assert cuda_attention._attn_name(256, 2, True, 12, 4, False, True, False) == \
        "pq_attn_split<256, 2, true, 12, 4, true, false>"
    assert cuda_attention._attn_name(256, 2, True, 12, 4, True, True, False) == \
        "pq_attn_split<256, 2, true, 12, 4, true, false, 1, false, true>"
    assert [cuda_attention.split(d) for d in (64, 128, 256)] == [1, 1, 2]
    for nw in (4, 8, 12, 16):
        assert cuda_attention._attn_smem(256, 2, 4, nw) <= 227 * 1024
    assert cuda_attention._attn_smem(256, 2, 4, 12) == 131072 + 12 * 3 * 2048 + 16 + 12 * 1040
    assert [images.group(g, 2) for g in (1, 2, 3, 4, 5, 8)] == [2, 2, 4, 4, 8, 8]
    assert [images.group(g, 4) for g in (1, 3, 8)] == [2, 4, 8]
    assert images.image_layout(32, 8, 2) == 4 and images.image_layout(32, 4, 2) == 0
    assert images.image_layout(32, 8, 4) == images.image_layout(8, 8, 4) == images.DSUB4
    # dsub 4's tables end at shared-window address 192 KiB, whatever the ring
    assert cuda_attention._attn_smem(128, 4, 4, 16, True) == cuda_attention._attn_smem(64, 4, 8, 8) == 196608


def test_sources_inline_their_headers_once():
    # CPU: NVRTC gets one self-contained text (cupy's cache key): every local include
    # inlined, common.cuh once although attention.cu reaches it twice
    for name in ("attention.cu", "merge.cu", "encode.cu"):
        src = build.source(name)
        assert '#include "' not in src
        assert src.count("__device__ __forceinline__ void mma16816(") == 1
    src = build.source("attention.cu")
    assert src.count("struct RegBatches {") == 1 and src.count("struct Cf4Map {") == 1
    assert "pq_attn(" in src and "pq_merge(" not in src


def test_wave_chunk_fills_the_last_wave():
    # CPU: a plan past one wave of blocks cuts sequences so the waves come out full
    eq, sms = cuda_attention._tail_eq(12), 132

    def blocks(batch, chunk):
        sl, tl_ = [32768 - 144] * batch, [144] * batch
        return len(cuda_attention._items(sl, tl_, chunk, eq)[0]) // 5 * 8

    def waves_cost(batch):
        total = batch * (32768 - 144 + eq)
        w = cuda_attention._wave_chunk(total, batch, 8, sms, 192)
        n = blocks(batch, w) if w else batch * 8
        return w, n, -(-n // sms) * (total / (n // 8) + cuda_attention.ITEM_OVERHEAD_TOKENS)
    for batch in (32, 64, 66):                 # whole waves already: one item per sequence
        assert waves_cost(batch)[0] is None
    w, n, cost = waves_cost(69)                # 552 blocks = 5 waves of 32K; 3 items each: 13 of 11K
    assert n == 69 * 3 * 8 and cost < 0.95 * 5 * (32768 + cuda_attention.ITEM_OVERHEAD_TOKENS)
    w, n, _ = waves_cost(17)                   # 136 blocks: 4 of them a second wave of 32K each
    assert n >= 17 * 4 * 8 and w >= 192


def test_codebook_staging_follows_item_length():
    # CPU: plans of short items (B=1 at 32K: 16 items a sequence) keep the bulk copies, plans
    # of long ones (B=32 at 32K: one item a sequence) stage through registers; update() moves
    # the choice with the lengths
    def plan(b, n):
        return cuda_attention.plan_pq([n] * b, [100] * b, num_qo_heads=32, num_kv_heads=8,
                                      head_dim=128, block_size=16, tail_block_size=128,
                                      device="cpu", dtype=torch.float16, target_ctas=132, spare_items=64)
    short, long_ = plan(1, 32768), plan(32, 32768)
    assert short.item_tokens <= tunables.TMA_MAX_ITEM_TOKENS < long_.item_tokens
    assert long_.item_tokens == 32768 and long_.item_width == 5 and long_.capacity == long_.items.shape[0]
    long_.update([2048] * 32, [100] * 32)
    assert long_.item_tokens == 2048


@gpu
@pytest.mark.parametrize("dsub", [2, 4])
def test_pq_decode_cuda_long_items_stage_through_registers(monkeypatch, dsub):
    # past TMA_MAX_ITEM_TOKENS (0 here: every plan) the register-staging build runs even
    # with an image given; both fill the same shared memory, so the results are bit-identical
    c = make_case([3000, 54, 2900], 16, 4, 128, dsub, 16, 16, torch.float16, seed=21)
    ro, rl = pq_ref(c, 128 ** -0.5)
    img = image(c)
    res = []
    for limit in (1 << 40, 0):
        monkeypatch.setattr(tunables, "TMA_MAX_ITEM_TOKENS", limit)
        plan = plan_pq(c, backend="cuda", target_ctas=8)
        out, lse = run_pq(plan, c, 128 ** -0.5, codebook_image=img)
        assert plan.item_tokens > 0
        assert [key[1][5] for key in plan._fns if key[0] == "attn"] == [limit > 0 and img is not None]
        check_attn(out, lse, ro, rl, 4e-3)
        res.append((out, lse))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


@gpu
@pytest.mark.parametrize("d,g", [(64, 8), (128, 4), (128, 3), (256, 4)])
def test_pq_decode_cuda_2bit_either_step(monkeypatch, d, g):
    # 2-bit tile loop at one and two tiles a step (tunables.TILES_PER_STEP_2BIT): lengths
    # that leave warps an odd number of tiles (the second of a step masked out), both exact
    if d == 256 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("head_dim 256 runs as thread block clusters: sm_90+")
    c = make_case([16, 48, 1000, 4097, 31 * 16 + 5], 2 * g, 2, d, 4, 16, 16, torch.float16, seed=d + g)
    ro, rl = pq_ref(c, d ** -0.5)
    for step in (1, 2):
        monkeypatch.setattr(tunables, "TILES_PER_STEP_2BIT", step)
        for ctas in (None, 3):
            plan, out, lse = run(c, d ** -0.5, target_ctas=ctas)
            # a build's key: (d, dsub, bf16, warps, gp, tma, win, cap, pair, mtq)
            assert {key[1][8] for key in plan._fns if key[0] == "attn"} == {step}
            check_attn(out, lse, ro, rl, 4e-3)


@gpu
@pytest.mark.parametrize("d", [128, 256])
def test_pq_decode_cuda_many_waves(d):
    # more sequences x KV heads than SMs: the plan cuts them for full waves; still exact
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [1500 + 37 * i for i in range(sms // 8 + 3)]
    c = make_case(lens, 32, 8, d, 2, 16, 16, torch.float16, seed=5)
    ro, rl = pq_ref(c, d ** -0.5)
    plan, out, lse = run(c, d ** -0.5)
    assert plan.items.shape[0] * 8 * cuda_attention.split(d) > sms
    if d == 128:
        assert plan.items.shape[0] > len(lens)
    check_attn(out, lse, ro, rl, 4e-3)


@gpu
def test_pq_decode_cuda_graph_and_reuse():
    c = make_case([300, 4000, 17], 32, 8, 128, 2, 16, 16, torch.float16, seed=7)
    plan = plan_pq(c)
    assert isinstance(plan, cuda_attention.CudaPQPlan)
    out = torch.full_like(c["q"], float("nan"))
    lse = torch.full(c["q"].shape[:2], float("nan"), device="cuda")
    args = [c[k] for k in RUN_ARGS]
    plan.run_pq(*args, 0.088, out=out, lse=lse)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            plan.run_pq(*args, 0.088, out=out, lse=lse)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    c["q"].copy_(torch.randn_like(c["q"]))
    g.replay()
    torch.cuda.synchronize()
    ro, rl = pq_ref(c, 0.088)
    check_attn(out, lse, ro, rl, 4e-3)


@gpu
@pytest.mark.parametrize("d,dsub", [(64, 2), (128, 2), (64, 4), (128, 4), (256, 2), (256, 4)])
def test_pq_decode_cuda_graph_reads_codebooks_and_image_in_place(d, dsub):
    # A graph captured with an image reads the image's memory at every replay: its owner
    # rebuilds it in place when the codebooks change (codebook_images(words=...)), and the
    # replay follows. Without an image the graph holds the register-staging build.
    c = make_case([300, 4000, 17], 24, 8, d, dsub, 16, 16, torch.float16, seed=8)
    plan = plan_pq(c)
    plan.warm()
    img = image(c)
    assert img is None or img.words.shape == (8, images.IMG_WORDS * cuda_attention.split(d))
    args = [c[k] for k in RUN_ARGS]
    for with_image in (True, False):
        out = torch.full_like(c["q"], float("nan"))
        lse = torch.full(c["q"].shape[:2], float("nan"), device="cuda")
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                plan.run_pq(*args, 0.088, out=out, lse=lse, codebook_image=img if with_image else None)
        for scale_v in (1.0, 0.5, -0.75):
            c["v_codebook"].mul_(scale_v)            # in place, as the daemon's set_codebooks
            c["k_codebook"].mul_(1.0 / scale_v)
            if img is not None:
                words = img.words[None]
                assert kernels.codebook_images(c["k_codebook"][None], c["v_codebook"][None], 24,
                                               words).data_ptr() == words.data_ptr()
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            ro, rl = pq_ref(c, 0.088)
            check_attn(out, lse, ro, rl, 4e-3)


@pytest.mark.parametrize("m,vg", [(64, 4), (64, 2), (64, 0), (32, 2), (32, 0)])
def test_codebook_image_layout(m, vg):
    # CPU: the image holds each word where attention.cu's gathers read it. K subspace
    # cq*MQ + 8hh + i at byte code*256 + 128hh + 16i + 4cq; V subspace (m-tile X, row gq)
    # at 65536 + code*256 + 4m (VG) or 65536 + X*8192 + code*32 + 4gq (GP 8)
    gen = torch.Generator().manual_seed(m + vg)
    kcb = torch.randn(2, m, 256, 2, generator=gen).half()
    vcb = torch.randn(2, m, 256, 2, generator=gen).half()
    img = images.build_codebook_image(kcb, vcb, vg).view(torch.uint8).reshape(2, -1)
    assert img.shape[1] == 131072
    mq = m // 4
    for h in range(2):
        for code in (0, 1, 77, 255):
            for sub in range(m):
                c, r = sub // mq, sub % mq
                kb = code * 256 + 128 * (r // 8) + 16 * (r % 8) + 4 * c
                vb = 65536 + (code * 256 + 4 * sub if vg else (sub // 8) * 8192 + code * 32 + 4 * (sub % 8))
                assert torch.equal(img[h, kb:kb + 4], kcb[h, sub, code].view(torch.uint8))
                assert torch.equal(img[h, vb:vb + 4], vcb[h, sub, code].view(torch.uint8))


@pytest.mark.parametrize("dsub,layout", [(2, 4), (2, 0), (4, images.DSUB4)])
def test_codebook_image_of_a_d256_head_is_its_halves_images(dsub, layout):
    # CPU: the split build's CTA `half` of KV head h bulk-copies words [half x IMG_WORDS,
    # + IMG_WORDS) of head h's image: the image of coordinates [128 half, + 128) as a
    # d 128 head's (subspaces [half x M/2, + M/2) of the codebook)
    m = 256 // dsub
    gen = torch.Generator().manual_seed(dsub + layout)
    kcb = torch.randn(3, m, 256, dsub, generator=gen).half()
    vcb = torch.randn(3, m, 256, dsub, generator=gen).half()
    img = images.build_codebook_image(kcb, vcb, layout)
    assert img.shape == (3, 2 * images.IMG_WORDS)
    for h in range(3):
        for half in range(2):
            sub = slice(half * m // 2, (half + 1) * m // 2)
            want = images.build_codebook_image(kcb[h:h + 1, sub], vcb[h:h + 1, sub], layout)[0]
            assert torch.equal(img[h, half * images.IMG_WORDS:(half + 1) * images.IMG_WORDS], want)


@gpu
def test_what_the_cuda_kernels_do_not_take_is_planned_on_triton():
    # fp32 q, codebooks of another dtype, a misaligned q: the router plans Triton up
    # front (correct results); the one-shot entry point decides from the tensors it gets
    c = make_pq_case(*split_lens([100, 37], 16), 8, 2, 64, 2, 16, 16, torch.float16, "cuda", seed=3)
    c32 = dict(c, q=c["q"].float(), tail_k=c["tail_k"].float(), tail_v=c["tail_v"].float())
    plan = plan_pq(c32)
    assert isinstance(plan, triton_decode.TritonDecodePlan)
    check_attn(*run_pq(plan, c32, 0.125), *pq_ref(c32, 0.125), 4e-3)
    with pytest.raises(ValueError, match="backend='cuda'"):
        plan_pq(c32, backend="cuda")
    cbf = dict(c, k_codebook=c["k_codebook"].bfloat16(), v_codebook=c["v_codebook"].bfloat16())
    assert isinstance(plan_pq(cbf), triton_decode.TritonDecodePlan)
    for case in (c, c32):
        out, lse = kernels.pq_decode_attention(**case, scale=0.125)
        check_attn(out, lse, *pq_ref(case, 0.125), 4e-3)
    # q at an odd fp16 offset of its buffer: 2-byte aligned rows
    qbuf = torch.empty(c["q"].numel() + 1, dtype=torch.float16, device="cuda")
    qm = qbuf[1:].view(c["q"].shape)
    qm.copy_(c["q"])
    assert not kernels.query_aligned(qm)
    cuda_plan = plan_pq(c)
    with pytest.raises(ValueError, match="q: address or strides"):
        run_pq(cuda_plan, dict(c, q=qm), 0.125)
    plan = plan_pq(dict(c, q=qm), aligned=kernels.query_aligned(qm))
    assert isinstance(plan, triton_decode.TritonDecodePlan)
    check_attn(*run_pq(plan, dict(c, q=qm), 0.125), *pq_ref(c, 0.125), 4e-3)
    check_attn(*kernels.pq_decode_attention(**dict(c, q=qm), scale=0.125), *pq_ref(c, 0.125), 4e-3)
    with pytest.raises(ValueError, match="q must be torch.float16"):
        run_pq(cuda_plan, c32, 0.125)
