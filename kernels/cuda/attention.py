"""PQ decode attention in CUDA C++ (attention.cu + merge.cu): the plan and its run.

The plan type and its contract: kernels/plan.py. The router (kernels/router.py) makes
this plan where supports() holds, for callers whose tensors meet the kernels' alignment
(aligned()); the kernels are loaded at plan time (warm) or first run, and launched on
torch's current stream, so a run can be captured in a CUDA graph.

Multi-token queries (query_tokens T > 1) run on the same kernel: a sequence's T query
tokens are cut into groups of QT tokens (query_groups), and each group is one row of
the grid, whose QT x G query rows fill the MMA's rows where decode's G query heads
leave them empty (QT x G <= 8). Every group reads the same codes (from L2 for all but
the first), and the group's item holds the sequence's whole tail through its last
token, causal per row (attention.cu).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.cuda.pinned import to_device

from .. import tunables
from ..plan import HALF, DecodePlan, capacity, ceil, check, check_batch, fit, pq_ranges
from . import build
from .build import NULL, f32, i32, i64, ptr
from .images import IMG_WORDS, CodebookImage, group, image_layout

LOG2E = 1.4426950408889634      # the kernel's scores are base 2: scale and cap times log2(e)
RESERVED_SMEM = 1024            # the shared-window base the kernels' table addresses assume


def supports(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device,
             dtype: torch.dtype, kv_dtype: torch.dtype, codebook_dtype: torch.dtype) -> bool:
    """The kernels take this geometry and these dtypes on this device: sm_80+, head_dim
    64 or 128 (256 on sm_90+: split(), a thread block cluster per block), GQA groups of
    1-8, power-of-two block sizes of 16 tokens or more, and q, out, tail and codebooks all
    fp16 or all bf16. The kernels address their codebook tables at fixed shared-window
    addresses (attention.cuh T2_K, T4_K), which hold where the driver reserves 1 KiB a block."""
    dev = torch.device(device)
    if dev.type != "cuda" or not build.available():
        return False
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        return False
    g, idx = num_qo_heads // num_kv_heads, build.index(dev)
    cap = build.capability(idx)
    return (head_dim in (64, 128, 256) and 1 <= g <= 8 and block_size % 16 == 0
            and block_size & (block_size - 1) == 0 and dtype in HALF and kv_dtype == dtype
            and codebook_dtype == dtype and cap >= ((9, 0) if head_dim == 256 else (8, 0))
            and build.reserved_smem(idx) == RESERVED_SMEM)


def split(head_dim: int) -> int:
    """CTAs per (work item, KV head): the K and V codebooks of a d = 256 head (256 KiB)
    do not fit one SM's shared memory, so its two halves of 128 coordinates run as a
    cluster of two CTAs that exchange partial scores (attention.cuh, SPLIT)."""
    return 2 if head_dim == 256 else 1


def query_aligned(q: torch.Tensor) -> bool:
    """q's rows as the kernel loads them ([B, Hq, d] or [B, T, Hq, d]): 4-byte aligned,
    even strides."""
    return q.data_ptr() % 4 == 0 and all(s % 2 == 0 for s in q.stride()[:-1])


def misaligned(q, k_codes, v_codes, tail_k, tail_v, dsub: int) -> str | None:
    """The first argument whose address or strides the kernels' loads cannot take, or
    None: 16 B code rows (cp.async of K and V codes), code blocks less than 4 GiB apart (a
    block id times the block stride is a 32-bit product), 4 B q pairs, 4 / 8 B fp16 pairs /
    quads of the tail (dsub 2 / 4)."""
    for name, c in (("k_codes", k_codes), ("v_codes", v_codes)):
        if c.data_ptr() % 16 or c.stride(0) % 16 or c.stride(1) % 16 or not 0 <= c.stride(0) < 1 << 32:
            return name
    if not query_aligned(q):
        return "q"
    ew = 2 * dsub
    for name, t in (("tail_k", tail_k), ("tail_v", tail_v)):
        if t.data_ptr() % ew or any(s % (ew // 2) for s in t.stride()[:3]):
            return name
    return None


def query_groups(t: int, g: int) -> tuple[int, int]:
    """(QT, groups): a multi-token plan's T query tokens a sequence, G query heads a KV
    head, cut into groups of QT tokens, QT x G <= 8 rows of the kernel's MMA (at least
    one token), as few groups as that allows and their tokens spread evenly (T 5, G 2:
    two groups of 3, the last one padded). Decode (T 1): (1, 1)."""
    ng = ceil(t, max(1, 8 // g))
    return ceil(t, ng), ng


def query_rows(t: int, g: int) -> int:
    """The kernel's query rows a KV head: QT tokens (query_groups) x G query heads."""
    return query_groups(t, g)[0] * g


def _attn_name(d, dsub, bf16, nw, gp, tma, win, cap, pair=1, mq=False):
    b = lambda x: "true" if x else "false"  # noqa: E731
    p = f", {pair}, true" if mq else f", {pair}" if pair != 1 else ""
    if split(d) > 1:
        if tma:
            p = f", {pair}, {b(mq)}, true"
        return f"pq_attn_split<{d}, {dsub}, {b(bf16)}, {nw}, {gp}, {b(win)}, {b(cap)}{p}>"
    return f"pq_attn<{d}, {dsub}, {b(bf16)}, {nw}, {gp}, {b(tma)}, {b(win)}, {b(cap)}{p}>"


def _merge_name(d, bf16, mq=False):
    return f"pq_merge<{d}, {'true' if bf16 else 'false'}{', true' if mq else ''}>"


def _attn_smem(d: int, dsub: int, gp: int, nw: int, tma: bool = False) -> int:
    """GP > 0, dsub 2: K and V tables, 64 KiB each (256-byte code rows), + per warp a ring
    of code tiles (32 * M bytes each, M = d/2; 4 deep up to 12 warps, else 3: attention.cuh
    cf_stages), + with TMA the bulk copies' mbarrier (16 B). GP > 0, dsub 4: everything up
    to the end of the V table at shared-window address T4_V + 64 KiB = 192 KiB (the rings
    and the mbarrier below T4_K). d 256 (split): those of
    d 128 per CTA, the ring one or two stages shorter past 8 / 12 warps, + the score
    exchange (2 x 512 B and 2 mbarriers a warp; for dsub 4 past the V table: a cluster
    kernel's shared window starts too high for it to fit below T4_K)."""
    if dsub == 4:
        return 196608 + (nw * (1024 + 16) if split(d) > 1 else 0)
    if split(d) > 1:
        stages = 4 if nw <= 8 else 3 if nw <= 12 else 2
        return 131072 + nw * stages * 16 * (d // 2) + 16 + nw * (1024 + 16)
    stages = 4 if nw <= 12 else 3
    return 131072 + nw * stages * 16 * d + 16 * tma


@dataclass(slots=True, kw_only=True)
class CudaPQPlan(DecodePlan):
    """A PQ DecodePlan for attention.cu: items [capacity, 5] int32 (b, pq_lo, pq_hi,
    tail_lo, tail_hi), one thread block per (item, KV head); lse_part is base-2. dtype:
    that of q, out, the tail and the codebooks (fp16 or bf16, supports()). windowed: made
    with window starts, run by the kernel's WIN build (a PQ range may start inside a
    tile); softcap > 0 by its CAP build. A multi-token plan's item rows are (sequence,
    query group) pairs, b * groups + j (query_groups), item_ptr has B * groups + 1
    entries, and o_part / lse_part hold Hkv x QT x G rows an item."""
    item_width = 5
    dtype: torch.dtype
    num_warps: int
    item_tokens: int = 0        # mean PQ tokens per item (picks the codebook staging)
    windowed: bool = False
    tiles_per_step_2bit: int = 2     # the dsub-4 tile loop's step (tunables.TILES_PER_STEP_2BIT)
    _fns: dict = field(default_factory=dict)

    @property
    def groups(self) -> tuple[int, int]:
        """(QT, groups a sequence): query_groups of this plan."""
        return query_groups(self.query_tokens, self.num_qo_heads // self.num_kv_heads)

    def rows(self, sealed_lens, tail_lens, *starts) -> tuple[list[int], list[int]]:
        if starts and not self.windowed:
            # its kernel (captured in a graph, maybe) reads every PQ range from a tile's start
            raise ValueError("this plan was made without window starts; plan a windowed layer with them")
        sl, tl_, ss, ts = pq_ranges(sealed_lens, tail_lens, *starts, block_size=self.block_size)
        check_batch(self, sl)
        check_new_tokens(self.query_tokens, tl_)
        eq = _tail_eq(self.num_warps)
        vl, vt, vs, vts = _virtual(sl, tl_, ss, ts, self.query_tokens, self.num_qo_heads // self.num_kv_heads)
        items, ptr_ = fit(lambda c: _items(vl, vt, c, eq, vs, vts, whole_tail=self.query_tokens > 1),
                          self.chunk0, self.items.shape[0], 5)
        self.item_tokens = _item_tokens(vl, vs, ptr_)
        self.sealed_cols = max([x // self.block_size for x in sl] + [0])
        self.tail_cols = max([ceil(x, self.tail_block_size) for x in tl_] + [0])
        return items, ptr_

    def _fn(self, kind, *key):
        fn = self._fns.get((kind, key))
        if fn is None:
            dev = self.items.device
            if kind == "attn":
                fn = build.function("attention.cu", _attn_name(*key), dev)
                fn.max_dynamic_shared_size_bytes = _attn_smem(key[0], key[1], key[4], key[3], key[5])
            else:
                fn = build.function("merge.cu", _merge_name(*key), dev)
            self._fns[(kind, key)] = fn
        return fn

    def warm(self, dsubs=(2, 4)):
        """Compile + load the kernels (outside any graph capture)."""
        bf16 = self.dtype == torch.bfloat16
        for dsub in dsubs:
            gp = group(query_rows(self.query_tokens, self.num_qo_heads // self.num_kv_heads), dsub)
            for tma in ((False, True) if self._tma(gp) else (False,)):
                self._fn("attn", self.head_dim, dsub, bf16, self.num_warps, gp, tma, self.windowed,
                         self.softcap > 0, self._step(dsub), self.query_tokens > 1)
        self._fn("merge", self.head_dim, bf16, self.query_tokens > 1)

    def _step(self, dsub: int) -> int:
        """16-token tiles per step of the kernel's tile loop (attention.cu PAIR)."""
        return self.tiles_per_step_2bit if dsub == 4 else 1

    def _tma(self, gp: int) -> bool:
        """The bulk-copy build can run (warm() compiles it)."""
        return build.capability(build.index(self.items.device)) >= (9, 0)

    def _use_tma(self, gp: int) -> bool:
        """... and is the faster one for this plan's items (tunables.TMA_MAX_ITEM_TOKENS)."""
        return self.item_tokens <= tunables.TMA_MAX_ITEM_TOKENS and self._tma(gp)

    def run_pq(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
               tail_k, tail_v, tail_tables, scale: float, out=None, lse=None,
               trusted: bool = False, codebook_image: CodebookImage | None = None):
        """DecodePlan.run_pq. trusted skips the shape checks (~80 µs of a tiny call); dtypes
        and alignment are checked on every call (a few attribute reads): the router chose
        this plan for them, and a tensor that breaks them would be read as garbage or fault
        the context. With codebook_image, plans of short items stage the codebooks by bulk
        copies, without it through registers (same results)."""
        dt = self.dtype
        for name, t in (("q", q), ("k_codebook", k_codebook), ("v_codebook", v_codebook),
                        ("tail_k", tail_k), ("tail_v", tail_v)):
            if getattr(t, "dtype", None) != dt:
                raise ValueError(f"{name} must be {dt}, the dtype this plan was made for; "
                                 f"got {getattr(t, 'dtype', type(t).__name__)}")
        if trusted:
            out, lse = self.unchecked_out(q, out, lse)
            dsub = k_codebook.shape[3]
        else:
            out, lse = self.check_q_out(q, out, lse)
            _, dsub = self.check_codes(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables)
            self.check_pool(tail_k, tail_v, tail_tables, ("tail_k", "tail_v", "tail_tables"),
                            self.tail_cols, same_strides=False)
            if codebook_image is not None:
                check(codebook_image.words, "codebook_image.words",
                      (self.num_kv_heads, IMG_WORDS * split(self.head_dim)),
                      (torch.int32,), q.device, contiguous=True)
        bad = misaligned(q, k_codes, v_codes, tail_k, tail_v, dsub)
        if bad is not None:
            raise ValueError(f"{bad}: address or strides not taken by the CUDA kernels' loads (aligned "
                             "vectors, block stride under 4 GiB); plan with aligned=False (the Triton "
                             "kernels) for such tensors")
        self._run(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, tail_k, tail_v,
                  tail_tables, scale, out, lse, dsub, codebook_image)
        return out, lse

    def _run(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, tail_k, tail_v,
             tail_tables, scale, out, lse, dsub, image):
        b, d, hkv, bs, t = (self.batch, self.head_dim, self.num_kv_heads, self.block_size,
                            self.query_tokens)
        cg = self.num_qo_heads // hkv
        ng = self.groups[1]
        g = query_rows(t, cg)
        hq = hkv * g
        # strides of q, out and lse between sequences, query tokens and query heads
        sq = (q.stride(0), 0, q.stride(1)) if t == 1 else (q.stride(0), q.stride(1), q.stride(2))
        so = (out.stride(0), 0, out.stride(1)) if t == 1 else (out.stride(0), out.stride(1), out.stride(2))
        sl = (lse.stride(0), 0) if t == 1 else (lse.stride(0), lse.stride(1))
        dev = self.items.device
        bf16 = self.dtype == torch.bfloat16
        n_items = self.items.shape[0]
        stream = build.stream(dev)
        if n_items > 0:
            gp = group(g, dsub)
            # An image built for another layout (another GQA group, dsub) is not this kernel's.
            img = (image.words if image is not None and image.layout == image_layout(hq, hkv, dsub)
                   and self._use_tma(gp) else None)
            fn = self._fn("attn", d, dsub, bf16, self.num_warps, gp, img is not None, self.windowed,
                          self.softcap > 0, self._step(dsub), t > 1)
            args = (ptr(q), i64(sq[0]), i64(sq[2]), ptr(self.items), ptr(self.o_part),
                    ptr(self.lse_part), ptr(k_codes), ptr(v_codes), i64(k_codes.stride(0)),
                    i64(k_codes.stride(1)), i64(v_codes.stride(0)), i64(v_codes.stride(1)),
                    ptr(k_codebook), ptr(v_codebook), ptr(sealed_tables),
                    i64(sealed_tables.stride(0)), ptr(tail_k), ptr(tail_v),
                    i64(tail_k.stride(0)), i64(tail_k.stride(1)), i64(tail_k.stride(2)),
                    i64(tail_v.stride(0)), i64(tail_v.stride(1)), i64(tail_v.stride(2)),
                    ptr(tail_tables), i64(tail_tables.stride(0)),
                    f32(scale * LOG2E), i32(hq), i32(g), i32(bs),
                    i32(self.tail_block_size), i32(bs.bit_length() - 1),
                    ptr(img) if img is not None else NULL, f32(self.softcap * LOG2E),
                    i64(sq[1]), i32(ng), i32(cg), i32(t))
            build.launch(fn, dev, (n_items, hkv, split(d)), (32 * self.num_warps,), args,
                         _attn_smem(d, dsub, gp, self.num_warps, img is not None), stream)
        fn = self._fn("merge", d, bf16, t > 1)
        build.launch(fn, dev, (b * ng, hq), (d,),
                     (ptr(self.o_part), ptr(self.lse_part), ptr(self.item_ptr), ptr(out),
                      i64(so[0]), i64(so[2]), ptr(lse), i64(sl[0]), i32(hq), i64(so[1]), i64(sl[1]),
                      i32(ng), i32(g), i32(cg), i32(t)), stream_=stream)


# ---------------------------------------------------------------------- plan

def _tail_eq(nw: int) -> int:
    return int(tunables.TAIL_TILES * 16 * nw)


def _tile_base(start: int) -> int:
    """The first token of the 16-token tile holding `start`: where the WIN build's tiles
    of a PQ range that starts at `start` begin."""
    return start // 16 * 16


def _item_tokens(sl, ss, ptr_) -> int:
    return sum(n - _tile_base(a) for n, a in zip(sl, ss)) // max(1, ptr_[-1])


def _window_tokens(sl, tl_, ss, ts, eq: int) -> int:
    """What a plan's items cover, in PQ tokens (each tail at eq tokens when eq > 0)."""
    pq = sum(n - _tile_base(a) for n, a in zip(sl, ss))
    return pq + sum((eq if eq else n - a) for n, a in zip(tl_, ts) if n > a)


def _items(sl, tl_, chunk, tail_eq=0, ss=None, ts=None, whole_tail=False):
    """[b, pq_lo, pq_hi, tail_lo, tail_hi] work items over each sequence's PQ tokens [ss,
    sl) and tail tokens [ts, tl_) (ss / ts: a window's starts, None: zeros). The PQ items
    tile the range from ss's tile (_tile_base) on, in whole tiles; the first one says ss
    itself (the kernel masks the tokens before it). Each sequence's tail (its first
    `chunk` tokens; whole_tail: all of it, which a multi-token plan's causal rows need)
    joins its last PQ item. tail_eq: what that tail costs in PQ tokens
    (tunables.TAIL_TILES): a sequence cut into k > 1 items gets k equal shares of PQ +
    tail_eq, the last one tail_eq fewer PQ tokens (none: the tail alone, a block with no
    codebooks to stage)."""
    items, ptr_ = [], [0]
    for b, (ns, nt) in enumerate(zip(sl, tl_)):
        s0, t0 = (ss[b] if ss else 0), (ts[b] if ts else 0)
        base = _tile_base(s0)
        npq, ntl = ns - base, nt - t0         # tokens the items read: whole PQ tiles, the tail
        mine = []
        eq = tail_eq if ntl > 0 else 0
        # rounded, not ceil: the plan's chunk is the grid's total over its blocks per head
        k = max(1, round((npq + eq) / chunk)) if npq > 0 else 0
        if k > 1 and eq > 0:
            last = max(0, (npq + eq) // k - eq) // 16 * 16
            share = ceil(ceil(npq - last, k - 1), 16) * 16
            lo = 0
            while lo < npq - last:
                hi = min(npq - last, lo + share)
                mine.append([b, base + lo, base + hi, 0, 0])
                lo = hi
            mine.append([b, base + npq - last, ns, 0, 0] if last > 0 else [b, 0, 0, 0, 0])
        else:
            for lo in range(0, npq, chunk):
                mine.append([b, base + lo, base + min(npq, lo + chunk), 0, 0])
        if mine:
            mine[0][1] = s0                   # the first item starts at the window, mid-tile maybe
        t_lo = t0
        t_chunk = max(ntl, 1) if whole_tail else chunk
        if ntl > 0 and mine:
            take = min(ntl, t_chunk)
            mine[-1][3:] = [t0, t0 + take]
            t_lo = t0 + take
        for lo in range(t_lo, nt, t_chunk):
            mine.append([b, 0, 0, lo, min(nt, lo + t_chunk)])
        for it in mine:
            items += it
        ptr_.append(len(items) // 5)
    return items, ptr_


# What starting a block costs beyond its tokens (codebook staging, epilogue, its share of
# the merge), in tokens of one KV head: ~7 us at the ~150 tokens/us a block streams on an H100.
ITEM_OVERHEAD_TOKENS = 1024


def _wave_chunk(total: int, batch: int, hkv: int, num_sms: int, min_chunk: int,
                max_split: int = 16) -> int | None:
    """Chunk for a plan that needs more than one wave of blocks (one resident block per SM).
    Cut every sequence into k items, k minimising waves(k) * (tokens per item + overhead)
    for sequences of the mean length: one item per sequence leaves the last wave almost
    empty just past a multiple of the SMs (69 sequences x 8 KV heads = 552 blocks = 4.2
    waves of 132 run as 5 waves of 32K tokens; k = 3 runs 13 waves of 11K). Measured, the
    gain is smaller than the wave count says (a part-empty wave gets the whole memory
    bandwidth): Llama-3-8B geometry, B=69 at 32K, 41.06 -> 40.02 ms a decode step
    (bench/bench_decode.py --batches c=69). None: keep one item per sequence."""
    mean = max(total, 1) / max(batch, 1)

    def cost(k: int) -> float:
        return ceil(batch * k * hkv, num_sms) * (mean / k + ITEM_OVERHEAD_TOKENS)
    k = min(range(1, max_split + 1), key=lambda k: (cost(k), k))
    return max(min_chunk, ceil(ceil(int(mean), k), 16) * 16) if k > 1 else None


def check_new_tokens(t: int, tail_lens: list[int]) -> None:
    """A multi-token plan's tails hold their T new tokens."""
    if t > 1 and any(n < t for n in tail_lens):
        raise ValueError(f"tail_lens: each sequence's fp16 range must hold its {t} new tokens")


def _virtual(sl, tl_, ss, ts, t: int, g: int):
    """The lengths (and starts) of a plan's item rows: decode (t 1) its sequences; a
    multi-token plan a row per (sequence, query group), whose tail ends at the group's
    last query token (query_groups)."""
    if t == 1:
        return sl, tl_, ss, ts
    qt, ng = query_groups(t, g)
    rep_ = lambda xs: [x for x in xs for _ in range(ng)]     # noqa: E731
    vt = [n - (t - min(t, qt * (j + 1))) for n in tl_ for j in range(ng)]
    return rep_(sl), vt, rep_(ss), rep_(ts)


def plan_pq(sl: list[int], tl_: list[int], ss: list[int] | None = None, ts: list[int] | None = None, *,
            num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            tail_block_size: int, device, dtype: torch.dtype, target_ctas: int | None = None,
            num_warps: int | None = None, spare_items: int | None = None,
            softcap: float = 0.0, query_tokens: int = 1) -> CudaPQPlan:
    """sl / tl_: host lists of sealed (multiples of block_size) / tail lengths; ss / ts:
    a window's start in each (None: zeros, and a plan whose update() takes none; given,
    the kernel's WIN build). One block per (item, KV head) and one resident block per SM
    (the codebooks take most of its shared memory): items are cut so that about
    target_ctas (default: #SMs) blocks run. spare_items: room for update()
    (router.plan_decode); softcap > 0: the CAP build. query_tokens T > 1: the last T
    tail tokens of each sequence are its new tokens, attended causally (no window)."""
    windowed = ss is not None or ts is not None
    if windowed and query_tokens > 1:
        raise ValueError("sliding windows: a multi-token plan does not take start indices")
    sl, tl_, ss, ts = pq_ranges(sl, tl_, ss, ts, block_size=block_size)
    check_new_tokens(query_tokens, tl_)
    batch, tail_cols = len(sl), max([ceil(x, tail_block_size) for x in tl_] + [0])
    sl, tl_, ss, ts = _virtual(sl, tl_, ss, ts, query_tokens, num_qo_heads // num_kv_heads)
    whole = query_tokens > 1
    dev = torch.device(device)
    nw = num_warps or tunables.NUM_WARPS
    if target_ctas is None:
        target_ctas = build.num_sms(build.index(dev))
    heads = num_kv_heads * split(head_dim)       # CTAs per item
    per_head = max(1, target_ctas // heads)
    eq = _tail_eq(nw)
    total = _window_tokens(sl, tl_, ss, ts, eq)
    chunk = max(16 * nw, ceil(ceil(max(total, 1), per_head), 16) * 16)
    items, ptr_ = _items(sl, tl_, chunk, eq, ss, ts, whole)
    if len(items) // 5 * heads > target_ctas:
        better = _wave_chunk(total, len(sl), heads, target_ctas, 16 * nw)
        if better is not None:
            chunk = better
            items, ptr_ = _items(sl, tl_, chunk, eq, ss, ts, whole)
    n = len(items) // 5
    cap = capacity(n, len(sl), spare_items)
    if cap is not None:     # empty items past item_ptr[-1]: the kernel returns at once
        items += [0] * (5 * (cap - n))
        n = cap
    d = head_dim
    rows = num_kv_heads * query_rows(query_tokens, num_qo_heads // num_kv_heads)
    return CudaPQPlan(
        items=to_device(torch.tensor(items, dtype=torch.int32).reshape(n, 5), dev),
        item_ptr=to_device(torch.tensor(ptr_, dtype=torch.int32), dev),
        o_part=torch.empty(max(n, 1), rows, d, dtype=torch.float32, device=dev),
        lse_part=torch.empty(max(n, 1), rows, dtype=torch.float32, device=dev),
        batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=d,
        block_size=block_size, tail_block_size=tail_block_size,
        sealed_cols=max([x // block_size for x in sl] + [0]), tail_cols=tail_cols,
        has_pq=True, chunk0=chunk, dtype=dtype, num_warps=nw, item_tokens=_item_tokens(sl, ss, ptr_),
        windowed=windowed, softcap=softcap, tiles_per_step_2bit=tunables.TILES_PER_STEP_2BIT,
        query_tokens=query_tokens)
