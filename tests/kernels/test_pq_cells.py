"""Cell-table encoder (kernels/pq_cells.py) == brute force (reference.pq_encode), exactly.

Small grids (G = 8, 16) keep the CPU table builds fast and make FULL cells and points
outside the grid common, so both the list path and the full-scan path are exercised.
"""
import pytest
import torch

from kvstore.kernels import pq_cells
from kvstore.kernels import reference as ref


def _check(cb, x, **kw):
    plan = pq_cells.plan_cells(cb, **kw)
    got, want = plan.encode(x), ref.pq_encode(x, cb)
    bad = (got != want).sum().item()
    assert bad == 0, f"{bad} of {want.numel()} codes differ"
    return plan


def _invariants(t: pq_cells.CellTables):
    cnt = t.counts.long()
    listed = cnt != pq_cells.FULL
    assert (cnt[listed] >= 1).all() and (cnt[listed] <= t.cmax).all()
    lst = t.lists.long()
    pos = torch.arange(t.cmax)
    inside = pos < cnt.unsqueeze(-1)
    # ascending strictly within the count, then the last entry repeated
    assert ((lst[..., 1:] > lst[..., :-1]) | ~inside[..., 1:])[listed].all()
    last = torch.gather(lst, -1, (cnt.clamp(1, t.cmax) - 1).unsqueeze(-1))
    assert ((lst == last) | inside)[listed].all()
    assert (t.bp[..., 1:] >= t.bp[..., :-1]).all()


def _gauss(hkv, m, n, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    cb = torch.randn(hkv, m, 256, 2, generator=g) * scale
    x = (torch.randn(n, hkv, 2 * m, generator=g) * scale).to(dtype)
    return cb, x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grid,cmax", [(8, 7), (16, 7), (16, 15)])
def test_random(dtype, grid, cmax):
    cb, x = _gauss(2, 4, 20000, seed=grid + cmax, dtype=dtype)
    x[:50] *= 8                                               # some far outside the grid
    plan = _check(cb, x, grid=grid, cmax=cmax)
    _invariants(plan.tables)


def test_default_grid_and_fp16_codebook():
    cb, x = _gauss(1, 2, 30000, seed=5, dtype=torch.float16)
    plan = _check(cb.half(), x)                               # codebook in the compute dtype
    assert plan.tables.grid == 32 and plan.tables.cmax == 7
    _invariants(plan.tables)


def _boundary_points(cb: torch.Tensor, bp: torch.Tensor, n_pairs: int, seed: int) -> torch.Tensor:
    """Points at exactly / nearly equal distance from two centroids, on the cell edges
    and corners, and on the centroids -> x [n, Hkv, 2M] fp32."""
    g = torch.Generator().manual_seed(seed)
    hkv, m, c, _ = cb.shape
    i = torch.randint(0, c, (n_pairs, hkv, m), generator=g)
    # nearest neighbour of each picked centroid: the pairs whose midpoint is a real boundary
    d = torch.cdist(cb.reshape(-1, c, 2), cb.reshape(-1, c, 2)).reshape(hkv, m, c, c)
    d.diagonal(dim1=2, dim2=3).fill_(float("inf"))
    nn = d.argmin(-1)
    h = torch.arange(hkv).view(1, hkv, 1)
    j = torch.arange(m).view(1, 1, m)
    a, b = cb[h, j, i], cb[h, j, nn[h, j, i]]
    mids = (a + b) / 2                                        # [n, Hkv, M, 2]
    t = torch.rand(n_pairs, hkv, m, 1, generator=g)
    # along the perpendicular bisector: still equidistant
    perp = torch.stack([-(b - a)[..., 1], (b - a)[..., 0]], -1)
    bis = mids + (t - 0.5) * perp
    nud = mids + (torch.rand(n_pairs, hkv, m, 2, generator=g) - 0.5) * 1e-6
    # cell edges and corners: breakpoints themselves
    gg = bp.shape[-1]
    ix = torch.randint(0, gg, (n_pairs, hkv, m), generator=g)
    iy = torch.randint(0, gg, (n_pairs, hkv, m), generator=g)
    corners = torch.stack([bp[h, j, 0, ix], bp[h, j, 1, iy]], -1)
    edges = torch.stack([bp[h, j, 0, ix], mids[..., 1]], -1)
    pts = torch.cat([mids, bis, nud, corners, edges, a], 0)
    return pts.reshape(pts.shape[0], hkv, 2 * m)


@pytest.mark.parametrize("grid", [8, 16])
def test_boundaries(grid):
    cb, _ = _gauss(2, 4, 1, seed=11)
    plan = pq_cells.plan_cells(cb, grid=grid)
    x = _boundary_points(cb, plan.tables.bp, 3000, seed=grid)
    _check(cb, x, grid=grid)
    _check(cb, x.half(), grid=grid)


def test_lattice_ties():
    # centroids on an integer lattice, points on half-integers: exact 2- and 4-way ties
    ax = torch.arange(16, dtype=torch.float32)
    lat = torch.stack(torch.meshgrid(ax, ax, indexing="ij"), -1).reshape(256, 2)
    cb = torch.stack([lat, lat * 0.25 - 1.0, lat.flip(0)]).reshape(1, 3, 256, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-6, 40, (20000, 1, 6), generator=g).float() / 2
    x[:, :, 2:4] = x[:, :, 2:4] * 0.25 - 1.0
    _check(cb, x, grid=16)
    _check(cb, x.half(), grid=8, cmax=15)


def test_duplicates_and_degenerate():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(1, 1, 256, 2, generator=g)
    dup = base.clone()
    dup[..., 128:, :] = dup[..., :128, :]                     # every centroid twice
    few = base.clone()
    few[..., :, :] = base[..., torch.randint(0, 5, (256,), generator=g), :]   # 5 distinct points
    same = torch.full((1, 1, 256, 2), 0.3)                    # all identical
    line = torch.stack([torch.linspace(-2, 2, 256), torch.full((256,), 0.7)], -1).view(1, 1, 256, 2)
    diag = torch.stack([torch.linspace(-2, 2, 256), 2 * torch.linspace(-2, 2, 256)], -1).view(1, 1, 256, 2)
    vert = torch.stack([torch.zeros(256), torch.randn(256, generator=g)], -1).view(1, 1, 256, 2)
    cb = torch.cat([dup, few, same, line, diag, vert], 1)     # [1, 6, 256, 2]
    x = torch.randn(20000, 1, 12, generator=g) * 1.5
    x[:2000] = cb[0, :, torch.randint(0, 256, (2000,), generator=g)].permute(1, 0, 2).reshape(2000, 1, 12)
    plan = _check(cb, x, grid=16)
    _invariants(plan.tables)
    _check(cb, x.half(), grid=8)


def test_extreme_scales():
    g = torch.Generator().manual_seed(9)
    cb = torch.randn(1, 4, 256, 2, generator=g)
    cb[0, 1] *= 1e-20                                         # products underflow to subnormals
    cb[0, 2] *= 1e30                                          # too big: the whole subspace scans all
    cb[0, 3] *= 1e4
    x = torch.randn(20000, 1, 8, generator=g)
    x[:, :, 2:4] *= 1e-20
    x[:, :, 4:6] *= 1e30
    x[:, :, 6:8] *= 1e4
    x[:100] *= 1e3                                            # far outside
    plan = _check(cb, x, grid=16)
    assert (plan.tables.counts[0, 2] == pq_cells.FULL).all()
    xh = torch.randn(5000, 1, 8, generator=g).half() * 60000  # fp16 extremes
    _check(cb, xh, grid=16)


def test_fewer_centroids_than_cmax():
    g = torch.Generator().manual_seed(13)
    cb = torch.randn(2, 2, 5, 2, generator=g)
    x = torch.randn(3000, 2, 4, generator=g)
    plan = _check(cb, x, grid=8, cmax=7)
    _invariants(plan.tables)


@pytest.mark.parametrize("sdt", [torch.int32, torch.int64])
def test_slots_contract(sdt):
    cb, x = _gauss(2, 4, 333, seed=17, dtype=torch.float16)
    bs = 16
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(30 * bs, generator=g)[:333].to(sdt)
    plan = pq_cells.plan_cells(cb, grid=16)
    for kind, shape in (("k_codes", (30, 2, bs, 4)), ("v_codes", (30, 2, 4, bs))):
        got = torch.full(shape, 7, dtype=torch.uint8)
        want = got.clone()
        plan.run(x, slots, **{kind: got})
        ref.pq_encode_to_slots(x, cb, slots, **{kind: want})
        assert torch.equal(got, want), kind
