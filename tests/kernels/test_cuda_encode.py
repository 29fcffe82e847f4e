"""CUDA C++ PQ encode (kernels/cuda/encode.py) vs kernels/reference.py.

GPU only (`pytest -m gpu tests/kernels`); skipped where CUDA or cupy is missing. The cell
kernel must give the reference's codes exactly; the brute-force kernel may differ on
near-ties only (kernel_cases.check_encode).
"""
import pytest
import torch
from kernel_cases import HAS_CUDA, check_encode

from kvstore import kernels
from kvstore.kernels import reference as ref
from kvstore.kernels.cuda import build
from kvstore.kernels.cuda import encode as cuda_encode

HAS = HAS_CUDA and build.available()


def gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS, reason="needs CUDA + cupy")(f))


def _check_encode(x, cb, slots, bs):
    """The router's encode (the CUDA kernels for these codebooks) on the GPU."""
    check_encode(x, cb, slots, bs, "cuda", kernels.pq_encode_to_slots)


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
    assert cuda_encode.supported(cb.cuda()) and kernels.encode_backend(cb.cuda()) == kernels.CUDA
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
        plan = cuda_encode.plan_pq_encode(cb_dev, tokens_per_block=tpb)
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
    plan = cuda_encode.plan_pq_encode(cb.cuda())
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
    assert not cuda_encode.cells_aligned(xg)
    slots = torch.randperm(400, generator=gen)[:300]
    _check_encode(x.contiguous(), cb, slots, 16)                # the router: cells
    plan = cuda_encode.plan_pq_encode(cb.cuda())
    got = torch.full((25, 2, 16, 64), 7, dtype=torch.uint8, device="cuda")
    plan.run(xg, slots.cuda(), k_codes=got)
    want = torch.full((25, 2, 16, 64), 7, dtype=torch.uint8)
    ref.pq_encode_to_slots(x, cb, slots, k_codes=want)
    assert (got.cpu() != want).float().mean().item() < 0.01


def _layers_case(layers, hkv, d, dsub, n, nb, bs, dtype, seed):
    """x as the engine passes it, a [L, :n] view of a longer buffer; per-layer codebooks
    of the compute dtype (as storage keeps them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, n + 5, hkv, d, generator=gen).to(dtype)[:, :n]
    cb = torch.randn(layers, hkv, d // dsub, 256, dsub, generator=gen)
    cb = cb.half() if dtype == torch.float16 else cb
    slots = torch.randperm(nb * bs, generator=gen)[:n].int()
    return x, cb, slots


@gpu
@pytest.mark.parametrize("d,dsub,dtype", [(128, 2, torch.float16),       # cell kernel
                                          (64, 2, torch.bfloat16),        # cell kernel, bf16 x
                                          (128, 4, torch.float16),        # brute force (2-bit)
                                          (64, 2, torch.float32)])        # cell kernel, fp32 x
def test_every_layer_in_one_launch_gives_each_layers_codes(d, dsub, dtype):
    # a seal's encode: [L, n] tokens, the same slots in every layer, one launch for K (and
    # one for V): each layer's codes equal that layer's own encode, bit for bit
    layers, hkv, n, nb, bs = 3, 2, 300, 24, 16
    x, cb, slots = _layers_case(layers, hkv, d, dsub, n, nb, bs, dtype, seed=d + dsub)
    m = d // dsub
    plan = cuda_encode.encode_plan(cb.cuda(), refresh=True)
    assert plan.layers == layers and (plan.cells is not None) == (dsub == 2)
    for kind, shape in (("k_codes", (layers, nb, hkv, bs, m)), ("v_codes", (layers, nb, hkv, m, bs))):
        got = torch.full(shape, 7, dtype=torch.uint8, device="cuda")
        kernels.pq_encode_to_slots(x.cuda(), cb.cuda(), slots.cuda(), **{kind: got})
        for i in range(layers):
            one = torch.full(shape[1:], 7, dtype=torch.uint8, device="cuda")
            cuda_encode.plan_pq_encode(cb[i].cuda()).run(x[i].cuda(), slots.cuda(), **{kind: one})
            assert torch.equal(got[i], one), (kind, i)
            if dsub == 2:       # the cell kernel is exact: the reference's codes too
                want = torch.full(shape[1:], 7, dtype=torch.uint8)
                ref.pq_encode_to_slots(x[i], cb[i], slots, **{kind: want})
                assert torch.equal(got[i].cpu(), want), (kind, i)


@gpu
def test_every_layer_with_misaligned_layer_rows_takes_the_brute_force_kernel():
    # layer 0's rows are 16 B aligned but the layer stride is odd: the cell kernel's 16 B
    # loads would fault from layer 1 on, so the plan runs its brute-force kernel instead
    layers, n, hkv, d, nb, bs = 3, 200, 2, 128, 16, 16
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(layers, n * hkv * d + 1, generator=gen).half()
    xg = full.cuda()[:, :n * hkv * d].view(layers, n, hkv, d)
    cb = torch.randn(layers, hkv, d // 2, 256, 2, generator=gen).half()
    slots = torch.randperm(nb * bs, generator=gen)[:n].int()
    assert cuda_encode.cells_aligned(xg[0]) and not cuda_encode.cells_aligned(xg[0], xg.stride(0))
    got = torch.full((layers, nb, hkv, bs, d // 2), 7, dtype=torch.uint8, device="cuda")
    cuda_encode.encode_plan(cb.cuda(), refresh=True).run(xg, slots.cuda(), k_codes=got)
    for i in range(layers):
        want = torch.full((nb, hkv, bs, d // 2), 7, dtype=torch.uint8)
        ref.pq_encode_to_slots(xg[i].cpu(), cb[i], slots, k_codes=want)
        assert (got[i].cpu() != want).float().mean().item() < 0.01, i


@gpu
def test_every_layer_refuses_codes_of_another_layer_count():
    x, cb, slots = _layers_case(3, 2, 64, 2, 40, 4, 16, torch.float16, seed=1)
    codes = torch.zeros(2, 4, 2, 16, 32, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="k_codes must be \\[3, nb"):
        kernels.pq_encode_to_slots(x.cuda(), cb.cuda(), slots.cuda(), k_codes=codes)
    with pytest.raises(ValueError, match="x must be \\[3, N"):
        kernels.pq_encode_to_slots(x[0].cuda(), cb.cuda(), slots.cuda(), k_codes=codes)
    assert not codes.any()
