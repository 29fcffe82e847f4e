"""The torch k-means (the GPU calibration path) against faiss's on the CPU:
same quality on a fixed seed, every centroid used, warm starts honoured."""
import pytest
import torch

from kvstore.codec.codebooks import kmeans_torch, train_pq

faiss = pytest.importorskip("faiss")


def samples(n=6000, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # anisotropic and clustered, like K after RoPE: a mixture of 40 blobs of unequal spread
    centers = torch.randn(40, d, generator=g) * torch.linspace(0.3, 3.0, d)
    which = torch.randint(0, 40, (n,), generator=g)
    return centers[which] + 0.3 * torch.randn(n, d, generator=g)


def pq_error(x, cent):
    """Mean squared error of nearest-centroid reconstruction per subspace."""
    m, _, dsub = cent.shape
    xs = x.reshape(len(x), m, dsub).transpose(0, 1)
    return float((torch.cdist(xs, cent).amin(-1) ** 2).sum() / x.numel())


@pytest.mark.parametrize("m", [8, 4])
def test_torch_kmeans_matches_faiss_quality(m):
    x = samples()
    e_faiss = pq_error(x, train_pq(x, m, niter=20))
    e_torch = pq_error(x, train_pq(x, m, niter=20, device="cpu"))
    assert e_torch <= 1.03 * e_faiss, (e_torch, e_faiss)
    assert e_torch < 0.5 * pq_error(x, x[:256].reshape(256, m, -1).transpose(0, 1))   # it did train


def test_torch_kmeans_fills_every_centroid_and_is_seeded():
    x = torch.cat([torch.full((300, 2), 3.0), torch.randn(200, 2)])           # 300 identical rows
    c = kmeans_torch(x[None], 256, niter=10)
    assert c.shape == (1, 256, 2) and torch.isfinite(c).all()
    assert len(torch.unique(c[0], dim=0)) == 256                               # empty ones were split, not left
    assert torch.equal(c, kmeans_torch(x[None], 256, niter=10))
    init = torch.randn(1, 256, 2)
    assert torch.equal(kmeans_torch(x[None], 256, niter=0, init=init), init)


def test_torch_kmeans_chunking_changes_nothing():
    x = samples(n=3000, d=4).reshape(3000, 2, 2).transpose(0, 1).contiguous()
    a = kmeans_torch(x, 256, niter=5)
    b = kmeans_torch(x, 256, niter=5, chunk_bytes=4 * 2 * 256 * 100)           # 100 rows a chunk
    assert torch.allclose(a, b, atol=1e-5)


def test_torch_kmeans_refuses_too_few_rows():
    from kvstore.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="x"):
        kmeans_torch(torch.randn(1, 100, 2), 256)


@pytest.mark.gpu
def test_torch_kmeans_on_the_gpu_matches_the_cpu():
    x = samples(n=20000, d=32)
    e_cpu = pq_error(x, train_pq(x, 16, niter=20))
    e_gpu = pq_error(x, train_pq(x, 16, niter=20, device="cuda"))
    assert e_gpu <= 1.03 * e_cpu, (e_gpu, e_cpu)


def test_train_codebooks_on_a_torch_device_is_as_good_as_faiss():
    from kvstore.codec.codebooks import train_codebooks
    from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
    cfg = CacheConfig(name="c", model_id="m", geometry=ModelGeometry(1, 2, 2, 16), codec=CodecConfig(kind="pq", num_subvectors=8),
                      num_blocks=16)
    k = samples(n=1500).reshape(1, 1500, 1, 16).expand(1, 1500, 2, 16).contiguous()
    v = samples(n=1500, seed=1).reshape(1, 1500, 1, 16).expand(1, 1500, 2, 16).contiguous()
    a, b = train_codebooks(cfg, k, v, niter=10), train_codebooks(cfg, k, v, niter=10, device="cpu")
    assert a.k.shape == b.k.shape == (1, 2, 8, 256, 2)
    for h in range(2):
        assert pq_error(k[0, :, h], b.k[0, h]) <= 1.05 * pq_error(k[0, :, h], a.k[0, h])
