"""The CUDA C++ PQ plan's work items for sliding windows, on the CPU: read as its kernel
(attention.cu, the WIN build) reads them, they must give the reference's windowed
attention, eagerly and after update(). The kernels themselves against the reference:
test_window_kernels.py (GPU).
"""
import pytest
import torch
from kernel_cases import pq_ref, pq_steps, window_starts

from kvstore.kernels import reference as ref
from kvstore.kernels.cuda import attention as cuda_attention


def _cuda_plan_cpu(c, *starts, **kw):
    """The CUDA C++ plan of case c, made on the CPU: its host side only."""
    return cuda_attention.plan_pq(c["sealed_lens"].tolist(), c["tail_lens"].tolist(), *starts,
                                  num_qo_heads=c["q"].shape[1], num_kv_heads=c["k_codes"].shape[1],
                                  head_dim=c["q"].shape[2], block_size=c["k_codes"].shape[2],
                                  tail_block_size=c["tail_k"].shape[2], device="cpu", dtype=torch.float16, **kw)


def _read_items(plan, c, scale, ss):
    """What attention.cu computes from the plan's work items, in fp64: an item reads whole
    16-token PQ tiles from pq_lo's tile (the WIN build; the plain build's pq_lo is a tile's
    first token) with the tokens before pq_lo masked out, and tail tokens [tail_lo, tail_hi);
    pq_merge combines a sequence's items. Checks the layout the kernel relies on on the way."""
    items, ptr = plan.items.tolist(), plan.item_ptr.tolist()
    assert all(it == [0] * 5 for it in items[ptr[-1]:]), "padding items must be empty"
    bs, tbs = c["k_codes"].shape[2], c["tail_k"].shape[2]
    kcb, vcb = c["k_codebook"].double(), c["v_codebook"].double()
    outs, lses = [], []
    for b in range(plan.batch):
        ns, nt = int(c["sealed_lens"][b]), int(c["tail_lens"][b])
        ks, vs = ref.gather_pq_blocks(c["k_codes"], c["v_codes"], kcb, vcb, c["sealed_tables"][b, :ns // bs])
        kt, vt = ref.gather_fp16_blocks(c["tail_k"].double(), c["tail_v"].double(),
                                        c["tail_tables"][b, :-(-nt // tbs)])
        o = torch.zeros(c["q"].shape[1:], dtype=torch.float64)
        lse = torch.full(c["q"].shape[1:2], float("-inf"), dtype=torch.float64)
        for i, (ib, lo, hi, t_lo, t_hi) in enumerate(items[ptr[b]:ptr[b + 1]]):
            assert ib == b and 0 <= lo <= hi <= ns and 0 <= t_lo <= t_hi <= nt and (hi > lo or t_hi > t_lo)
            assert hi % 16 == 0 and (lo % 16 == 0 or (plan.windowed and i == 0 and lo == ss[b])), \
                "only a windowed plan's first item of a sequence starts mid-tile, at the window"
            oi, li = ref.attention_dense(c["q"][b].double(), torch.cat([ks[lo:hi], kt[t_lo:t_hi]]),
                                         torch.cat([vs[lo:hi], vt[t_lo:t_hi]]), scale)
            o, lse = ref.merge_attention(o, lse, oi, li)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


SINKS = 16
# sealed blocks and tails of a batch at three decode steps (every tail one token longer,
# then blocks sealed out of the tails; a sealed sequence's tail holds its SINKS sink tokens
# first): long, short, tail-only, and two more to cut into items
STEPS = [([40, 3, 0, 12, 5], [150, 21, 9, 40, 16]), ([40, 3, 0, 12, 5], [151, 22, 10, 41, 17]),
         ([41, 4, 0, 13, 5], [136, 23, 11, 26, 18])]


@pytest.mark.parametrize("window", [
    0,        # starts all zero: the windowed build over every token
    37,       # inside the tails (the start of the sealed range is its end: no PQ item)
    100,      # long sequence: start inside the tail past every PQ token; others mid-sealed
    333,      # mid-tile in the sealed blocks, sinks outside the window
    700,      # mid-tile near the sealed range's start
    694,      # the long sequence's start at a tile's first token (its first step)
    5000,     # everything, sinks included
])
@pytest.mark.parametrize("target_ctas", [4, 132])
def test_cuda_plan_items_read_the_window(window, target_ctas):
    # CPU: the items of a windowed CUDA C++ plan, read as the kernel reads them, give the
    # reference's windowed attention; made at the first step, then update()d to the others
    _, at = pq_steps(STEPS, seed=11)
    plan = None
    for step in range(len(STEPS)):
        c = at(step)
        ss, ts = window_starts(c, window, SINKS)
        if plan is None:
            plan = _cuda_plan_cpu(c, ss, ts, target_ctas=target_ctas, spare_items=8)
            assert plan.windowed
        else:
            plan.update(c["sealed_lens"], c["tail_lens"], ss, ts)
        ro, rl = pq_ref(c, 0.2, sealed_starts=ss, tail_starts=ts)
        out, lse = _read_items(plan, c, 0.2, ss)
        assert torch.allclose(out, ro.double(), atol=1e-10)
        assert torch.allclose(lse, rl.double(), atol=1e-5)


def test_cuda_plan_without_starts_is_tile_aligned_and_refuses_them():
    # CPU: a plan made without starts reads every range from a tile's first token (the plain
    # build) and refuses starts later (its kernel, captured in a graph maybe, cannot mask)
    c = pq_steps(STEPS, seed=12)[1](0)
    plan = _cuda_plan_cpu(c, target_ctas=132, spare_items=8)
    assert not plan.windowed
    out, _ = _read_items(plan, c, 0.2, [0] * plan.batch)
    ro, _ = pq_ref(c, 0.2)
    assert torch.allclose(out, ro.double(), atol=1e-10)
    with pytest.raises(ValueError, match="without window starts"):
        plan.update(c["sealed_lens"], c["tail_lens"], *window_starts(c, 100, SINKS))
    windowed = _cuda_plan_cpu(c, *window_starts(c, 100, SINKS), target_ctas=132, spare_items=8)
    windowed.update(c["sealed_lens"], c["tail_lens"])            # no window this step: zeros
    assert torch.allclose(_read_items(windowed, c, 0.2, [0] * plan.batch)[0], ro.double(), atol=1e-10)
    with pytest.raises(ValueError, match="sealed_starts"):
        _cuda_plan_cpu(c, [700] + [0] * 4, [0] * 5)               # past the sealed range's end


def test_cuda_plan_names_its_builds():
    # CPU: the instantiation a plan launches carries its window and soft-cap flags
    c = pq_steps(STEPS, seed=13)[1](0)
    assert _cuda_plan_cpu(c, target_ctas=132, softcap=30.0).softcap == 30.0
    assert cuda_attention._attn_name(64, 2, False, 12, 2, True, True, False) == \
        "pq_attn<64, 2, false, 12, 2, true, true, false>"
