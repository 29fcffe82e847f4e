"""Exact nearest-centroid search for 2-D subspaces (dsub = 2) through cell tables.

plan = plan_cells(codebook)              # once per codebook: build the tables
codes = plan.encode(x)                   # [N, Hkv, d] -> [N, Hkv, M] uint8
plan.run(x, slots, k_codes=...)          # or v_codes=...; reference.pq_encode_to_slots contract

Per (KV head, subspace) a G x G grid of cells covers the centroids' bounding box
(widened by `pad` on each side). Breakpoints are a mix of uniform and centroid
quantiles per axis, so cells are small where centroids are dense. A point's cell is
found by exact fp32 comparisons (x >= bp[i]), so the point lies in the closed cell.

Each cell lists the centroids that can be the encoder's answer for some point of it.
Centroid c is dropped when another centroid c' beats it on the whole cell with room
to spare for rounding: f(p) = |p - c|^2 - |p - c'|^2 is affine in p, so its minimum
over the rectangle is at a corner; c is dropped when that minimum exceeds the worst
fp32 error of the two computed distances (see `_margin`). The encoders compute
dist = fl(||c||^2 - 2 fl(fl(x0 c0) + fl(x1 c1))), exactly reference.pq_encode's fp32
arithmetic, so the dropped c has a strictly larger computed distance than c' for
every point of the cell; following such c -> c' steps ends at a listed centroid, so
the reference's argmin (lowest index among equal distances) is always listed. Lists
are ascending, hence the first minimum over a list is the reference's code.

Cells with more than `cmax` candidates (count stored as 255), points outside the grid
and non-finite points take the full 256-centroid scan. A subspace whose centroids are
non-finite or huge (|c| >= 2^60, where fp32 distances could overflow) scans all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference

FULL = 255            # count value: scan all centroids
_U = 2.0 ** -24       # fp32 unit roundoff
_HUGE = 2.0 ** 60


@dataclass(slots=True)
class CellTables:
    """bp [Hkv, M, 2, G+1] fp32 non-decreasing breakpoints per axis; counts
    [Hkv, M, G*G] uint8 (FULL = scan all); lists [Hkv, M, G*G, cmax] uint8,
    ascending, padded by repeating the last entry. Cell of a point: ix * G + iy with
    bp[.., 0, ix] <= x0 < bp[.., 0, ix+1] and likewise iy for x1."""
    bp: torch.Tensor
    counts: torch.Tensor
    lists: torch.Tensor
    grid: int
    cmax: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bp, self.counts, self.lists))


def _breakpoints(c: torch.Tensor, g: int, pad: float, mix: float) -> torch.Tensor:
    """c [S, C, 2] fp64 -> bp [S, 2, G+1] fp32 (mix 0 = uniform, 1 = quantiles)."""
    lo, hi = c.amin(1), c.amax(1)                                  # [S, 2]
    ext = hi - lo
    # degenerate axes (all centroids on a line or one point) still get a box
    s = torch.maximum(ext.amax(-1, keepdim=True), c.abs().amax((1, 2)).unsqueeze(-1) * 1e-3)
    s = s.clamp_min(1e-30)
    w = torch.maximum(ext, s / 4)
    mid = (lo + hi) / 2
    blo, bhi = mid - (0.5 + pad) * w, mid + (0.5 + pad) * w
    t = torch.linspace(0, 1, g + 1, dtype=c.dtype, device=c.device)
    uni = blo.unsqueeze(-1) + (bhi - blo).unsqueeze(-1) * t        # [S, 2, G+1]
    q = torch.quantile(c.transpose(1, 2), t, dim=-1).permute(1, 2, 0).clone()
    q[..., 0], q[..., -1] = blo, bhi
    bp = ((1 - mix) * uni + mix * q).float()
    return torch.cummax(bp, -1).values


def _margin(nc, nd, r, ac, ad):
    """Bound on |D(c) - E(c)| + |D(c') - E(c')| where D is the fp32 distance the
    encoders compute and E the exact ||c||^2 - 2 x.c, for |x| <= r: each D is within
    3.02u ||c||^2 + 6.03u |x||c| of E (two products, a sum, a doubling, a difference),
    plus 2^-120 for underflowed products."""
    return 4 * _U * (nc + nd + 2 * r * (ac + ad)) + 2.0 ** -120


def _prune(c: torch.Tensor, bp: torch.Tensor, cmax: int, k: int, t: int):
    """c [S, C, 2] fp64 (the encoder's values); bp [S, 2, G+1] -> counts [S, G*G] u8,
    lists [S, G*G, cmax] u8. Only the t centroids nearest each cell get the pairwise
    test; the rest must lose to the cell's best worst-case centroid by distance bounds
    alone, or the cell is marked FULL."""
    s_, nc_, _ = c.shape
    g = bp.shape[-1] - 1
    t = min(t, nc_)
    b = bp.double()

    cx, hx = (b[:, 0, 1:] + b[:, 0, :-1]) / 2, (b[:, 0, 1:] - b[:, 0, :-1]) / 2    # [S, G]
    cy, hy = (b[:, 1, 1:] + b[:, 1, :-1]) / 2, (b[:, 1, 1:] - b[:, 1, :-1]) / 2
    px = cx.unsqueeze(2).expand(s_, g, g).reshape(s_, g * g, 1)
    hx = hx.unsqueeze(2).expand(s_, g, g).reshape(s_, g * g, 1)
    py = cy.unsqueeze(1).expand(s_, g, g).reshape(s_, g * g, 1)
    hy = hy.unsqueeze(1).expand(s_, g, g).reshape(s_, g * g, 1)
    r = ((px.abs() + hx) ** 2 + (py.abs() + hy) ** 2).sqrt()      # max |x| over the cell
    dx, dy = (px - c[:, None, :, 0]).abs(), (py - c[:, None, :, 1]).abs()    # [S, G*G, C]
    near = (dx - hx).clamp_min(0) ** 2 + (dy - hy).clamp_min(0) ** 2   # min |p - c|^2 on the cell
    far = (dx + hx) ** 2 + (dy + hy) ** 2                               # max
    u = far.amin(-1, keepdim=True)
    nrm = (c * c).sum(-1)                                          # [S, C]
    big = nrm.amax(-1)[:, None, None]
    # every centroid outside the shortlist must lose to u's centroid by the bounds alone;
    # the shortlist is only as long as the worst cell of this chunk needs
    margin_u = _margin(big, big, r, big.sqrt(), big.sqrt())      # [S, G*G, 1]
    t = max(1, min(t, int((near <= u + margin_u).sum(-1).max())))
    safe = near.topk(t + 1, dim=-1, largest=False).values[..., t:] > u + margin_u if t < nc_ else None
    sel = near.topk(t, dim=-1, largest=False).indices              # [S, G*G, t]
    # dominators: the k centroids nearest the cell centre
    dom = (dx * dx + dy * dy).topk(min(k, nc_), dim=-1, largest=False).indices
    cs = torch.gather(c.unsqueeze(1).expand(s_, g * g, nc_, 2), 2, sel.unsqueeze(-1).expand(*sel.shape, 2))
    cd = torch.gather(c.unsqueeze(1).expand(s_, g * g, nc_, 2), 2, dom.unsqueeze(-1).expand(*dom.shape, 2))
    cs, cd = cs.unsqueeze(3), cd.unsqueeze(2)                      # [S, G*G, t, 1, 2], [S, G*G, 1, k, 2]
    px, py, hx, hy, r = (v.unsqueeze(-1) for v in (px, py, hx, hy, r))
    ax, ay = 2 * (cd[..., 0] - cs[..., 0]), 2 * (cd[..., 1] - cs[..., 1])   # [S, G*G, t, k]
    nc, nd = (cs * cs).sum(-1), (cd * cd).sum(-1)
    fmin = ax * px + ay * py + (nc - nd) - ax.abs() * hx - ay.abs() * hy
    keep = ~(fmin > _margin(nc, nd, r, nc.sqrt(), nd.sqrt())).any(-1)     # [S, G*G, t]
    counts = keep.sum(-1)
    if safe is not None:
        counts = torch.where(safe[..., 0], counts, cmax + 1)
    # ascending indices of kept centroids first, then pad with the last kept one
    order = torch.where(keep, sel, nc_ + sel).sort(-1).values[..., :cmax]
    last = torch.gather(order, -1, (counts.clamp(1, min(cmax, t)) - 1).unsqueeze(-1))
    pos = torch.arange(order.shape[-1], device=c.device)
    lists = torch.where(pos < counts.unsqueeze(-1), order, last)
    if lists.shape[-1] < cmax:                                     # fewer candidates than cmax
        lists = torch.cat([lists, last.expand(*last.shape[:-1], cmax - lists.shape[-1])], -1)
    counts = torch.where(counts > cmax, FULL, counts)
    return counts.to(torch.uint8), lists.clamp_max(nc_ - 1).to(torch.uint8)


def build_cell_tables(codebook: torch.Tensor, grid: int = 32, cmax: int = 7,
                      dominators: int = 8, pad: float = 0.25, mix: float = 0.75,
                      shortlist: int = 96, chunk_elems: int | None = None) -> CellTables:
    """codebook [Hkv, M, C <= 256, 2] float -> CellTables (on the codebook's device).
    chunk_elems bounds each fp64 temporary (default 2^24 on CUDA = 128 MB, 2^23 on CPU)."""
    if chunk_elems is None:
        chunk_elems = 1 << (24 if codebook.is_cuda else 23)
    if codebook.dim() != 4 or codebook.shape[-1] != 2 or not 0 < codebook.shape[2] <= 256:
        raise ValueError(f"codebook must be [Hkv, M, C<=256, 2], got {tuple(codebook.shape)}")
    assert grid & (grid - 1) == 0 and 1 <= cmax < FULL, (grid, cmax)
    hkv, m, nc, _ = codebook.shape
    c = codebook.to(reference._acc_dtype(codebook)).double().reshape(hkv * m, nc, 2)
    bp = _breakpoints(c, grid, pad, mix)
    bad = ~(torch.isfinite(c).all(-1).all(-1) & (c.abs().amax((1, 2)) < _HUGE)
            & torch.isfinite(bp).all(-1).all(-1))
    bp = torch.where(bad[:, None, None], torch.zeros_like(bp), bp)
    counts = torch.empty(hkv * m, grid * grid, dtype=torch.uint8, device=c.device)
    lists = torch.empty(hkv * m, grid * grid, cmax, dtype=torch.uint8, device=c.device)
    step = max(1, chunk_elems // (grid * grid * max(nc, shortlist * dominators)))
    for s0 in range(0, hkv * m, step):
        s1 = min(hkv * m, s0 + step)
        counts[s0:s1], lists[s0:s1] = _prune(torch.nan_to_num(c[s0:s1]), bp[s0:s1], cmax,
                                             dominators, shortlist)
    counts[bad] = FULL
    return CellTables(bp=bp.reshape(hkv, m, 2, grid + 1), counts=counts.reshape(hkv, m, -1),
                      lists=lists.reshape(hkv, m, grid * grid, cmax), grid=grid, cmax=cmax)


def locate(tables: CellTables, xt: torch.Tensor):
    """xt [S, N, 2] fp32 (S = Hkv*M) -> cell [S, N] int64, fast [S, N] bool
    (inside the grid and the cell's list is not FULL)."""
    g = tables.grid
    bp = tables.bp.reshape(-1, 2, g + 1)
    x0, x1 = xt[..., 0].contiguous(), xt[..., 1].contiguous()
    ix = torch.searchsorted(bp[:, 0].contiguous(), x0, right=True) - 1
    iy = torch.searchsorted(bp[:, 1].contiguous(), x1, right=True) - 1
    inside = ((x0 >= bp[:, 0, :1]) & (x0 < bp[:, 0, g:]) & (x1 >= bp[:, 1, :1]) & (x1 < bp[:, 1, g:]))
    cell = ix.clamp(0, g - 1) * g + iy.clamp(0, g - 1)
    cnt = torch.gather(tables.counts.reshape(bp.shape[0], -1), 1, cell)
    return cell, inside & (cnt != FULL)


def _dist(xt, cc, cn):
    """reference.pq_encode's fp32 distance: xt [..., 2], cc [..., K, 2], cn [..., K]."""
    return cn - 2.0 * (xt.unsqueeze(-2) * cc).sum(-1)


@dataclass(slots=True)
class CellEncodePlan:
    """cb [Hkv, M, C, 2] in reference.pq_encode's compute dtype (fp32, fp64 for an fp64
    codebook: the margins are fp32's, so they cover fp64 arithmetic too); cn = ||c||^2."""
    tables: CellTables
    cb: torch.Tensor
    cn: torch.Tensor
    chunk_elems: int = 1 << 22

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, Hkv, d] fp16/bf16/fp32 -> codes [N, Hkv, M] uint8 (== reference.pq_encode)."""
        hkv, m, nc, _ = self.cb.shape
        n = x.shape[0]
        assert x.dim() == 3 and x.shape[1:] == (hkv, 2 * m), (tuple(x.shape), hkv, m)
        s_ = hkv * m
        cb, cn = self.cb.reshape(s_, nc, 2), self.cn.reshape(s_, nc)
        g2 = self.tables.counts.shape[-1]
        lists = self.tables.lists.reshape(s_ * g2, self.tables.cmax)
        cb_flat, cn_flat = cb.reshape(s_ * nc, 2), cn.reshape(s_ * nc)
        sub = torch.arange(s_, device=x.device).unsqueeze(1)      # [S, 1]
        out = torch.empty(s_, n, dtype=torch.uint8, device=x.device)
        xt_all = x.to(cb.dtype).reshape(n, s_, 2).transpose(0, 1)   # [S, N, 2]
        step = max(1, self.chunk_elems // (s_ * self.tables.cmax))
        for n0 in range(0, n, step):
            xt = xt_all[:, n0:n0 + step]
            cell, fast = locate(self.tables, xt)
            cand = lists[sub * g2 + cell].long()                   # [S, n, cmax]
            flat = sub.unsqueeze(-1) * nc + cand
            best = _dist(xt, cb_flat[flat], cn_flat[flat]).argmin(-1, keepdim=True)   # first minimum
            codes = torch.gather(cand, -1, best).squeeze(-1)
            slow = (~fast).nonzero(as_tuple=True)
            if slow[0].numel():
                codes[slow] = _dist(xt[slow], cb[slow[0]], cn[slow[0]]).argmin(-1)
            out[:, n0:n0 + step] = codes.to(torch.uint8)
        return out.transpose(0, 1).reshape(n, hkv, m)

    def run(self, x, slots, k_codes=None, v_codes=None) -> None:
        """Same contract as reference.pq_encode_to_slots."""
        reference.write_codes_to_slots(self.encode(x), slots, k_codes, v_codes)


def plan_cells(codebook: torch.Tensor, **kw) -> CellEncodePlan:
    """codebook [Hkv, M, C, 2] -> plan (tables built on the codebook's device)."""
    cb = codebook.to(reference._acc_dtype(codebook)).contiguous()
    return CellEncodePlan(tables=build_cell_tables(codebook, **kw), cb=cb, cn=(cb * cb).sum(-1))
