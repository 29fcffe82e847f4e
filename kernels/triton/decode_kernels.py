"""Triton kernels behind decode.py (launch them through its plans).

One program = one work item x one KV head (x one block of query rows). A work item
is a token range of one sequence, either over PQ-coded sealed blocks (kind 0) or
over fp16 paged blocks (kind 1: the tail, or the whole cache for plain paged
attention; kind 2: the fp16 range's last item, which holds the T new tokens of a
multi-token query and is read causally). The T x G query rows of the KV head (T
query tokens, G query heads each; T = 1 for decode) are the rows of the tile
(padded to GP >= 16 so tl.dot runs on tensor cores), so every code / K / V byte is
read once per KV head and row block. Each program writes a partial (out, lse) that
_merge_kernel combines.
"""
import triton
import triton.language as tl


@triton.jit
def _piece(w, J: tl.constexpr, CB_BF16: tl.constexpr):
    """Coordinate J of the centroids whose packed 16-bit coords are the words w."""
    if CB_BF16:
        dt: tl.constexpr = tl.bfloat16
    else:
        dt: tl.constexpr = tl.float16
    return (w >> (16 * J)).to(tl.uint16).to(dt, bitcast=True)


@triton.jit
def _cap(s, cap2, SOFTCAP: tl.constexpr):
    """Logit soft-capping of base-2 scores: cap2 * tanh(s / cap2), cap2 = softcap * log2(e)
    (the natural-log form softcap * tanh(x / softcap), scaled by log2(e) on both sides).
    tanh(t) = 1 - 2 / (e^2t + 1) saturates to +-1 without overflow (e^2t -> inf or 0)."""
    if SOFTCAP:
        e = tl.exp2(s / cap2 * 2.8853900817779268)      # e^(2t): 2 * log2(e)
        s = cap2 * (1.0 - 2.0 / (e + 1.0))
    return s


@triton.jit
def _softmax_step(s, mask, m_i, l_i, cap2, SOFTCAP: tl.constexpr):
    """Online softmax over one tile of base-2 scores s [GP, TILE] -> p, m, l, alpha;
    mask: the scores that count, [1, TILE] or [GP, TILE]."""
    s = tl.where(mask, _cap(s, cap2, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), alpha


@triton.jit
def _pq_range(q0, q1, q2, q3, b, h, lo, hi, m_i, l_i, a0, a1, a2, a3,
              kc_ptr, vc_ptr, skc_blk, skc_h, svc_blk, svc_h, kw_ptr, vw_ptr,
              tab_ptr, tab_stride, qk_scale, cap2,
              M: tl.constexpr, DSUB: tl.constexpr, BS: tl.constexpr,
              TILE: tl.constexpr, CB_BF16: tl.constexpr, PREC: tl.constexpr,
              SOFTCAP: tl.constexpr):
    # Head dim split by coordinate: q_j = q[:, j::DSUB] and K_j[n, m] = coord j of
    # the centroid of code (n, m), so q.k = sum_j q_j . K_j and out[:, m*DSUB+j]
    # = acc_j. This keeps the gathered words in their load layout (no
    # interleave/reshape, which cost ~10x more shared-memory traffic).
    offs_n = tl.arange(0, TILE)
    offs_m = tl.arange(0, M)
    # codebook words [Hkv, M, 256]: one word = the DSUB coords of one centroid
    kw_base = kw_ptr + h * (M * 256) + offs_m[None, :] * 256
    vw_base = vw_ptr + h * (M * 256) + offs_m[None, :] * 256
    for start in range(lo, hi, TILE):
        t = start + offs_n
        valid = t < hi
        blk = tl.load(tab_ptr + b * tab_stride + t // BS, mask=valid, other=0).to(tl.int64)
        off = t % BS
        # K codes row-wise [bs, M]: a tile row is M contiguous bytes
        kc = tl.load(kc_ptr + blk[:, None] * skc_blk + h * skc_h + off[:, None] * M
                     + offs_m[None, :], mask=valid[:, None], other=0)
        kw = tl.load(kw_base + kc.to(tl.int32))                       # [TILE, M] words
        s = tl.dot(q0, tl.trans(_piece(kw, 0, CB_BF16)), input_precision=PREC)
        s = tl.dot(q1, tl.trans(_piece(kw, 1, CB_BF16)), s, input_precision=PREC)
        if DSUB == 4:
            s = tl.dot(q2, tl.trans(_piece(kw, 2, CB_BF16)), s, input_precision=PREC)
            s = tl.dot(q3, tl.trans(_piece(kw, 3, CB_BF16)), s, input_precision=PREC)
        p, m_i, l_i, alpha = _softmax_step(s * qk_scale, valid[None, :], m_i, l_i, cap2, SOFTCAP)
        # V codes transposed [M, bs]: contiguous along tokens
        vc = tl.load(vc_ptr + blk[:, None] * svc_blk + h * svc_h + offs_m[None, :] * BS
                     + off[:, None], mask=valid[:, None], other=0)
        vw = tl.load(vw_base + vc.to(tl.int32))
        p = p.to(q0.dtype)
        a0 = tl.dot(p, _piece(vw, 0, CB_BF16), a0 * alpha[:, None], input_precision=PREC)
        a1 = tl.dot(p, _piece(vw, 1, CB_BF16), a1 * alpha[:, None], input_precision=PREC)
        if DSUB == 4:
            a2 = tl.dot(p, _piece(vw, 2, CB_BF16), a2 * alpha[:, None], input_precision=PREC)
            a3 = tl.dot(p, _piece(vw, 3, CB_BF16), a3 * alpha[:, None], input_precision=PREC)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _dense_range(q, b, h, lo, hi, lim, m_i, l_i, acc,
                 k_ptr, v_ptr, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t,
                 tab_ptr, tab_stride, qk_scale, cap2,
                 D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr,
                 SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr):
    # CAUSAL: row r reads tokens < lim[r] only (lim [GP]: a multi-token item's causal bound)
    offs_n = tl.arange(0, TILE)
    offs_d = tl.arange(0, D)
    for start in range(lo, hi, TILE):
        t = start + offs_n
        valid = t < hi
        blk = tl.load(tab_ptr + b * tab_stride + t // BS, mask=valid, other=0).to(tl.int64)
        off = t % BS
        k = tl.load(k_ptr + blk[:, None] * sk_blk + h * sk_h + off[:, None] * sk_t
                    + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PREC) * qk_scale
        mask = valid[None, :]
        if CAUSAL:
            mask = mask & (t[None, :] < lim[:, None])
        p, m_i, l_i, alpha = _softmax_step(s, mask, m_i, l_i, cap2, SOFTCAP)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptr + blk[:, None] * sv_blk + h * sv_h + off[:, None] * sv_t
                    + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_i, l_i, acc


@triton.jit
def _store_part(op_ptr, lp_ptr, item, rows, gmask, cols, o, m_i, l_i, Hq, D: tl.constexpr):
    # items are never empty, so l_i > 0 for every row
    prow = item.to(tl.int64) * Hq + rows
    tl.store(op_ptr + prow[:, None] * D + cols[None, :], o / l_i[:, None], mask=gmask[:, None])
    tl.store(lp_ptr + prow, m_i + tl.log2(l_i), mask=gmask)


@triton.jit
def _pq_item(q_rows, rows, gmask, item, b, h, lo, hi, m_i, l_i, op_ptr, lp_ptr,
             kc_ptr, vc_ptr, skc_blk, skc_h, svc_blk, svc_h, kw_ptr, vw_ptr, st_ptr, st_stride,
             qk_scale, cap2, Hq, GP: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
             DSUB: tl.constexpr, BS: tl.constexpr, TILE_PQ: tl.constexpr,
             CB_BF16: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr):
    if CB_BF16:
        cdt: tl.constexpr = tl.bfloat16
    else:
        cdt: tl.constexpr = tl.float16
    cols = tl.arange(0, M) * DSUB                           # coordinate j of subspace m
    q0 = tl.load(q_rows + cols[None, :], mask=gmask[:, None], other=0.0).to(cdt)
    q1 = tl.load(q_rows + cols[None, :] + 1, mask=gmask[:, None], other=0.0).to(cdt)
    q2 = q0
    q3 = q0
    if DSUB == 4:
        q2 = tl.load(q_rows + cols[None, :] + 2, mask=gmask[:, None], other=0.0).to(cdt)
        q3 = tl.load(q_rows + cols[None, :] + 3, mask=gmask[:, None], other=0.0).to(cdt)
    z = tl.zeros([GP, M], tl.float32)
    m_i, l_i, a0, a1, a2, a3 = _pq_range(
        q0, q1, q2, q3, b, h, lo, hi, m_i, l_i, z, z, z, z,
        kc_ptr, vc_ptr, skc_blk, skc_h, svc_blk, svc_h, kw_ptr, vw_ptr,
        st_ptr, st_stride, qk_scale, cap2, M, DSUB, BS, TILE_PQ, CB_BF16, PREC, SOFTCAP)
    _store_part(op_ptr, lp_ptr, item, rows, gmask, cols, a0, m_i, l_i, Hq, D)
    _store_part(op_ptr, lp_ptr, item, rows, gmask, cols + 1, a1, m_i, l_i, Hq, D)
    if DSUB == 4:
        _store_part(op_ptr, lp_ptr, item, rows, gmask, cols + 2, a2, m_i, l_i, Hq, D)
        _store_part(op_ptr, lp_ptr, item, rows, gmask, cols + 3, a3, m_i, l_i, Hq, D)


@triton.jit
def _dense_item(q_rows, rows, gmask, item, b, h, lo, hi, lim, m_i, l_i, op_ptr, lp_ptr,
                k_ptr, v_ptr, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, tt_ptr, tt_stride,
                qk_scale, cap2, Hq, GP: tl.constexpr, D: tl.constexpr, TBS: tl.constexpr,
                TILE_FP: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
                CAUSAL: tl.constexpr):
    offs_d = tl.arange(0, D)
    q = tl.load(q_rows + offs_d[None, :], mask=gmask[:, None], other=0.0)
    acc = tl.zeros([GP, D], tl.float32)
    m_i, l_i, acc = _dense_range(q, b, h, lo, hi, lim, m_i, l_i, acc,
                                 k_ptr, v_ptr, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t,
                                 tt_ptr, tt_stride, qk_scale, cap2, D, TBS, TILE_FP, PREC, SOFTCAP,
                                 CAUSAL)
    _store_part(op_ptr, lp_ptr, item, rows, gmask, offs_d, acc, m_i, l_i, Hq, D)


@triton.jit
def _decode_kernel(
        q_ptr, sq_b, sq_t, sq_h,                # q [B, T, Hq, D] (decode: T = 1, sq_t unused)
        items_ptr,                              # int32 [n_items, 4]: b, kind, lo, hi
        op_ptr, lp_ptr,                         # partials: fp32 [n_items, T * Hq, D], [n_items, T * Hq]
        kc_ptr, vc_ptr, skc_blk, skc_h, svc_blk, svc_h,  # PQ codes (kind 0)
        kw_ptr, vw_ptr, st_ptr, st_stride,      # codebook words, sealed tables
        k_ptr, v_ptr, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t,  # fp16 pool (kinds 1, 2)
        tt_ptr, tt_stride,                      # its block tables
        qk_scale, cap2, Hq, T,                  # cap2: softcap * log2(e) (used if SOFTCAP)
        # T is a runtime value (MULTI: T > 1) so that every chunk length of a prefill
        # runs on one compiled kernel
        MULTI: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
        DSUB: tl.constexpr, BS: tl.constexpr, TBS: tl.constexpr,
        TILE_PQ: tl.constexpr, TILE_FP: tl.constexpr, HAS_PQ: tl.constexpr,
        CB_BF16: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr):
    item = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(items_ptr + item * 4)
    kind = tl.load(items_ptr + item * 4 + 1)
    lo = tl.load(items_ptr + item * 4 + 2)
    hi = tl.load(items_ptr + item * 4 + 3)
    r = tl.program_id(2) * GP + tl.arange(0, GP)               # tile row: query token i, head g
    i = r // G
    head = h * G + r % G                                        # query heads of this KV head
    gmask = r < T * G
    rows = i * Hq + head                                        # the row of the partials
    q_rows = q_ptr + b.to(tl.int64) * sq_b + i[:, None] * sq_t + head[:, None] * sq_h
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    # kind 2 holds the T new tokens last: token i of them sees all but the T - 1 - i newest
    lim = tl.where(kind == 2, hi - (T - 1) + i, hi)
    if HAS_PQ:
        if kind == 0:
            _pq_item(q_rows, rows, gmask, item, b, h, lo, hi, m_i, l_i, op_ptr, lp_ptr,
                     kc_ptr, vc_ptr, skc_blk, skc_h, svc_blk, svc_h, kw_ptr, vw_ptr, st_ptr,
                     st_stride, qk_scale, cap2, T * Hq, GP, D, M, DSUB, BS, TILE_PQ, CB_BF16, PREC,
                     SOFTCAP)
        else:
            _dense_item(q_rows, rows, gmask, item, b, h, lo, hi, lim, m_i, l_i, op_ptr, lp_ptr,
                        k_ptr, v_ptr, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, tt_ptr,
                        tt_stride, qk_scale, cap2, T * Hq, GP, D, TBS, TILE_FP, PREC, SOFTCAP, MULTI)
    else:
        _dense_item(q_rows, rows, gmask, item, b, h, lo, hi, lim, m_i, l_i, op_ptr, lp_ptr,
                    k_ptr, v_ptr, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, tt_ptr,
                    tt_stride, qk_scale, cap2, T * Hq, GP, D, TBS, TILE_FP, PREC, SOFTCAP, MULTI)


@triton.jit
def _merge_kernel(op_ptr, lp_ptr, ip_ptr, out_ptr, so_b, so_h, lse_ptr, sl_b, Hq,
                  D: tl.constexpr, MAX_ITEMS: tl.constexpr):
    """Log-sum-exp merge of one (sequence, query row)'s partials (base-2 lse); a
    multi-token plan's rows are (token, head) pairs, Hq = T x query heads, with out and
    lse contiguous over them."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    lo = tl.load(ip_ptr + b)
    n = tl.load(ip_ptr + b + 1) - lo
    offs_i = tl.arange(0, MAX_ITEMS)
    offs_d = tl.arange(0, D)
    imask = offs_i < n
    prow = (lo + offs_i).to(tl.int64) * Hq + hq
    lp = tl.load(lp_ptr + prow, mask=imask, other=float("-inf"))     # [MAX_ITEMS]
    m = tl.max(lp, 0)
    m_safe = tl.where(n > 0, m, 0.0)
    w = tl.where(imask, tl.exp2(lp - m_safe), 0.0)
    l = tl.sum(w, 0)
    o = tl.load(op_ptr + prow[:, None] * D + offs_d[None, :], mask=imask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(n > 0, l, 1.0)
    LN2: tl.constexpr = 0.6931471805599453
    lse = tl.where(n > 0, (m_safe + tl.log2(tl.where(n > 0, l, 1.0))) * LN2, float("-inf"))
    tl.store(out_ptr + b.to(tl.int64) * so_b + hq * so_h + offs_d,
             o.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + b * sl_b + hq, lse)
