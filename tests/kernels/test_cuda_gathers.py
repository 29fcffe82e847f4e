"""CPU emulation of attention.cu's dsub 4 (2-bit) gathers: the shared-memory tables as the
codebook image and RegStager4 fill them, each lane's addresses as the kernel builds them
(PRMT byte selects included), the banks of every warp-wide gather, and the MMAs in their
fragment layouts, down to the scores and the output the kernel writes. What a GPU run
cannot show by its results alone is checked here: that every gather is conflict-free.
"""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.kernels.cuda import attention, images

T4_K, T4_V = 65536, 131072           # attention.cuh: the tables' shared-window addresses


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (generic mode): selector nibble n picks byte n & 7 of b:a, with bit 3
    set it replicates that byte's sign."""
    src = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> 4 * i) & 15
        v = src[n & 7]
        out |= ((255 if v & 0x80 else 0) if n & 8 else v) << 8 * i
    return out


def byte_perm(a: int, b: int, sel: int) -> int:
    """__byte_perm: the low 3 bits of each selector nibble only."""
    return prmt(a, b, sel & 0x7777)


def word(codes) -> int:
    return sum(int(c) << 8 * i for i, c in enumerate(codes))


def sigma(t, n):
    return 4 * (n >> 1) + 2 * t + (n & 1)


class Smem:
    """Shared memory from T4_K on, filled from a head's codebook image."""

    def __init__(self, img_words: torch.Tensor):
        self.mem = img_words.numpy().view(np.uint8)

    def entry(self, addr: int) -> np.ndarray:
        """The 8-byte entry at shared-window address addr: 4 fp16."""
        assert addr % 8 == 0 and T4_K <= addr < T4_V + 65536
        return self.mem[addr - T4_K:addr - T4_K + 8].view(np.float16).astype(np.float64)


def conflict_free(addrs) -> bool:
    """A warp's 8-byte gather takes its least, 2 wavefronts: each half-warp's 16 lanes hit
    16 distinct bank pairs (32 distinct banks)."""
    return all(len({(a // 8) % 16 for a in addrs[h:h + 16]}) == 16 for h in (0, 16))


def mma(c, a_rows, b_cols):
    """C[16x8] += A[16x16] B[16x8] (float64)."""
    c += a_rows @ b_cols


def case(d, seed):
    g = torch.Generator().manual_seed(seed)
    m = d // 4
    kcb = torch.randn(1, m, 256, 4, generator=g).half()
    vcb = torch.randn(1, m, 256, 4, generator=g).half()
    img = images.build_codebook_image(kcb, vcb, images.DSUB4)[0]
    return m, kcb[0].double().numpy(), vcb[0].double().numpy(), Smem(img), np.random.default_rng(seed)


@pytest.mark.parametrize("d", [64, 128])
def test_stager_fills_the_image(d):
    # RegStager4's units (global source, shared destination) write exactly the image's bytes
    m = d // 4
    mq, nx = m // 4, m // 8
    g = torch.Generator().manual_seed(d)
    kcb = torch.randn(m, 256, 4, generator=g).half()
    vcb = torch.randn(m, 256, 4, generator=g).half()
    img = images.build_codebook_image(kcb[None], vcb[None], images.DSUB4)[0].numpy().view(np.uint8)
    mem = np.zeros(2 * 65536, np.uint8)
    gk, gv = kcb.numpy().view(np.uint8).reshape(-1), vcb.numpy().view(np.uint8).reshape(-1)
    uk = m * 128
    written = 0
    for u in range(uk + 32 * 128):
        k = u < uk
        uu = u if k else u - uk
        r, s, cg, mb = uu & 15, (uu >> 4) & 1, (uu >> 5) & 63, uu >> 11
        code0 = 4 * cg + 2 * s
        sub = (r >> 2) * mq + 4 * mb + (r & 3) if k else 8 * ((r >> 2) & (nx - 1)) + 4 * mb + (r & 3)
        dst = (T4_K if k else T4_V) + code0 * 256 + 128 * mb + 8 * r - T4_K
        src = (gk if k else gv)[(sub * 256 + code0) * 8:(sub * 256 + code0) * 8 + 16]
        mem[dst:dst + 8], mem[dst + 256:dst + 264] = src[:8], src[8:]
        written += 16
    assert np.array_equal(mem, img)
    # every K and V entry at least once (V twice at d = 64: its second copy)
    assert written == 2 * 256 * 8 * m + (256 * 8 * m if d == 64 else 0)


@pytest.mark.parametrize("d,gp,g", [(128, 4, 4), (128, 4, 3), (128, 2, 2), (128, 2, 1), (128, 8, 8),
                                    (128, 8, 5), (64, 4, 4), (64, 2, 2), (64, 8, 6)])
def test_k_gathers_are_conflict_free_and_give_the_scores(d, gp, g):
    m, kcb, _, smem, rng = case(d, seed=d + 10 * gp + g)
    mq, nr = m // 4, 16 // gp
    q = rng.standard_normal((g, d)).astype(np.float16).astype(np.float64)
    codes = rng.integers(0, 256, (16, m))                   # one tile: 16 tokens x M
    want = np.array([[q[h] @ np.concatenate([kcb[s, codes[t, s]] for s in range(m)]) for t in range(16)]
                     for h in range(g)])
    lanes = [(ln >> 2, ln & 3) for ln in range(32)]
    # lane constants (attention.cu, the qk setup of CF && DSUB == 4)
    ksel = [(gq & 3) | ((gq + 1) & 3) << 4 | ((gq + 2) & 3) << 8 | ((gq + 3) & 3) << 12 for gq, _ in lanes]
    klo = [sum((8 * (4 * cq + ((gq + jj) & 3))) << 8 * jj for jj in range(4)) for gq, cq in lanes]

    def a_rows(j):
        """A of k-step j [16 rows, 16 k]: row copy rho, head hd = row / GP, row % GP."""
        a = np.zeros((16, 16))
        for gq, cq in lanes:
            for row in (gq, gq + 8):
                rho, hd = row // gp, row % gp
                if hd >= g:
                    continue
                s = cq * mq + 4 * (j // 4) + ((rho + j) & 3)
                a[row, 2 * cq:2 * cq + 2] = q[hd, 4 * s:4 * s + 2]
                a[row, 2 * cq + 8:2 * cq + 10] = q[hd, 4 * s + 2:4 * s + 4]
        return a

    for t in range(2):
        f = {}
        for qd in range(mq // 4):
            for jj in range(4):
                addrs = []
                for ln, (gq, cq) in enumerate(lanes):
                    tok = sigma(t, gq)
                    w = word(codes[tok, cq * mq + 4 * qd:cq * mq + 4 * qd + 4])
                    rc = byte_perm(w, 0, ksel[ln])
                    ad = prmt(klo[ln], rc, jj | (4 + jj) << 4 | (8 + jj) << 8 | (8 + jj) << 12)
                    addr = T4_K + 128 * qd + ad
                    addrs.append(addr)
                    sub = cq * mq + 4 * qd + ((gq + jj) & 3)
                    ent = smem.entry(addr)
                    assert np.array_equal(ent, kcb[sub, codes[tok, sub]])    # codebook[m, code]
                    f[(ln, 4 * qd + jj)] = ent
                assert conflict_free(addrs), (t, qd, jj)
        # rot_quads: the rotation bits at or above NR undone by selects
        v = nr
        while v < 4:
            f = {(ln, i): (f[(ln, (i & ~3) | ((i - v) & 3))] if lanes[ln][0] & v else f[(ln, i)])
                 for ln in range(32) for i in range(mq)}
            v *= 2
        c = np.zeros((16, 8))
        for j in range(mq):
            b = np.zeros((16, 8))
            for ln, (gq, cq) in enumerate(lanes):
                b[2 * cq:2 * cq + 2, gq] = f[(ln, j)][:2]
                b[2 * cq + 8:2 * cq + 10, gq] = f[(ln, j)][2:]
            mma(c, a_rows(j), b)
        # the score pick: (head gq % GP, column 2cq + e) from row GP * ((2cq + e) mod NR) + head
        for gq, cq in lanes:
            for e in range(2):
                x = (2 * cq + e) % nr
                row = gp * x + gq % gp
                if gq % gp < g:
                    assert c[row, 2 * cq + e] == pytest.approx(want[gq % gp, sigma(t, 2 * cq + e)], rel=1e-9,
                                                                 abs=1e-9)


@pytest.mark.parametrize("d,vg,g", [(128, 4, 4), (128, 4, 3), (128, 2, 2), (128, 8, 8), (64, 4, 4),
                                    (64, 2, 1), (64, 8, 7)])
def test_v_gathers_are_conflict_free_and_give_the_output(d, vg, g):
    m, _, vcb, smem, rng = case(d, seed=d + vg + g)
    nx = m // 8
    nj, nt_ = min(nx, 4), vg // 2
    p = rng.random((8, 16))                                   # P [head, token] of one tile
    p[g:] = 0
    codes = rng.integers(0, 256, (m, 16))                     # V codes [M, 16 tokens]
    want = np.array([sum(p[h, t] * np.concatenate([vcb[s, codes[s, t]] for s in range(m)]) for t in range(16))
                     for h in range(g)])
    lanes = [(ln >> 2, ln & 3) for ln in range(32)]
    vl = [[T4_V + 128 * (gq >> 2) + 8 * (4 * ((cq & (4 - nj)) | ((cq + j) & (nj - 1))) + (gq & 3))
           for j in range(nj)] for gq, cq in lanes]
    ov = np.zeros((2, nt_, 16, 8))
    for j in range(nj):
        ents = {}
        for k in range(4):
            addrs = []
            for ln, (gq, cq) in enumerate(lanes):
                sub = 8 * ((cq + j) & (nj - 1)) + gq
                cw = word(codes[sub, 4 * cq:4 * cq + 4])          # the ring's V code word
                addr = prmt(vl[ln][j], cw, 0x3200 | (4 + k) << 4)
                addrs.append(addr)
                ent = smem.entry(addr)
                assert np.array_equal(ent, vcb[sub, codes[sub, 4 * cq + k]])
                ents[(ln, k)] = ent
            assert conflict_free(addrs), (j, k)
        for pp in range(2):
            a = np.zeros((16, 16))      # A = V^T: rows gq / gq + 8 = coordinates 2p / 2p + 1
            for ln, (gq, cq) in enumerate(lanes):
                for k in range(4):
                    col = 2 * cq + (k & 1) + 8 * (k >> 1)          # token 4cq + k
                    a[gq, col], a[gq + 8, col] = ents[(ln, k)][2 * pp], ents[(ln, k)][2 * pp + 1]
            for nt in range(nt_):
                b = np.zeros((16, 8))   # B = P^T, column (c, h) masked to the lanes of group c
                for gq, cq in lanes:
                    n = 8 * nt + gq
                    if ((cq + j) & (nj - 1)) == n // vg:
                        for k in range(4):
                            b[2 * cq + (k & 1) + 8 * (k >> 1), gq] = p[n % vg, 4 * cq + k]
                mma(ov[pp, nt], a, b)
    out = np.zeros((8, d))
    for gq, cq in lanes:                 # the epilogue's coordinates
        for pp in range(2):
            for nt in range(nt_):
                for e in range(2):
                    n = 8 * nt + 2 * cq + e
                    c, hd = n // vg, n % vg
                    if c < nx:
                        out[hd, 4 * (8 * c + gq) + 2 * pp] += ov[pp, nt, gq, 2 * cq + e]
                        out[hd, 4 * (8 * c + gq) + 2 * pp + 1] += ov[pp, nt, gq + 8, 2 * cq + e]
    np.testing.assert_allclose(out[:g], want, rtol=1e-9, atol=1e-9)


def test_dsub4_slots_take_every_slot_once():
    # one code row: the K entries and the V entries (with their copies) tile its 256 bytes
    for m in (16, 32):
        k, vs = images.dsub4_slots(m)
        assert sorted(k.tolist()) == list(range(0, 8 * m, 8))
        v = torch.cat(vs)
        assert sorted(v.tolist()) == list(range(0, 256, 8))


def test_python_shared_memory_plan_matches_attention_cuh():
    """attention.py sizes the launch and checks the device's reserved shared memory with
    constants that attention.cuh fixes: a change to one side alone fails here, not as a
    trap at a kernel's entry on the GPU."""
    src = (Path(images.__file__).parent / "attention.cuh").read_text()
    t2k = int(re.search(r"constexpr u32 T2_K = (\d+),", src)[1])
    t4 = tuple(int(x) for x in re.search(r"constexpr u32 T4_K = (\d+), T4_V = (\d+);", src).groups())
    xchg = re.search(r"xchg_bytes\(int nw\) \{ return nw \* \((\d+) \+ (\d+)\); \}", src)
    assert attention.RESERVED_SMEM == t2k
    assert t4 == (T4_K, T4_V)
    per_warp = int(xchg[1]) + int(xchg[2])
    for nw in (8, 12, 16):
        assert attention._attn_smem(128, 4, 4, nw) == T4_V + 65536         # up to the V table's end
        assert attention._attn_smem(256, 4, 4, nw) == T4_V + 65536 + nw * per_warp
