"""The calibration math on small random data: OPQ rotations are orthogonal and
lower the PQ error, and a transform
with the rotation folded in still leaves attention (and the fp16 tail) exact."""
import math

import pytest
import torch

faiss = pytest.importorskip("faiss")

from kvstore.codec.transform import Transform  # noqa: E402
from kvstore.tools import calibrate as C  # noqa: E402


def skewed(n=3000, d=16, seed=0):
    """Gaussian rows with a spread of variances on random axes (keys look like this)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    scales = torch.logspace(1, -1.5, d)
    return (torch.randn(n, d, generator=g) * scales) @ q.T + 3.0


def orthogonal(r, atol=1e-5):
    return torch.allclose(r @ r.T, torch.eye(r.shape[0]), atol=atol) and torch.allclose(r.T @ r, torch.eye(r.shape[0]),
                                                                                       atol=atol)


def pq_error(x, cent):
    return ((x - C.pq_reconstruct(x, cent)) ** 2).sum(1).mean().item()


def test_eigen_allocation_is_orthogonal_and_balances_subspaces():
    x = skewed()
    for m in (8, 4):
        r = C.eigen_allocation(x, m)
        assert orthogonal(r)
        xr = (x - x.mean(0)) @ r.T
        cov = xr.T @ xr / len(xr)
        off = cov - torch.diag(torch.diag(cov))
        assert off.abs().max() < 1e-3 * cov.diag().max()            # decorrelated axes
        # Gaussian PQ distortion ~ sum over subspaces of det(sub-covariance)^(1/dsub): lower after the rotation
        assert gauss_distortion(xr, m) < 0.8 * gauss_distortion(x - x.mean(0), m)


def gauss_distortion(x, m):
    n, d = x.shape
    sub = x.reshape(n, m, d // m).transpose(0, 1)                      # [m, n, dsub]
    cov = sub.transpose(1, 2) @ sub / n
    return (torch.linalg.det(cov.double()) ** (m / d)).sum().item()


def test_eigen_allocation_pairs_large_with_small():
    # diagonal data: variances 2^7 .. 2^0; greedy allocation pairs 7 with 0, 6 with 1, ...
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, 8, generator=g) * torch.tensor([2.0 ** (i / 2) for i in range(8)])
    r = C.eigen_allocation(x, 4)
    assert orthogonal(r)
    axes = r.abs().argmax(1).reshape(4, 2)                           # original axis behind each new dim
    assert sorted(sorted(p) for p in axes.tolist()) == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_procrustes_recovers_a_rotation():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 12, generator=g)
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=g))
    r = C.procrustes(x, x @ q.T)
    assert orthogonal(r) and torch.allclose(r, q, atol=1e-4)


def test_opq_lowers_pq_error():
    x = skewed()
    plain = pq_error(x, C.train_pq(x, 8, niter=10))
    r, cent = C.opq(x, 8, niter=10)
    assert orthogonal(r)
    assert pq_error(x @ r.T, cent) < 0.8 * plain
    r2, cent2 = C.opq(x, 8, niter=10, iters=3)
    assert orthogonal(r2)
    assert pq_error(x @ r2.T, cent2) < 0.8 * plain


def test_rotation_folded_into_transform_keeps_attention_and_tail_exact():
    g = torch.Generator().manual_seed(3)
    d, layers, hkv = 16, 2, 2
    base = torch.eye(d) + 0.2 * torch.randn(layers, hkv, d, d, generator=g)
    rot = torch.stack([torch.stack([C.eigen_allocation(skewed(400, d, seed=4 * l + h), 8) for h in range(hkv)])
                       for l in range(layers)])
    tr = Transform(k=rot @ base, v=rot @ base.flip(-1))
    q, k, v = (torch.randn(7, hkv, d, generator=g) for _ in range(3))
    for layer in range(layers):
        kt = tr.forward(k, layer, "k")
        qt = torch.einsum("nhd,hde->nhe", q, tr._inv["k"][layer])    # q' = q A^-1
        assert torch.allclose((qt * kt).sum(-1), (q * k).sum(-1), atol=1e-4)
        # the fp16 tail stores K', V' in fp16; reading it back through the inverse is exact up to fp16
        # (an orthogonal R leaves norms and the condition number as they were: error <= cond(A) * fp16 eps)
        for x, w in ((k, "k"), (v, "v")):
            back = tr.inverse(tr.forward(x, layer, w).half().float(), layer, w)
            cond = torch.linalg.cond(getattr(tr, w)[layer]).max()
            assert torch.allclose(cond, torch.linalg.cond(base[layer]).max(), rtol=1e-3) or w == "v"
            assert ((back - x).norm(dim=-1) / x.norm(dim=-1)).max() < cond * 2.0 ** -10


def test_train_folds_opq_into_the_transform():
    from test_calibrate_eval import tiny_llama
    from kvstore.tools import hooks, models
    model = tiny_llama()
    sampler = C.Sampler(models.geometry_of(model), per_window=120, sink_rows=4)
    with torch.no_grad(), hooks.attention_handler(model, sampler):
        for s in range(3):
            model.model(input_ids=torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(s)))
    qa = C.qaware_transform(model, sampler.qq)
    cb, tr = C.train(model, sampler, 8, qa, niter=2, opq_mode="parametric")
    assert cb.k.shape == (2, 2, 8, 256, 2)
    for w in "kv":
        for layer in range(2):
            for h in range(2):
                r = getattr(tr, w)[layer, h] @ torch.linalg.inv(getattr(qa, w)[layer, h])
                assert orthogonal(r, atol=1e-3)                       # A = R A_qaware, R orthogonal
    cb0, tr0 = C.train(model, sampler, 8, qa, niter=2, opq_mode="none")
    assert torch.equal(tr0.k, qa.k)
    _, only_r = C.train(model, sampler, 4, None, niter=2, opq_mode="parametric")
    assert orthogonal(only_r.k[0, 0]) and not math.isnan(only_r.v.sum().item())
