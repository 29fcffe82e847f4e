"""Multi-token queries (T new tokens per sequence, causal among them) from PQ codes and
over fp16 paged blocks: the reference against a dense causal attention over the tokens,
the Triton kernels (the interpreter on CPU, every shape and bf16 on GPU) and the CUDA C++
kernel (GPU: every GQA grouping of query tokens, graph replay) against the reference,
and the router's refusals.

Without CUDA the Triton kernels run in the interpreter, which tests/conftest.py sets up.
"""
import math

import pytest
import torch

from test_triton_kernels import HAS_CUDA, INTERPRET, cpu_only, gpu  # noqa: F401
from kernel_cases import POISON, RUN_ARGS, check_attn, make_pq_case, rel
from kernel_cases import tables as make_tables

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels.plan import MAX_QUERY_TOKENS


def multi_case(t, sealed_blocks, tails, hq, hkv, d, dsub, bs, tbs, dtype, device, seed=0):
    """make_pq_case with q [B, T, Hq, d]; the tails' last T tokens are the new ones."""
    c = make_pq_case(sealed_blocks, tails, hq, hkv, d, dsub, bs, tbs, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    c["q"] = torch.randn(len(tails), t, hq, d, generator=gen).to(dtype).to(device)
    return c


def multi_ref(c, scale, softcap=0.0):
    c64 = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) for k, v in c.items()}
    return ref.pq_multi_attention(**c64, scale=scale, softcap=softcap)


def plan_multi(c, backend="triton", **kw):
    q = c["q"]
    return kernels.plan_decode("pq", c["sealed_lens"], c["tail_lens"], num_qo_heads=q.shape[2],
                               num_kv_heads=c["k_codes"].shape[1], head_dim=q.shape[3],
                               block_size=c["k_codes"].shape[2], tail_block_size=c["tail_k"].shape[2],
                               device=q.device, dtype=q.dtype, kv_dtype=c["tail_k"].dtype,
                               codebook_dtype=c["k_codebook"].dtype, query_tokens=q.shape[1],
                               backend=backend, **kw)


def run_multi(c, scale, **kw):
    plan = plan_multi(c, **kw)
    out = torch.full_like(c["q"], POISON)
    lse = torch.full(c["q"].shape[:3], POISON, device=c["q"].device)
    return plan.run_pq(*[c[k] for k in RUN_ARGS], scale, out=out, lse=lse)


def _positional(c, b):
    """Sequence b's K/V in position order (no sinks: sealed tokens, then the tail)."""
    bs, tbs = c["k_codes"].shape[2], c["tail_k"].shape[2]
    ns, nt = int(c["sealed_lens"][b]), int(c["tail_lens"][b])
    ks, vs = ref.gather_pq_blocks(c["k_codes"].cpu(), c["v_codes"].cpu(), c["k_codebook"].cpu().double(),
                                  c["v_codebook"].cpu().double(), c["sealed_tables"][b, :ns // bs].cpu())
    kt, vt = ref.gather_fp16_blocks(c["tail_k"].cpu().double(), c["tail_v"].cpu().double(),
                                    c["tail_tables"][b, :math.ceil(nt / tbs)].cpu())
    return torch.cat([ks, kt[:nt]]), torch.cat([vs, vt[:nt]])


# ------------------------------------------------------------------ reference

def test_reference_is_causal_attention_over_positions():
    # each new token i attends to the context and new tokens <= i, nothing after
    t, hq, hkv, d = 5, 4, 2, 64
    c = multi_case(t, [3, 0], [9, 7], hq, hkv, d, 2, 16, 16, torch.float32, "cpu")
    out, lse = multi_ref(c, 0.125)
    for b in range(2):
        k, v = _positional(c, b)
        n = k.shape[0]
        qg = c["q"][b].double().view(t, hkv, hq // hkv, d)
        s = torch.einsum("thgd,nhd->thgn", qg, k) * 0.125
        mask = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]       # [t, n]
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        want = torch.einsum("thgn,nhd->thgd", torch.softmax(s, -1), v).reshape(t, hq, d)
        assert rel(out[b], want) < 1e-12
        assert torch.allclose(lse[b].double(), torch.logsumexp(s, -1).reshape(t, hq), atol=1e-10)


def test_paged_reference_matches_pq_reference_without_sealed_blocks():
    t, gen = 4, torch.Generator().manual_seed(3)
    c = multi_case(t, [0, 0], [20, 6], 4, 2, 64, 2, 16, 8, torch.float64, "cpu")
    a = ref.pq_multi_attention(**c, scale=0.1)
    b = ref.paged_multi_attention(c["q"], c["tail_k"], c["tail_v"], c["tail_tables"], c["tail_lens"], 0.1)
    assert torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])
    del gen


# ------------------------------------------------------------------ CPU (interpreter)

@cpu_only
@pytest.mark.parametrize("t,hq,hkv,d,dsub,sealed,tails,dtype", [
    (2, 4, 2, 64, 2, [2, 1], [5, 17], torch.float16),
    (5, 4, 1, 64, 4, [1, 0], [5, 9], torch.float32),
    (16, 2, 1, 64, 2, [2], [20], torch.float16),
    (40, 4, 2, 64, 2, [1, 0], [41, 57], torch.float16),      # past 64 query rows: one wide block
    (50, 3, 1, 64, 2, [2], [53], torch.float16),             # G 3: 150 rows, two wide blocks
    (40, 4, 1, 128, 4, [1], [45], torch.float32),            # 2-bit wide blocks at d 128
    (MAX_QUERY_TOKENS, 2, 1, 64, 4, [1], [MAX_QUERY_TOKENS + 3], torch.float32),
    (5, 8, 2, 128, 2, [1, 2], [6, 33], torch.float16),
    (2, 2, 1, 128, 4, [1], [2], torch.float16),
    (5, 2, 1, 256, 2, [1], [7], torch.float32),
    (2, 2, 1, 256, 4, [1], [3], torch.float16),
])
def test_pq_multi_interpreter(t, hq, hkv, d, dsub, sealed, tails, dtype):
    c = multi_case(t, sealed, tails, hq, hkv, d, dsub, 16, 16, dtype, "cpu")
    out, lse = run_multi(c, 1.0 / math.sqrt(d))
    ro, rl = multi_ref(c, 1.0 / math.sqrt(d))
    check_attn(out, lse, ro, rl, 2e-2 if dtype == torch.float16 else 2e-3)


@cpu_only
def test_wide_row_blocks_and_their_partition():
    """Past 64 query rows a KV head (d <= 128), a multi-token PQ plan's programs take 128
    rows and the partition counts its row blocks: fewer, longer items than the one-token
    partition, whose programs would each decode the same codes for fewer rows."""
    from kvstore.kernels import tunables
    from kvstore.kernels.plan import MULTI_ROWS, wide_rows
    assert wide_rows(16, 4, 1, 128) == MULTI_ROWS                        # 64 rows: one plain block
    assert wide_rows(17, 4, 1, 128) == wide_rows(128, 32, 8, 64) == tunables.MTQ_WIDE_ROWS
    assert wide_rows(128, 32, 8, 256) == wide_rows(1, 128, 1, 128) == MULTI_ROWS
    kw = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16, tail_block_size=16, device="cpu",
              dtype=torch.float16, backend="triton")
    wide = kernels.plan_decode("pq", [4096], [40], query_tokens=40, **kw)
    narrow = kernels.plan_decode("pq", [4096], [40], query_tokens=8, **kw)
    assert (wide.row_block, narrow.row_block) == (tunables.MTQ_WIDE_ROWS, MULTI_ROWS)
    assert wide.items.shape[0] < narrow.items.shape[0]


@cpu_only
@pytest.mark.parametrize("t", [1, 40])
def test_trusted_run_skips_only_the_checks(t):
    # the engine's trusted call: the same numbers, out / lse allocated in the same shapes
    c = multi_case(max(t, 2), [2, 1], [t + 3, t + 9], 8, 2, 64, 2, 16, 16, torch.float16, "cpu", seed=7)
    if t == 1:
        c["q"] = c["q"][:, 0].contiguous()
        plan = kernels.plan_decode("pq", c["sealed_lens"], c["tail_lens"], num_qo_heads=8, num_kv_heads=2,
                                   head_dim=64, block_size=16, tail_block_size=16, device="cpu",
                                   dtype=torch.float16, backend="triton")
    else:
        plan = plan_multi(c)
    args = [c[k] for k in RUN_ARGS] + [0.125]
    checked, trusted = plan.run_pq(*args), plan.run_pq(*args, trusted=True)
    for a, b in zip(checked, trusted):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="sealed_tables"):       # the checks the trusted call skips
        plan.run_pq(*args[:5], c["sealed_tables"][:1], *args[6:])


@cpu_only
def test_pq_multi_interpreter_split_items_and_softcap():
    # several PQ items per sequence (a small target_ctas), and soft-capped scores
    c = multi_case(5, [6, 3], [7, 21], 4, 2, 64, 2, 16, 16, torch.float32, "cpu", seed=4)
    out, lse = run_multi(c, 0.3, target_ctas=8, tile_pq=16)
    ro, rl = multi_ref(c, 0.3)
    check_attn(out, lse, ro, rl, 2e-3)
    out, lse = run_multi(c, 0.3, softcap=2.0)
    ro, rl = multi_ref(c, 0.3, softcap=2.0)
    check_attn(out, lse, ro, rl, 2e-3)


@cpu_only
def test_causal_mask_is_applied():
    # Query 0 must not see the T - 1 newest tokens: make them dominate the scores (their
    # keys are the queries' direction, scaled), so dropping the mask moves every row but
    # the last one far from the reference.
    t, d = 5, 64
    c = multi_case(t, [1], [9], 2, 1, d, 2, 16, 16, torch.float32, "cpu", seed=7)
    blk = int(c["tail_tables"][0, 0])
    c["tail_k"][blk, 0, 9 - (t - 1):9] = 4.0 * c["q"][0, :t - 1, 0].float()
    c["tail_v"][blk, 0, 9 - (t - 1):9] = 50.0
    out, lse = run_multi(c, 1.0 / math.sqrt(d))
    ro, rl = multi_ref(c, 1.0 / math.sqrt(d))
    check_attn(out, lse, ro, rl, 2e-3)
    full = dict(c, tail_lens=c["tail_lens"] + 0)
    # what every row would read with the mask dropped: the whole tail (the last row's view)
    no_mask = torch.stack([ref.pq_decode_attention(**{k: (v.double() if v.is_floating_point() else v)
                                                      for k, v in dict(full, q=c["q"][:, i]).items()},
                                                   scale=1.0 / math.sqrt(d))[0] for i in range(t)], 1)
    assert rel(out[0, 0], no_mask[0, 0]) > 0.5 and rel(ro[0, 0], no_mask[0, 0]) > 0.5


@cpu_only
@pytest.mark.parametrize("t,hq,hkv,d,lens,tbs", [(2, 4, 2, 64, [5, 40], 16), (5, 8, 1, 128, [9], 8),
                                               (16, 2, 2, 256, [16, 30], 16)])
def test_paged_multi_interpreter(t, hq, hkv, d, lens, tbs):
    gen = torch.Generator().manual_seed(2)
    nb = sum(math.ceil(n / tbs) for n in lens) + 1
    q = torch.randn(len(lens), t, hq, d, generator=gen).half()
    kc = torch.randn(nb, hkv, tbs, d, generator=gen).half()
    vc = torch.randn(nb, hkv, tbs, d, generator=gen).half()
    tab = make_tables(lens, tbs, nb, gen)
    sl = torch.tensor(lens, dtype=torch.int32)
    plan = kernels.plan_decode("paged", sl, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=tbs,
                               device="cpu", dtype=q.dtype, query_tokens=t, backend="triton", tile=16,
                               target_ctas=4 * hkv)
    out, lse = plan.run_paged(q, kc, vc, tab, 0.1)
    ro, rl = ref.paged_multi_attention(q.double(), kc.double(), vc.double(), tab, sl, 0.1)
    check_attn(out, lse, ro, rl, 2e-2)


def test_multi_plan_refusals():
    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, tail_block_size=16, device="cpu",
              dtype=torch.float16, backend="triton")
    with pytest.raises(ValueError, match="query_tokens"):
        kernels.plan_decode("pq", [16], [140], query_tokens=MAX_QUERY_TOKENS + 1, **kw)
    with pytest.raises(ValueError, match="query_tokens"):
        kernels.plan_decode("pq", [16], [20], query_tokens=0, **kw)
    with pytest.raises(ValueError, match="sliding windows"):
        kernels.plan_decode("pq", [16], [20], [0], [4], query_tokens=2, **kw)
    with pytest.raises(ValueError, match="tail_lens"):
        kernels.plan_decode("pq", [16], [3], query_tokens=4, **kw)
    # no CUDA C++ kernel off the GPU, for one query token or several
    assert kernels.decode_backend("pq", device="cpu", num_qo_heads=4, num_kv_heads=2, head_dim=64,
                                  block_size=16, dtype=torch.float16, query_tokens=2) != kernels.CUDA
    with pytest.raises(ValueError, match="backend='cuda'"):
        kernels.decode_backend("pq", device="cpu", num_qo_heads=4, num_kv_heads=2, head_dim=64,
                               block_size=16, dtype=torch.float16, query_tokens=2, backend="cuda")


def test_one_token_plans_still_take_empty_ranges():
    """A decode step plans sequences with no fp16 tokens (an empty tail, a finished
    row): only a multi-token plan needs its new tokens in the fp16 range."""
    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
              dtype=torch.float16, backend="triton", target_ctas=4)
    pq = kernels.plan_decode("pq", [16, 32, 0], [5, 0, 0], tail_block_size=16, **kw)
    paged = kernels.plan_decode("paged", [1, 54, 0], **kw)
    assert pq.batch == paged.batch == 3
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.plan_decode("paged", [1, 54, 0], query_tokens=2, **kw)


def test_router_entry_points_use_the_reference_on_cpu():
    c = multi_case(3, [2], [6], 4, 2, 64, 2, 16, 16, torch.float32, "cpu")
    got = kernels.pq_multi_attention(**c, scale=0.2)
    want = ref.pq_multi_attention(**c, scale=0.2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------ GPU

@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,dsub", [(64, 2), (128, 2), (128, 4), (256, 2), (256, 4)])
@pytest.mark.parametrize("t,hq,hkv", [(2, 32, 8), (8, 32, 8), (16, 32, 8), (5, 8, 1), (16, 4, 1),
                                     (100, 9, 3), (MAX_QUERY_TOKENS, 32, 8)])
def test_pq_multi_gpu(t, hq, hkv, d, dsub, dtype):
    c = multi_case(t, [40, 7, 0, 129], [t + 3, 130, 16 + t, t], hq, hkv, d, dsub, 16, 16, dtype, "cuda")
    ro, rl = multi_ref(c, 1.0 / math.sqrt(d))
    for backend in ("cuda", "triton"):
        out, lse = run_multi(c, 1.0 / math.sqrt(d), backend=backend)
        check_attn(out, lse, ro, rl, 3e-2 if dtype == torch.bfloat16 else 1e-2)


@gpu
def test_router_gives_many_query_rows_to_wide_triton_blocks():
    """On the GPU the router's own choice: 16 tokens x G 4 stay on the CUDA kernel, 128
    take Triton's wide blocks (tunables.MTQ_TRITON_ROWS), and both match the reference."""
    from kvstore.kernels import tunables
    from kvstore.kernels.cuda import attention as ca
    from kvstore.kernels.triton.decode import TritonDecodePlan
    for t, kind in ((16, ca.CudaPQPlan), (MAX_QUERY_TOKENS, TritonDecodePlan)):
        c = multi_case(t, [40, 129], [t + 3, 130], 32, 8, 128, 2, 16, 16, torch.float16, "cuda", seed=t)
        plan = plan_multi(c, backend="auto")
        assert isinstance(plan, kind)
        if kind is TritonDecodePlan:
            assert plan.row_block == tunables.MTQ_WIDE_ROWS
        out, lse = plan.run_pq(*[c[k] for k in RUN_ARGS], 0.1)
        check_attn(out, lse, *multi_ref(c, 0.1), 1e-2)


@gpu
@pytest.mark.parametrize("dsub", [2, 4])
@pytest.mark.parametrize("t,hq,hkv", [(2, 2, 2), (8, 1, 1), (5, 2, 1), (7, 4, 2), (3, 6, 2), (4, 10, 2),
                                      (16, 8, 8)])
def test_pq_multi_cuda_query_groups(t, hq, hkv, dsub):
    """Every way the CUDA kernel groups query tokens into its rows (G 1-5, 8; groups
    padded or not), with tails whose last tile holds fewer tokens than a group (a row that
    sees nothing of a warp's first tail tile) and tails cut off mid-block, several items a
    sequence (a small grid) and soft-capping."""
    from kvstore.kernels.cuda import attention as ca
    assert ca.query_groups(5, 2) == (3, 2) and ca.query_groups(16, 4) == (2, 8) and ca.query_groups(1, 4) == (1, 1)
    tails = [t, t + 1, 17, 33, 16 + t, 130]
    c = multi_case(t, [3, 40, 0, 1, 9, 129], tails, hq, hkv, 128, dsub, 16, 16, torch.float16, "cuda", seed=t)
    refs = {cap: multi_ref(c, 0.1, softcap=cap) for cap in (0.0, 3.0)}
    for kw in ({}, dict(target_ctas=3 * hkv), dict(softcap=3.0)):
        plan = plan_multi(c, backend="cuda", **kw)
        assert isinstance(plan, ca.CudaPQPlan)
        out = torch.full_like(c["q"], POISON)
        lse = torch.full(c["q"].shape[:3], POISON, device="cuda")
        plan.run_pq(*[c[k] for k in RUN_ARGS], 0.1, out=out, lse=lse)
        check_attn(out, lse, *refs[kw.get("softcap", 0.0)], 1e-2)


@gpu
def test_pq_multi_cuda_graph_replays_after_update():
    """A multi-token plan captured in a CUDA graph replays the lengths update() gives it."""
    t = 4
    c = multi_case(t, [30, 5], [40, 9], 32, 8, 128, 2, 16, 16, torch.float16, "cuda", seed=3)
    c2 = dict(c, sealed_lens=torch.tensor([30 * 16 - 64, 5 * 16]), tail_lens=torch.tensor([21, 4]))
    plan = plan_multi(c, backend="cuda", spare_items=8)
    out = torch.empty_like(c["q"])
    lse = torch.empty(c["q"].shape[:3], device="cuda")
    args = [c[k] for k in RUN_ARGS]
    plan.run_pq(*args, 0.1, out=out, lse=lse)
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            plan.run_pq(*args, 0.1, out=out, lse=lse)
    torch.cuda.synchronize()
    for case in (c2, c):
        plan.update(case["sealed_lens"], case["tail_lens"])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rl = multi_ref(case, 0.1)
        check_attn(out, lse, ro, rl, 1e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(2, 128), (8, 128), (16, 64), (5, 256), (MAX_QUERY_TOKENS, 128)])
def test_paged_multi_gpu(t, d, dtype):
    gen = torch.Generator().manual_seed(5)
    lens, bs, hq, hkv = [t, 700, 4100, max(t, 33)], 16, 32, 8
    nb = sum(math.ceil(n / bs) for n in lens) + 1
    q = torch.randn(len(lens), t, hq, d, generator=gen).to(dtype).cuda()
    kc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype).cuda()
    vc = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype).cuda()
    tab = make_tables(lens, bs, nb, gen).cuda()
    sl = torch.tensor(lens, dtype=torch.int32)
    out, lse = kernels.paged_multi_attention(q, kc, vc, tab, sl, 0.08)
    ro, rl = ref.paged_multi_attention(q.cpu().double(), kc.cpu().double(), vc.cpu().double(), tab.cpu(), sl, 0.08)
    check_attn(out, lse, ro, rl, 3e-2 if dtype == torch.bfloat16 else 1e-2)


@gpu
@pytest.mark.parametrize("dsub", [2, 4])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 1)])
def test_pq_multi_cuda_with_codebook_image(hq, hkv, dsub):
    """The engine passes its codebook image to multi-token plans too: where the image's
    layout is the multi-token build's (dsub 4 always; dsub 2 when the query rows' group
    has the decode group's layout, G = 8), short items stage the codebooks by bulk copies,
    elsewhere through registers; both give the reference."""
    t = 4
    c = multi_case(t, [40, 7, 0, 3], [t + 3, 130, 16 + t, t], hq, hkv, 128, dsub, 16, 16, torch.float16, "cuda",
                   seed=11)
    words = kernels.codebook_images(c["k_codebook"][None], c["v_codebook"][None], hq)
    img = None if words is None else kernels.layer_images(words, hq, dsub)[0]
    ro, rl = multi_ref(c, 0.1)
    plan = plan_multi(c, backend="cuda")
    out = torch.full_like(c["q"], POISON)
    lse = torch.full(c["q"].shape[:3], POISON, device="cuda")
    plan.run_pq(*[c[k] for k in RUN_ARGS], 0.1, out=out, lse=lse, codebook_image=img)
    check_attn(out, lse, ro, rl, 1e-2)
