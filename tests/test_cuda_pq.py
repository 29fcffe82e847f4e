"""CUDA C++ PQ kernels (kernels/cuda_pq.py) vs kernels/reference.py in fp64.

GPU only (`pytest -m gpu tests/test_cuda_pq.py`); skipped where CUDA or cupy is missing.
Outputs are poisoned with NaN before every run.
"""
import pytest
import torch

from kvstore.kernels import cuda_pq
from kvstore.kernels import decode_attention as da
from kvstore.kernels import dispatch
from kvstore.kernels import reference as ref

HAS = torch.cuda.is_available() and cuda_pq.available()


def gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS, reason="needs CUDA + cupy")(f))


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tables(lens, bs, pool, gen):
    nblk = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(pool, generator=gen)
    t = torch.full((len(lens), max(nblk + [1])), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        t[b, :n] = perm[i:i + n]
        i += n
    return t


def make_case(lens, hq, hkv, d, dsub, bs, tbs, dtype, seed):
    """Each total length L -> sealed = whole blocks of L minus a tail of L % bs (+ bs)."""
    gen = torch.Generator().manual_seed(seed)
    m = d // dsub
    sealed, tails = [], []
    for i, n in enumerate(lens):
        t = n % bs + (bs if (i % 2 and n >= bs) else 0)
        sealed.append((n - t) // bs)
        tails.append(t)
    nb = sum(sealed) + 2
    nt = sum((t + tbs - 1) // tbs for t in tails) + 2
    c = dict(
        q=torch.randn(len(lens), hq, d, generator=gen).to(dtype),
        k_codes=torch.randint(0, 256, (nb, hkv, bs, m), generator=gen, dtype=torch.uint8),
        v_codes=torch.randint(0, 256, (nb, hkv, m, bs), generator=gen, dtype=torch.uint8),
        k_codebook=torch.randn(hkv, m, 256, dsub, generator=gen).to(dtype),
        v_codebook=torch.randn(hkv, m, 256, dsub, generator=gen).to(dtype),
        sealed_tables=_tables([n * bs for n in sealed], bs, nb, gen),
        sealed_lens=torch.tensor([n * bs for n in sealed], dtype=torch.int32),
        tail_k=torch.randn(nt, hkv, tbs, d, generator=gen).to(dtype),
        tail_v=torch.randn(nt, hkv, tbs, d, generator=gen).to(dtype),
        tail_tables=_tables(tails, tbs, nt, gen),
        tail_lens=torch.tensor(tails, dtype=torch.int32))
    return {k: v.cuda() for k, v in c.items()}


def pq_ref(c, scale):
    c64 = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) for k, v in c.items()}
    return ref.pq_decode_attention(**c64, scale=scale)


def image(c):
    """The case's codebook image as an owner builds it (None where no kernel reads one)."""
    words = cuda_pq.codebook_images(c["k_codebook"][None], c["v_codebook"][None], c["q"].shape[1])
    if words is None:
        return None
    dsub = c["k_codebook"].shape[-1]
    return cuda_pq.CodebookImage(words[0], cuda_pq.image_layout(c["q"].shape[1], c["k_codes"].shape[1], dsub))


def run(c, scale, target_ctas=None, backend="cuda", conflict_free=True):
    plan = da.plan_pq_decode(c["sealed_lens"], c["tail_lens"], num_qo_heads=c["q"].shape[1],
                             num_kv_heads=c["k_codes"].shape[1], head_dim=c["q"].shape[2],
                             block_size=c["k_codes"].shape[2],
                             tail_block_size=c["tail_k"].shape[2], device="cuda",
                             target_ctas=target_ctas, backend=backend)
    if isinstance(plan, cuda_pq.CudaPQPlan):
        plan.conflict_free = conflict_free
    out = torch.full_like(c["q"], float("nan"))
    lse = torch.full(c["q"].shape[:2], float("nan"), device="cuda")
    plan.run_pq(c["q"], c["k_codes"], c["v_codes"], c["k_codebook"], c["v_codebook"],
                c["sealed_tables"], c["tail_k"], c["tail_v"], c["tail_tables"], scale,
                out=out, lse=lse, codebook_image=image(c))
    return plan, out, lse


def check(out, lse, ro, rl, tol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten output"
    err = _rel(out.cpu(), ro)
    assert err < tol, err
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    if fin.any():
        assert (lse.cpu().double()[fin] - rl[fin]).abs().max().item() < 10 * tol


CASES = [(g, d, dsub, bs, dt) for g in (1, 3, 4, 8) for d in (64, 128) for dsub in (2, 4)
         for bs in (16, 32) for dt in (torch.float16, torch.bfloat16)
         if dt == torch.float16 or (bs == 16 and d == 128)]
# block sizes 64 (BS_POW2 instantiation) and 48 (a multiple of 16 but no power of two: the
# generic instantiation, unsigned division)
CASES += [(4, 128, 2, 48, torch.float16), (4, 128, 2, 64, torch.float16),
          (1, 64, 2, 48, torch.bfloat16), (8, 64, 4, 48, torch.float16),
          (3, 128, 4, 64, torch.bfloat16), (8, 128, 2, 48, torch.float16)]


@gpu
@pytest.mark.parametrize("g,d,dsub,bs,dtype", CASES)
def test_pq_decode_cuda(g, d, dsub, bs, dtype):
    hkv = 2
    lens = [1, 54, 97, 1000, 0, 33]
    if g == 4 or (g == 8 and d == 128 and dsub == 2):
        lens.append(32768)
    c = make_case(lens, g * hkv, hkv, d, dsub, bs, 16, dtype, seed=g * 100 + d + dsub + bs)
    tol = 4e-3 if dtype == torch.float16 else 2.5e-2
    ro, rl = pq_ref(c, d ** -0.5)
    for ctas in (None, 4 * hkv):
        # both gather layouts; CF with the codebooks as bulk copies of the image and staged
        # through registers
        for cf, tma in ([(True, True), (True, False), (False, False)] if dsub == 2 else [(False, False)]):
            cuda_pq.TMA = tma
            try:
                plan, out, lse = run(c, d ** -0.5, target_ctas=ctas, conflict_free=cf)
            finally:
                cuda_pq.TMA = True
            assert isinstance(plan, cuda_pq.CudaPQPlan)
            check(out, lse, ro, rl, tol)


@gpu
@pytest.mark.parametrize("dsub", [2, 4])
def test_pq_decode_cuda_bs_pow2_matches_generic(dsub):
    # the BS_POW2 instantiation (shifts) and the generic one (division) at the same power-of-two
    # block size: the same arithmetic, so bit-identical results
    c = make_case([1, 54, 1000, 33, 32768], 16, 4, 128, dsub, 32, 16, torch.float16, seed=11 + dsub)
    ro, rl = pq_ref(c, 128 ** -0.5)
    for cf, tma in ([(True, True), (True, False), (False, False)] if dsub == 2 else [(False, False)]):
        res = []
        for pow2 in (True, False):
            cuda_pq.TMA, cuda_pq.BS_POW2 = tma, pow2
            try:
                plan, out, lse = run(c, 128 ** -0.5, conflict_free=cf)
                assert plan._bs_pow2() == pow2
            finally:
                cuda_pq.TMA, cuda_pq.BS_POW2 = True, True
            check(out, lse, ro, rl, 4e-3)
            res.append((out, lse))
        assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_attn_variant_names():
    # CPU: the launcher's instantiation key: BS_POW2 for power-of-two block sizes only
    assert [cuda_pq._pow2(n) for n in (16, 32, 48, 64, 80, 128)] == [True, True, False, True, False, True]
    assert [cuda_pq._log2_or_neg(n) for n in (16, 48, 64)] == [4, -1, 6]
    assert cuda_pq._attn_name(128, 2, False, 12, 4, True, True) == "pq_attn<128, 2, false, 12, 4, true, true>"
    assert cuda_pq._attn_name(64, 4, True, 8, 0, False, False) == "pq_attn<64, 4, true, 8, 0, false, false>"


def test_wave_chunk_fills_the_last_wave():
    # CPU: a plan past one wave of blocks cuts sequences so the waves come out full
    eq, sms = cuda_pq._tail_eq(12), 132

    def blocks(batch, chunk):
        sl, tl_ = [32768 - 144] * batch, [144] * batch
        return len(cuda_pq._items(sl, tl_, chunk, eq)[0]) // 5 * 8

    def waves_cost(batch):
        total = batch * (32768 - 144 + eq)
        w = cuda_pq._wave_chunk(total, batch, 8, sms, 192)
        n = blocks(batch, w) if w else batch * 8
        return w, n, -(-n // sms) * (total / (n // 8) + cuda_pq.ITEM_OVERHEAD_TOKENS)
    for batch in (32, 64, 66):                 # whole waves already: one item per sequence
        assert waves_cost(batch)[0] is None
    w, n, cost = waves_cost(69)                # 552 blocks = 5 waves of 32K; 3 items each: 13 of 11K
    assert n == 69 * 3 * 8 and cost < 0.95 * 5 * (32768 + cuda_pq.ITEM_OVERHEAD_TOKENS)
    w, n, _ = waves_cost(17)                   # 136 blocks: 4 of them a second wave of 32K each
    assert n >= 17 * 4 * 8 and w >= 192


def test_codebook_staging_follows_item_length():
    # CPU: plans of short items (B=1 at 32K: 16 items a sequence) keep the bulk copies, plans
    # of long ones (B=32 at 32K: one item a sequence) stage through registers; update() moves
    # the choice with the lengths
    def plan(b, n):
        return cuda_pq.plan_pq_decode([n] * b, [100] * b, num_qo_heads=32, num_kv_heads=8,
                                      head_dim=128, block_size=16, tail_block_size=128,
                                      device="cpu", target_ctas=132, spare_items=64)
    short, long_ = plan(1, 32768), plan(32, 32768)
    assert short.item_tokens <= cuda_pq.TMA_MAX_ITEM_TOKENS < long_.item_tokens
    assert long_.item_tokens == 32768
    long_.update([2048] * 32, [100] * 32)
    assert long_.item_tokens == 2048


@gpu
def test_pq_decode_cuda_long_items_stage_through_registers():
    # past TMA_MAX_ITEM_TOKENS (0 here: every plan) the register-staging build runs even
    # with an image given; both fill the same shared memory, so the results are bit-identical
    c = make_case([3000, 54, 2900], 16, 4, 128, 2, 16, 16, torch.float16, seed=21)
    ro, rl = pq_ref(c, 128 ** -0.5)
    res = []
    for limit in (1 << 40, 0):
        cuda_pq.TMA_MAX_ITEM_TOKENS = limit
        try:
            plan, out, lse = run(c, 128 ** -0.5, target_ctas=8)
        finally:
            cuda_pq.TMA_MAX_ITEM_TOKENS = 16384
        assert plan.item_tokens > 0
        assert [key[1][5] for key in plan._fns if key[0] == "attn"] == [limit > 0]
        check(out, lse, ro, rl, 4e-3)
        res.append((out, lse))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


@gpu
def test_pq_decode_cuda_many_waves():
    # more sequences x KV heads than SMs: the plan cuts them for full waves; still exact
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [1500 + 37 * i for i in range(sms // 8 + 3)]
    c = make_case(lens, 32, 8, 128, 2, 16, 16, torch.float16, seed=5)
    ro, rl = pq_ref(c, 128 ** -0.5)
    plan, out, lse = run(c, 128 ** -0.5)
    assert plan.items.shape[0] > len(lens)
    check(out, lse, ro, rl, 4e-3)


@gpu
def test_pq_decode_cuda_graph_and_reuse():
    c = make_case([300, 4000, 17], 32, 8, 128, 2, 16, 16, torch.float16, seed=7)
    plan = da.plan_pq_decode(c["sealed_lens"], c["tail_lens"], num_qo_heads=32, num_kv_heads=8,
                             head_dim=128, block_size=16, tail_block_size=16, device="cuda")
    assert isinstance(plan, cuda_pq.CudaPQPlan)
    out = torch.full_like(c["q"], float("nan"))
    lse = torch.full(c["q"].shape[:2], float("nan"), device="cuda")
    args = [c[k] for k in ("q", "k_codes", "v_codes", "k_codebook", "v_codebook",
                           "sealed_tables", "tail_k", "tail_v", "tail_tables")]
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
    check(out, lse, ro, rl, 4e-3)


@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_pq_decode_cuda_graph_reads_codebooks_and_image_in_place(d):
    # A graph captured with an image reads the image's memory at every replay: its owner
    # rebuilds it in place when the codebooks change (codebook_images(words=...)), and the
    # replay follows. Without an image the graph holds the register-staging build.
    c = make_case([300, 4000, 17], 24, 8, d, 2, 16, 16, torch.float16, seed=8)
    plan = da.plan_pq_decode(c["sealed_lens"], c["tail_lens"], num_qo_heads=24, num_kv_heads=8,
                             head_dim=d, block_size=16, tail_block_size=16, device="cuda")
    plan.warm()
    img = image(c)
    assert img is None or img.words.shape == (8, cuda_pq.IMG_WORDS)
    args = [c[k] for k in ("q", "k_codes", "v_codes", "k_codebook", "v_codebook",
                           "sealed_tables", "tail_k", "tail_v", "tail_tables")]
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
                assert cuda_pq.codebook_images(c["k_codebook"][None], c["v_codebook"][None], 24,
                                               words).data_ptr() == words.data_ptr()
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            ro, rl = pq_ref(c, 0.088)
            check(out, lse, ro, rl, 4e-3)


@pytest.mark.parametrize("m,vg", [(64, 4), (64, 2), (64, 0), (32, 2), (32, 0)])
def test_codebook_image_layout(m, vg):
    # CPU: the image holds each word where cuda_pq.cu's gathers read it. K subspace
    # cq*MQ + 8hh + i at byte code*256 + 128hh + 16i + 4cq; V subspace (m-tile X, row gq)
    # at 65536 + code*256 + 4m (VG) or 65536 + X*8192 + code*32 + 4gq (GP 8)
    gen = torch.Generator().manual_seed(m + vg)
    kcb = torch.randn(2, m, 256, 2, generator=gen).half()
    vcb = torch.randn(2, m, 256, 2, generator=gen).half()
    img = cuda_pq.build_codebook_image(kcb, vcb, vg).view(torch.uint8).reshape(2, -1)
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


@gpu
def test_pq_decode_cuda_fallbacks():
    # fp32 q and a codebook dtype != q dtype go to the Triton kernels through the plan
    c = make_case([100, 37], 8, 2, 64, 2, 16, 16, torch.float16, seed=3)
    c32 = dict(c, q=c["q"].float(), tail_k=c["tail_k"].float(), tail_v=c["tail_v"].float())
    plan, out, lse = run(c32, 0.125)
    ro, rl = pq_ref(c32, 0.125)
    check(out, lse, ro, rl, 4e-3)
    out, lse = dispatch.pq_decode_attention(*[c[k] for k in (
        "q", "k_codes", "v_codes", "k_codebook", "v_codebook", "sealed_tables", "sealed_lens",
        "tail_k", "tail_v", "tail_tables", "tail_lens")], 0.125)
    ro, rl = pq_ref(c, 0.125)
    check(out, lse, ro, rl, 4e-3)


def _check_encode(x, cb, slots, bs):
    nb, (n, hkv, d), m = 1 + int(slots.max()) // bs, x.shape, cb.shape[1]
    for kind, shape in (("k_codes", (nb, hkv, bs, m)), ("v_codes", (nb, hkv, m, bs))):
        got = torch.full(shape, 7, dtype=torch.uint8, device="cuda")
        want = got.cpu().clone()
        dispatch.pq_encode_to_slots(x.cuda(), cb.cuda(), slots.cuda(), **{kind: got})
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


@gpu
@pytest.mark.parametrize("d,dsub,dtype,sdt", [(128, 2, torch.float16, torch.int64),
                                              (64, 2, torch.bfloat16, torch.int32),
                                              (128, 4, torch.float32, torch.int64),
                                              (64, 4, torch.float16, torch.int32)])
def test_pq_encode_cuda(d, dsub, dtype, sdt):
    gen = torch.Generator().manual_seed(d + dsub)
    n, hkv, bs = 1000, 2, 16
    x = torch.randn(n, hkv, d, generator=gen).to(dtype)
    cb = torch.randn(hkv, d // dsub, 256, dsub, generator=gen)
    assert cuda_pq.encode_supported(cb.cuda())
    slots = torch.randperm(70 * bs, generator=gen)[:n].to(sdt)
    _check_encode(x, cb, slots, bs)


def _encode_cells_exact(x, cb, slots, bs, plan):
    """plan (cell kernel) vs reference.pq_encode_to_slots, both code layouts: identical."""
    nb, hkv, m = 1 + int(slots.max()) // bs, x.shape[1], cb.shape[1]
    for kind, shape in (("k_codes", (nb, hkv, bs, m)), ("v_codes", (nb, hkv, m, bs))):
        got = torch.full(shape, 7, dtype=torch.uint8, device="cuda")
        want = got.cpu().clone()
        plan.run(x.cuda(), slots.cuda(), **{kind: got})
        ref.pq_encode_to_slots(x, cb, slots, **{kind: want})
        bad = (got.cpu() != want).sum().item()
        print(f"{kind} x {x.dtype} n={x.shape[0]}: {bad} of {want.numel()} codes differ")
        assert bad == 0


@gpu
@pytest.mark.parametrize("d,dtype,sdt,n", [(128, torch.float16, torch.int64, 4097),
                                           (128, torch.bfloat16, torch.int32, 1001),
                                           (128, torch.float32, torch.int64, 63),
                                           (64, torch.float16, torch.int32, 1),
                                           (64, torch.bfloat16, torch.int64, 2999)])
def test_pq_encode_cells_cuda(d, dtype, sdt, n):
    gen = torch.Generator().manual_seed(d + n)
    hkv, bs = 3, 16
    x = torch.randn(n, hkv, d, generator=gen).to(dtype)
    x[: max(1, n // 50)] *= 8                                   # points outside the grid
    cb = torch.randn(hkv, d // 2, 256, 2, generator=gen)
    cb_dev = (cb.half() if dtype == torch.float16 else cb).cuda()   # engine: compute dtype
    cb = cb_dev.cpu()
    slots = torch.randperm(_ceil(n, bs) * bs + 5 * bs, generator=gen)[:n].to(sdt)
    for tpb in (0, 64):                                         # default split, many blocks
        plan = cuda_pq.plan_pq_encode(cb_dev, tokens_per_block=tpb)
        assert plan.cells is not None
        _encode_cells_exact(x, cb, slots, bs, plan)


def _ceil(a, b):
    return -(-a // b)


@gpu
def test_pq_encode_cells_cuda_ties_and_degenerate():
    # integer lattice centroids + half-integer points: exact 2- and 4-way ties; a line,
    # a single repeated point and duplicated centroids; points far outside
    gen = torch.Generator().manual_seed(5)
    ax = torch.arange(16, dtype=torch.float32)
    lat = torch.stack(torch.meshgrid(ax, ax, indexing="ij"), -1).reshape(256, 2)
    line = torch.stack([torch.linspace(-2, 2, 256), torch.full((256,), 0.7)], -1)
    same = torch.full((256, 2), 0.3)
    dup = torch.randn(128, 2, generator=gen).repeat(2, 1)
    cb = torch.stack([lat] * 12 + [line, same, dup, lat * 0.25 - 1]).reshape(1, 16, 256, 2)
    n = 5000
    x = torch.randint(-6, 40, (n, 1, 32), generator=gen).float() / 2
    x[:, :, 24:30] = torch.randn(n, 1, 6, generator=gen) * 2
    x[:, :, 30:] = x[:, :, 30:] * 0.25 - 1
    x[:200] *= 100
    plan = cuda_pq.plan_pq_encode(cb.cuda())
    slots = torch.arange(n, dtype=torch.int64)
    for dt in (torch.float32, torch.float16):
        _encode_cells_exact(x.to(dt), cb, slots, 16, plan)
    # the torch table encoder gives the same codes on this data
    from kvstore.kernels import pq_cells
    assert torch.equal(pq_cells.plan_cells(cb).encode(x), ref.pq_encode(x, cb))


@gpu
def test_pq_encode_cells_cuda_fallback_misaligned():
    # x whose rows are not 16 B aligned goes to the brute-force kernel through the same plan
    gen = torch.Generator().manual_seed(2)
    full = torch.randn(300, 2, 130, generator=gen).half()
    x, xg = full[:, :, 1:129], full.cuda()[:, :, 1:129]        # slice on the device: strided
    cb = torch.randn(2, 64, 256, 2, generator=gen)
    assert not cuda_pq._cells_aligned(xg)
    slots = torch.randperm(400, generator=gen)[:300]
    _check_encode(x.contiguous(), cb, slots, 16)                # dispatch: cells
    plan = cuda_pq.plan_pq_encode(cb.cuda())
    got = torch.full((25, 2, 16, 64), 7, dtype=torch.uint8, device="cuda")
    plan.run(xg, slots.cuda(), k_codes=got)
    want = torch.full((25, 2, 16, 64), 7, dtype=torch.uint8)
    ref.pq_encode_to_slots(x, cb, slots, k_codes=want)
    assert (got.cpu() != want).float().mean().item() < 0.01
