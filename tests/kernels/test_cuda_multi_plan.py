"""The CUDA C++ PQ plan's work items for multi-token queries, on the CPU: read as its
kernel (attention.cu, pq_merge) reads them, they must give the reference's causal
multi-token attention, eagerly and after update(). The kernel itself against the
reference: test_multi_kernels.py (GPU).
"""
import pytest
import torch
from test_multi_kernels import multi_case, multi_ref

from kvstore.kernels import reference as ref
from kvstore.kernels.plan import MAX_QUERY_TOKENS
from kvstore.kernels.cuda import attention as cuda_attention


def _plan_cpu(c, **kw):
    q = c["q"]
    kw.setdefault("target_ctas", 132)
    return cuda_attention.plan_pq(c["sealed_lens"].tolist(), c["tail_lens"].tolist(),
                                  num_qo_heads=q.shape[2], num_kv_heads=c["k_codes"].shape[1],
                                  head_dim=q.shape[3], block_size=c["k_codes"].shape[2],
                                  tail_block_size=c["tail_k"].shape[2], device="cpu", dtype=torch.float16,
                                  query_tokens=q.shape[1], **kw)


def _read_items(plan, c, scale):
    """What the kernel computes from the plan in fp64: item row bv is query group j = bv %
    groups of sequence b = bv // groups; its query row hd (of QT x G) is token j * QT + hd
    // G, head (KV head) * G + hd % G; the item's PQ tokens [lo, hi) are seen by every row,
    its tail tokens [t_lo, t_hi) by row token tl of the group's nq up to t_hi - (nq - 1 - tl);
    pq_merge combines a row's items and drops rows past the T tokens."""
    items, ptr = plan.items.tolist(), plan.item_ptr.tolist()
    assert all(it == [0] * 5 for it in items[ptr[-1]:]), "padding items must be empty"
    b_, t, hq, d = c["q"].shape
    qt, ng = plan.groups
    assert len(ptr) == b_ * ng + 1
    bs, tbs = c["k_codes"].shape[2], c["tail_k"].shape[2]
    kcb, vcb = c["k_codebook"].double(), c["v_codebook"].double()
    out = torch.full((b_, t, hq, d), float("nan"), dtype=torch.float64)
    lse = torch.full((b_, t, hq), float("nan"), dtype=torch.float64)
    for bv in range(b_ * ng):
        b, j = divmod(bv, ng)
        ns, nt = int(c["sealed_lens"][b]), int(c["tail_lens"][b])
        ks, vs = ref.gather_pq_blocks(c["k_codes"], c["v_codes"], kcb, vcb, c["sealed_tables"][b, :ns // bs])
        kt, vt = ref.gather_fp16_blocks(c["tail_k"].double(), c["tail_v"].double(),
                                        c["tail_tables"][b, :-(-nt // tbs)])
        mine = items[ptr[bv]:ptr[bv + 1]]
        with_tail = [it for it in mine if it[4] > it[3]]
        assert len(with_tail) == 1 and with_tail[0] is mine[-1], "the whole tail in the row's last item"
        for tl in range(qt):
            tok = j * qt + tl
            if tok >= t:
                continue
            o = torch.zeros(hq, d, dtype=torch.float64)
            ls = torch.full((hq,), float("-inf"), dtype=torch.float64)
            for ib, lo, hi, t_lo, t_hi in mine:
                assert ib == bv and lo % 16 == 0 and hi % 16 == 0 and 0 <= lo <= hi <= ns
                assert t_lo == 0 or t_hi == t_lo
                nq = min(qt, t - j * qt)
                hi_t = min(t_hi, t_hi - (nq - 1 - tl)) if t_hi > t_lo else t_hi
                oi, li = ref.attention_dense(c["q"][b, tok].double(), torch.cat([ks[lo:hi], kt[t_lo:hi_t]]),
                                             torch.cat([vs[lo:hi], vt[t_lo:hi_t]]), scale)
                o, ls = ref.merge_attention(o, ls, oi, li)
            out[b, tok], lse[b, tok] = o, ls
    return out, lse


@pytest.mark.parametrize("t,hq,hkv", [(2, 4, 1), (5, 4, 2), (7, 4, 2), (8, 2, 2), (3, 6, 2), (16, 8, 1),
                                     (50, 8, 1), (MAX_QUERY_TOKENS, 4, 2)])
def test_multi_token_items_give_the_reference(t, hq, hkv):
    c = multi_case(t, [3, 0, 9, 2], [t, max(t, 17), t + 5, max(t, 40)], hq, hkv, 64, 2, 16, 16, torch.float32,
                   "cpu", seed=t)
    ro, rl = multi_ref(c, 0.2)
    for kw in ({}, dict(target_ctas=2 * hkv), dict(target_ctas=64 * hkv)):
        plan = _plan_cpu(c, **kw)
        out, lse = _read_items(plan, c, 0.2)
        assert torch.allclose(out, ro.double(), atol=1e-9) and torch.allclose(lse, rl.double(), atol=1e-9)
    # update() re-partitions other lengths into the same buffers
    plan = _plan_cpu(c, spare_items=8)
    c2 = dict(c, sealed_lens=torch.tensor([16, 0, 0, 32]), tail_lens=torch.tensor([t + 1, t, max(t, 33), t]))
    plan.update(c2["sealed_lens"], c2["tail_lens"])
    out, lse = _read_items(plan, c2, 0.2)
    ro, rl = multi_ref(c2, 0.2)
    assert torch.allclose(out, ro.double(), atol=1e-9) and torch.allclose(lse, rl.double(), atol=1e-9)


def test_multi_token_plan_refusals():
    c = multi_case(4, [1], [6], 4, 2, 64, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="tail_lens"):
        _plan_cpu(dict(c, tail_lens=torch.tensor([3])))
    plan = _plan_cpu(c, spare_items=4)
    with pytest.raises(ValueError, match="tail_lens"):
        plan.update([16], [2])
    with pytest.raises(ValueError, match="sliding windows"):
        cuda_attention.plan_pq([16], [6], [0], [2], num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               tail_block_size=16, device="cpu", dtype=torch.float16, query_tokens=4,
                               target_ctas=132)
