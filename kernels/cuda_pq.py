"""PQ decode attention and PQ encode as CUDA C++ (NVRTC through CuPy RawModule).

Source: kernels/cuda_pq.cu (design notes at its top). Same contracts as the Triton
versions in decode_attention.py / pq_encode.py:

    plan = plan_pq_decode(sealed_lens, tail_lens, num_qo_heads=.., ...)   # host, once per step
    out, lse = plan.run_pq(q, k_codes, v_codes, k_cb, v_cb, sealed_tables,
                           tail_k, tail_v, tail_tables, scale, out=, lse=)   # per layer

run_pq allocates nothing when out/lse are given, never synchronises, and is CUDA-graph
capturable (the kernels are loaded at plan time and launched on torch's current stream).
`available()` is False where cupy does not import (CPU machines never import it) or
KVSTORE_CUDA_PQ=0; `supports(...)` says which shapes the kernels take; everything else
stays on the Triton kernels (decode_attention.plan_pq_decode routes).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.cuda.pinned import copy_into, to_device

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_pq.cu")
_cupy = None
_cupy_failed = False
_modules: dict = {}
_streams: dict = {}
NUM_WARPS = int(os.environ.get("KVSTORE_CUDA_PQ_WARPS", "12"))
# conflict-free codebook gathers for dsub 2 (cuda_pq.cu, GP > 0); 0 = the swizzled layout
CONFLICT_FREE = os.environ.get("KVSTORE_CUDA_PQ_CF", "1") != "0"
# CF on sm_90: the codebooks reach shared memory as bulk copies of a pre-laid-out image
# (CodebookImage, passed by the codebooks' owner); 0 = staged through registers (also
# used for calls that pass no image)
TMA = os.environ.get("KVSTORE_CUDA_PQ_TMA", "1") != "0"
# ... but only for plans whose items hold at most this many PQ tokens on average. The bulk
# copy starts a block ~4 us sooner, which is what short items are made of; past ~16K
# tokens an item's tile loop dominates and the register-staging build's loop runs 2-5 %
# faster (bench_cuda_pq, two runs: B=8 128K 403 vs 417 us, B=32 32K 420 vs 431, B=32 128K
# 1698 vs 1760; a tie at 16K; measured, not explained: both loops are ~422 SASS
# instructions). Larger than any item: TMA whenever it can run.
TMA_MAX_ITEM_TOKENS = int(os.environ.get("KVSTORE_CUDA_PQ_TMA_MAX_ITEM", "16384"))
# power-of-two block sizes get the instantiation that shifts and masks (cuda_pq.cu
# BS_POW2); False = the generic one (unsigned division, any multiple of 16) for every block
# size: tests check the two agree, the bench times both
BS_POW2 = True
# debug / experiments only: extra NVRTC defines ("-DPQ_STAMPS ..."), the raw modules
# (bench/attrib_cuda_pq.py reads the stamp buffer out of them), launches to leave out
DEFINES = tuple(os.environ.get("KVSTORE_CUDA_PQ_DEFS", "").split())
_raw: dict = {}
SKIP: set = set()
# A sequence's fp16 tail runs at the end of one block, one 16-token tile per warp: a
# single warp's serial chain of dependent loads and arithmetic, about as long as
# TAIL_TILES PQ tiles of that warp (Session 4 stamps: ~5 us vs ~1.15 us per PQ tile). _items
# counts a tail of up to 16 * warps tokens as 16 * warps * TAIL_TILES tokens of PQ work and
# takes them off the PQ share of the block that has it. 0: the tail is free (as before).
TAIL_TILES = float(os.environ.get("KVSTORE_CUDA_PQ_TAIL_TILES", "4"))



def _cp():
    global _cupy, _cupy_failed
    if _cupy is None and not _cupy_failed:
        try:
            import cupy  # noqa: F401
            _cupy = cupy
        except Exception:   # ImportError, missing CUDA libraries, ...
            _cupy_failed = True
    return _cupy


def available() -> bool:
    if os.environ.get("KVSTORE_CUDA_PQ", "1") == "0":
        return False
    return torch.cuda.is_available() and _cp() is not None


def supports(*, num_qo_heads, num_kv_heads, head_dim, block_size, device) -> bool:
    dev = torch.device(device)
    if dev.type != "cuda" or not available():
        return False
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        return False
    g = num_qo_heads // num_kv_heads
    return (head_dim in (64, 128) and 1 <= g <= 8 and block_size % 16 == 0
            and _capability(_index(dev)) >= (8, 0))


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _function(name: str, device: torch.device):
    """Compile (once per device) the instantiation `name` of cuda_pq.cu."""
    key = (device.index, name)
    fn = _modules.get(key)
    if fn is None:
        cp = _cp()
        with cp.cuda.Device(device.index or 0):
            major, minor = torch.cuda.get_device_capability(device)
            src = open(_SRC).read()
            mod = cp.RawModule(code=src, options=("-std=c++17", f"-arch=sm_{major}{minor}",
                                                  "--use_fast_math") + DEFINES,
                               name_expressions=[name])
            fn = mod.get_function(name)
        _modules[key] = fn
        _raw[key] = mod
    return fn


def _stream(device: torch.device):
    cp = _cp()
    s = torch.cuda.current_stream(device)
    key = (device.index, s.cuda_stream)
    ext = _streams.get(key)
    if ext is None:
        ext = cp.cuda.ExternalStream(s.cuda_stream, device.index or 0)
        _streams[key] = ext
    return ext


_stream_kwarg = True      # cupy's Function takes stream=: no Device / stream contexts per launch


def _launch(fn, device, grid, block, args, shared_mem=0, stream=None):
    """Launch on torch's current stream of device (stream: that stream's cupy
    wrapper, from _stream, when the caller launches several kernels)."""
    global _stream_kwarg
    cp = _cp()
    idx = device.index or 0
    if _stream_kwarg and cp.cuda.runtime.getDevice() == idx:
        # The launch itself takes ~5 µs; the two context managers took ~25 more.
        try:
            fn(grid, block, args, shared_mem=shared_mem, stream=stream or _stream(device))
            return
        except TypeError:       # a cupy without stream=
            _stream_kwarg = False
    with cp.cuda.Device(idx), (stream or _stream(device)):
        fn(grid, block, args, shared_mem=shared_mem)


# Kernel arguments as numpy scalars (cupy packs them by type). numpy is imported
# once: an import statement in each of these cost ~1 µs a call, 30 a launch.
def _p(t: torch.Tensor):
    return np.uint64(t.data_ptr())


_i64, _i32, _f32 = np.int64, np.int32, np.float32


def _attn_name(d, dsub, bf16, nw, gp=0, tma=False, pow2=True):
    b = lambda x: "true" if x else "false"  # noqa: E731
    return f"pq_attn<{d}, {dsub}, {b(bf16)}, {nw}, {gp}, {b(tma)}, {b(pow2)}>"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _group(g: int, dsub: int, conflict_free: bool) -> int:
    """GP of the kernel: query heads per row group of the MMA's A operand when the K
    gathers are conflict free (the 16 rows hold 16 / GP rotated copies), else 0."""
    if not conflict_free or dsub != 2:
        return 0
    return 2 if g <= 2 else 4 if g <= 4 else 8


def _attn_smem(d: int, gp: int, nw: int, tma: bool = False) -> int:
    """GP > 0: K and V tables, 64 KiB each (256-byte code rows), + per warp a ring of code
    tiles (32 * M bytes each, M = d/2; 4 deep up to 12 warps, else 3: cuda_pq.cu
    cf_stages), + with TMA the bulk copies' mbarrier (16 B). Else the two tables, d KiB."""
    stages = 4 if nw <= 12 else 3
    return 131072 + nw * stages * 16 * d + 16 * tma if gp else 1024 * d


IMG_WORDS = 32768     # cuda_pq.cu IMG_BYTES / 4: one KV head's image


@functools.lru_cache(maxsize=None)
def _image_index(m: int, vg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word positions in a head's image of K / V codebook word (m, code), flat m*256 + code
    (cuda_pq.cu, the CF layouts): K word at code*64 + 32hh + 4i + c for m = c*MQ + 8hh + i;
    V (vg > 0) at 16384 + code*64 + m, else (GP 8) 16384 + (m/8)*2048 + code*8 + m%8."""
    mm = torch.arange(m).unsqueeze(1)
    code = torch.arange(256).unsqueeze(0)
    mq = m // 4
    c, r = mm // mq, mm % mq
    k = code * 64 + 32 * (r // 8) + 4 * (r % 8) + c
    v = 16384 + (code * 64 + mm if vg else (mm // 8) * 2048 + code * 8 + mm % 8)
    return k.reshape(-1), v.reshape(-1)


def build_codebook_image(k_codebook: torch.Tensor, v_codebook: torch.Tensor, vg: int) -> torch.Tensor:
    """k/v_codebook [Hkv, M, 256, 2] fp16/bf16 -> int32 [Hkv, IMG_WORDS]: per KV head, the
    bytes the CF kernel keeps in shared memory (its first 128 KiB); unused words are 0."""
    hkv, m = k_codebook.shape[:2]
    ik, iv = (t.to(k_codebook.device) for t in _image_index(m, vg))
    img = torch.zeros(hkv, IMG_WORDS, dtype=torch.int32, device=k_codebook.device)
    img[:, ik] = k_codebook.contiguous().view(torch.int32).reshape(hkv, -1)
    img[:, iv] = v_codebook.contiguous().view(torch.int32).reshape(hkv, -1)
    return img


@dataclass(slots=True, frozen=True)
class CodebookImage:
    """One layer's K and V codebooks as the bulk-copy kernel stages them: words int32
    [Hkv, IMG_WORDS] (build_codebook_image), layout the V layout they were built for
    (image_layout). Derived data with an owner: whoever owns the codebooks builds the
    image and rebuilds it, in place, whenever the codebooks change. The kernels keep no
    copy of their own: a copy could not see an in-place update replayed under a CUDA
    graph, nor a write by another process into a mapped pool."""
    words: torch.Tensor
    layout: int


def image_layout(num_qo_heads: int, num_kv_heads: int, dsub: int) -> int | None:
    """The V layout (cuda_pq.cu VG) of the image the bulk-copy build reads for this
    geometry, or None: that build never runs for it (dsub 4, or no conflict-free GP)."""
    gp = _group(num_qo_heads // num_kv_heads, dsub, True)
    return None if gp == 0 else (gp if gp < 8 else 0)


def codebook_images(k_codebooks: torch.Tensor, v_codebooks: torch.Tensor, num_qo_heads: int,
                    words: torch.Tensor | None = None) -> torch.Tensor | None:
    """k/v_codebooks [L, Hkv, M, 256, dsub] fp16/bf16 on a GPU -> int32 [L, Hkv, IMG_WORDS]
    of every layer's image, written into `words` when given (same address: graphs
    captured with it read the new codebooks), or None when no kernel here would read it
    (no Hopper GPU, no CUDA kernels, a layout without one)."""
    if not k_codebooks.is_cuda or not available() or not TMA:
        return None
    if _capability(_index(k_codebooks.device)) < (9, 0):
        return None
    nl, hkv, m, _, dsub = k_codebooks.shape
    vg = image_layout(num_qo_heads, hkv, dsub)
    if vg is None or m * dsub not in (64, 128):
        return None
    imgs = torch.stack([build_codebook_image(k_codebooks[i], v_codebooks[i], vg) for i in range(nl)])
    if words is None or words.shape != imgs.shape or words.device != imgs.device:
        return imgs
    return words.copy_(imgs)


def _merge_name(d, bf16):
    return f"pq_merge<{d}, {'true' if bf16 else 'false'}>"


# --------------------------------------------------------------------- attention

@dataclass(slots=True)
class CudaPQPlan:
    """Work items [n, 5] int32 (b, pq_lo, pq_hi, tail_lo, tail_hi), one thread block per
    (item, KV head); item_ptr [B + 1]; partials o_part fp32 [n, Hq, d], lse_part [n, Hq]
    (base-2); `fallback_args`: how to build the Triton plan for inputs the kernels do not
    take (fp32 q, codebook dtype != q dtype): built on first such call, then reused."""
    items: torch.Tensor
    item_ptr: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tail_block_size: int
    sealed_cols: int
    tail_cols: int
    num_warps: int
    fallback_args: dict
    conflict_free: bool = True
    has_pq: bool = True
    chunk0: int = 16
    item_tokens: int = 0        # mean PQ tokens per item (picks the codebook staging)
    _fallback: object = None
    _fns: dict = field(default_factory=dict)

    def update(self, sealed_lens, tail_lens) -> "CudaPQPlan":
        """Re-partition for new lengths into this plan's buffers (see
        decode_attention.DecodePlan.update: for CUDA graphs)."""
        items, ptr, sl, tl_ = self._rows(sealed_lens, tail_lens)
        copy_into(self.items, torch.tensor(items, dtype=torch.int32))
        copy_into(self.item_ptr, torch.tensor(ptr, dtype=torch.int32))
        if self._fallback is not None:
            self._fallback.update(sl, tl_)
        else:
            self.fallback_args.update(sealed_lens=sl, tail_lens=tl_)
        return self

    def rows(self, sealed_lens, tail_lens) -> tuple[list[int], list[int]]:
        """update() on the host, for this plan's kernels only (not its Triton
        fallback): (items, item_ptr) as flat lists, items padded to capacity."""
        return self._rows(sealed_lens, tail_lens)[:2]

    def _rows(self, sealed_lens, tail_lens):
        from .decode_attention import _fit, _pq_lens
        sl, tl_ = _pq_lens(sealed_lens, tail_lens, block_size=self.block_size)
        if len(sl) != self.batch:
            raise ValueError(f"update: the plan is for a batch of {self.batch}, got {len(sl)} lengths")
        eq = _tail_eq(self.num_warps)
        items, ptr = _fit(lambda c: _items(sl, tl_, c, eq), self.chunk0, self.items.shape[0], 5)
        self.item_tokens = _item_tokens(sl, ptr)
        self.sealed_cols = max([x // self.block_size for x in sl] + [0])
        self.tail_cols = max([_ceil(x, self.tail_block_size) for x in tl_] + [0])
        return items, ptr, sl, tl_

    def _triton(self):
        if self._fallback is None:
            from . import decode_attention as da
            self._fallback = da.plan_pq_decode(**self.fallback_args, backend="triton")
        return self._fallback

    def _fn(self, kind, *key):
        fn = self._fns.get((kind, key))
        if fn is None:
            dev = self.items.device
            if kind == "attn":
                fn = _function(_attn_name(*key), dev)
                fn.max_dynamic_shared_size_bytes = _attn_smem(key[0], key[4], key[3], key[5])
            else:
                fn = _function(_merge_name(*key), dev)
            self._fns[(kind, key)] = fn
        return fn

    def warm(self, dtypes=(torch.float16,), dsubs=(2, 4)):
        """Compile + load the kernels (outside any graph capture)."""
        for dt in dtypes:
            for dsub in dsubs:
                gp = _group(self.num_qo_heads // self.num_kv_heads, dsub, self.conflict_free)
                for tma in ((False, True) if self._tma(gp) else (False,)):
                    self._fn("attn", self.head_dim, dsub, dt == torch.bfloat16, self.num_warps, gp, tma,
                             self._bs_pow2())
            self._fn("merge", self.head_dim, dt == torch.bfloat16)

    def _bs_pow2(self) -> bool:
        """The BS_POW2 instantiation: shifts and masks for the block of a token."""
        return BS_POW2 and _pow2(self.block_size)

    def _tma(self, gp: int) -> bool:
        """The TMA build can run (warm() compiles it)."""
        return TMA and gp > 0 and _capability(_index(self.items.device)) >= (9, 0)

    def _use_tma(self, gp: int) -> bool:
        """... and is the faster one for this plan's items (TMA_MAX_ITEM_TOKENS)."""
        return self.item_tokens <= TMA_MAX_ITEM_TOKENS and self._tma(gp)

    def run_pq(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
               tail_k, tail_v, tail_tables, scale: float, out=None, lse=None,
               trusted: bool = False, codebook_image: CodebookImage | None = None):
        """Same arguments and result as DecodePlan.run_pq. trusted: the caller made
        every argument to this plan's measure (the engine, from its own pools): skip
        the shape/dtype checks (~80 µs of a tiny call); alignment still picks the
        kernel. codebook_image: this layer's image of k/v_codebook (its owner keeps it
        current); with it, plans of short items stage the codebooks by bulk copies,
        without it through registers (same results)."""
        dt = q.dtype if isinstance(q, torch.Tensor) else None
        if (dt not in (torch.float16, torch.bfloat16)
                or getattr(k_codebook, "dtype", None) != dt
                or getattr(v_codebook, "dtype", None) != dt
                or getattr(tail_k, "dtype", None) != dt):
            return self._triton().run_pq(q, k_codes, v_codes, k_codebook, v_codebook,
                                         sealed_tables, tail_k, tail_v, tail_tables, scale,
                                         out=out, lse=lse)
        if trusted:
            b, hq = self.batch, self.num_qo_heads
            out = torch.empty_like(q) if out is None else out
            lse = torch.empty(b, hq, dtype=torch.float32, device=q.device) if lse is None else lse
            m, dsub = k_codebook.shape[1], k_codebook.shape[3]
        else:
            out, lse, m, dsub = self._check_all(q, k_codes, v_codes, k_codebook, v_codebook,
                                                sealed_tables, tail_k, tail_v, tail_tables, out, lse)
            if codebook_image is not None:
                w = codebook_image.words
                if (not isinstance(w, torch.Tensor) or w.dtype != torch.int32 or w.device != q.device
                        or tuple(w.shape) != (self.num_kv_heads, IMG_WORDS) or not w.is_contiguous()):
                    raise ValueError(f"codebook_image.words must be contiguous int32 [{self.num_kv_heads}, "
                                     f"{IMG_WORDS}] on {q.device}")
        return self._run(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, tail_k, tail_v,
                         tail_tables, scale, out, lse, m, dsub, dt, codebook_image)

    def _check_all(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
                   tail_k, tail_v, tail_tables, out, lse):
        from .decode_attention import _FLOAT, _check, _check_table
        b, hq, d, hkv, bs = (self.batch, self.num_qo_heads, self.head_dim, self.num_kv_heads,
                             self.block_size)
        dev = self.items.device
        _check(q, "q", (b, hq, d), _FLOAT, dev)
        if out is None:
            out = torch.empty_like(q)
        else:
            _check(out, "out", (b, hq, d), (q.dtype,), q.device)
        if lse is None:
            lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
        else:
            _check(lse, "lse", (b, hq), (torch.float32,), q.device, last=False)
        if k_codebook.dim() != 4:
            raise ValueError(f"k_codebook must be [Hkv, M, 256, dsub], got {tuple(k_codebook.shape)}")
        m, dsub = k_codebook.shape[1], k_codebook.shape[3]
        if dsub not in (2, 4) or m * dsub != d:
            raise ValueError(f"k_codebook: need dsub in (2, 4) and M*dsub == head_dim, got M={m} dsub={dsub}")
        for name, cb in (("k_codebook", k_codebook), ("v_codebook", v_codebook)):
            _check(cb, name, (hkv, m, 256, dsub), (torch.float16, torch.bfloat16), q.device,
                   contiguous=True)
        nb = k_codes.shape[0] if k_codes.dim() == 4 else -1
        _check(k_codes, "k_codes", (nb, hkv, bs, m), (torch.uint8,), q.device)
        _check(v_codes, "v_codes", (nb, hkv, m, bs), (torch.uint8,), q.device)
        if k_codes.stride(2) != m or v_codes.stride(2) != bs:
            raise ValueError("k_codes / v_codes: each (block, head) slice must be contiguous")
        _check_table(sealed_tables, "sealed_tables", b, self.sealed_cols, q.device)
        nt = tail_k.shape[0] if tail_k.dim() == 4 else -1
        shape = (nt, hkv, self.tail_block_size, d)
        _check(tail_k, "tail_k", shape, _FLOAT, dev)
        _check(tail_v, "tail_v", shape, (tail_k.dtype,), tail_k.device)
        _check_table(tail_tables, "tail_tables", b, self.tail_cols, q.device)
        return out, lse, m, dsub

    def _run(self, q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, tail_k, tail_v,
             tail_tables, scale, out, lse, m, dsub, dt, image=None):
        b, hq, d, hkv, bs = (self.batch, self.num_qo_heads, self.head_dim, self.num_kv_heads,
                             self.block_size)
        dev = self.items.device
        # alignment for the vector loads (16 B code rows, 4/8 B fp16 pairs/quads)
        ew = 2 * dsub
        if (k_codes.data_ptr() % 16 or k_codes.stride(0) % 16 or k_codes.stride(1) % 16
                or v_codes.data_ptr() % 4 or v_codes.stride(0) % 4 or v_codes.stride(1) % 4
                or q.data_ptr() % 4 or q.stride(0) % 2 or q.stride(1) % 2
                or any(t.data_ptr() % ew or any(s % (ew // 2) for s in t.stride()[:3])
                       for t in (tail_k, tail_v))):
            return self._triton().run_pq(q, k_codes, v_codes, k_codebook, v_codebook,
                                         sealed_tables, tail_k, tail_v, tail_tables, scale,
                                         out=out, lse=lse)
        bf16 = dt == torch.bfloat16
        n_items = self.items.shape[0]
        stream = _stream(dev)
        if n_items > 0 and "attn" not in SKIP:
            # the conflict-free kernel streams V code rows with 16-byte async copies
            cf = self.conflict_free and not (v_codes.data_ptr() % 16 or v_codes.stride(0) % 16
                                             or v_codes.stride(1) % 16)
            gp = _group(hq // hkv, dsub, cf)
            # An image built for another V layout (another GQA group) is not this kernel's.
            img = (image.words if image is not None and image.layout == (gp if gp < 8 else 0)
                   and self._use_tma(gp) else None)
            fn = self._fn("attn", d, dsub, bf16, self.num_warps, gp, img is not None, self._bs_pow2())
            args = (_p(q), _i64(q.stride(0)), _i64(q.stride(1)), _p(self.items), _p(self.o_part),
                    _p(self.lse_part), _p(k_codes), _p(v_codes), _i64(k_codes.stride(0)),
                    _i64(k_codes.stride(1)), _i64(v_codes.stride(0)), _i64(v_codes.stride(1)),
                    _p(k_codebook), _p(v_codebook), _p(sealed_tables),
                    _i64(sealed_tables.stride(0)), _p(tail_k), _p(tail_v),
                    _i64(tail_k.stride(0)), _i64(tail_k.stride(1)), _i64(tail_k.stride(2)),
                    _i64(tail_v.stride(0)), _i64(tail_v.stride(1)), _i64(tail_v.stride(2)),
                    _p(tail_tables), _i64(tail_tables.stride(0)),
                    _f32(scale * 1.4426950408889634), _i32(hq), _i32(hq // hkv), _i32(bs),
                    _i32(self.tail_block_size), _i32(_log2_or_neg(bs)),
                    _p(img) if img is not None else np.uint64(0))
            _launch(fn, dev, (n_items, hkv), (32 * self.num_warps,), args,
                    _attn_smem(d, gp, self.num_warps, img is not None), stream)
        if "merge" in SKIP:
            return out, lse
        fn = self._fn("merge", d, bf16)
        _launch(fn, dev, (b, hq), (d,),
                (_p(self.o_part), _p(self.lse_part), _p(self.item_ptr), _p(out),
                 _i64(out.stride(0)), _i64(out.stride(1)), _p(lse), _i64(lse.stride(0)),
                 _i32(hq)), stream=stream)
        return out, lse


def _ceil(a, b):
    return -(-a // b)


def _log2_or_neg(n: int) -> int:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def _tail_eq(nw: int) -> int:
    return int(TAIL_TILES * 16 * nw)


def _item_tokens(sl, ptr) -> int:
    return sum(sl) // max(1, ptr[-1])


def _items(sl, tl_, chunk, tail_eq=0):
    """[b, pq_lo, pq_hi, tail_lo, tail_hi] work items; each sequence's tail (its first
    `chunk` tokens) joins its last PQ item. tail_eq: what that tail costs in PQ tokens
    (TAIL_TILES): a sequence cut into k > 1 items gets k equal shares of PQ + tail_eq, the
    last one tail_eq fewer PQ tokens (none: the tail alone, a block with no codebooks to
    stage)."""
    items, ptr = [], [0]
    for b, (ns, nt) in enumerate(zip(sl, tl_)):
        mine = []
        eq = tail_eq if nt > 0 else 0
        # rounded, not ceil: the plan's chunk is the grid's total over its blocks per head
        k = max(1, round((ns + eq) / chunk)) if ns > 0 else 0
        if k > 1 and eq > 0:
            last = max(0, (ns + eq) // k - eq) // 16 * 16
            share = _ceil(_ceil(ns - last, k - 1), 16) * 16
            lo = 0
            while lo < ns - last:
                hi = min(ns - last, lo + share)
                mine.append([b, lo, hi, 0, 0])
                lo = hi
            mine.append([b, ns - last, ns, 0, 0] if last > 0 else [b, 0, 0, 0, 0])
        else:
            for lo in range(0, ns, chunk):
                mine.append([b, lo, min(ns, lo + chunk), 0, 0])
        t_lo = 0
        if nt > 0 and mine:
            take = min(nt, chunk)
            mine[-1][3:] = [0, take]
            t_lo = take
        for lo in range(t_lo, nt, chunk):
            mine.append([b, 0, 0, lo, min(nt, lo + chunk)])
        for it in mine:
            items += it
        ptr.append(len(items) // 5)
    return items, ptr


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
    (bench/logs/bench_decode_s6_waves69.log). None: keep one item per sequence."""
    mean = max(total, 1) / max(batch, 1)

    def cost(k: int) -> float:
        return _ceil(batch * k * hkv, num_sms) * (mean / k + ITEM_OVERHEAD_TOKENS)
    k = min(range(1, max_split + 1), key=lambda k: (cost(k), k))
    return max(min_chunk, _ceil(_ceil(int(mean), k), 16) * 16) if k > 1 else None


def plan_pq_decode(sl: list[int], tl_: list[int], *, num_qo_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, tail_block_size: int, device,
                   target_ctas: int | None = None, num_warps: int | None = None,
                   fallback_args: dict | None = None,
                   spare_items: int | None = None,
                   conflict_free: bool | None = None) -> CudaPQPlan:
    """sl / tl_: host lists of sealed (multiples of block_size) / tail lengths.
    One block per (item, KV head) and one resident block per SM (the two codebooks take
    d KiB of shared memory): items are cut so that about target_ctas (default: #SMs)
    blocks run. spare_items: room for update() (decode_attention.plan_pq_decode)."""
    from .decode_attention import _capacity
    dev = torch.device(device)
    nw = num_warps or NUM_WARPS
    if target_ctas is None:
        target_ctas = _num_sms(_index(dev))
    per_head = max(1, target_ctas // num_kv_heads)
    eq = _tail_eq(nw)
    total = sum(sl) + sum(eq if eq and t > 0 else t for t in tl_)
    chunk = max(16 * nw, _ceil(_ceil(max(total, 1), per_head), 16) * 16)
    items, ptr = _items(sl, tl_, chunk, eq)
    if len(items) // 5 * num_kv_heads > target_ctas:
        better = _wave_chunk(total, len(sl), num_kv_heads, target_ctas, 16 * nw)
        if better is not None:
            chunk = better
            items, ptr = _items(sl, tl_, chunk, eq)
    n = len(items) // 5
    cap = _capacity(n, len(sl), spare_items)
    if cap is not None:     # empty items past item_ptr[-1]: the kernel returns at once
        items += [0] * (5 * (cap - n))
        n = cap
        if fallback_args:
            fallback_args = dict(fallback_args, spare_items=spare_items)
    hq, d = num_qo_heads, head_dim
    plan = CudaPQPlan(
        items=to_device(torch.tensor(items, dtype=torch.int32).reshape(n, 5), dev),
        item_ptr=to_device(torch.tensor(ptr, dtype=torch.int32), dev),
        o_part=torch.empty(max(n, 1), hq, d, dtype=torch.float32, device=dev),
        lse_part=torch.empty(max(n, 1), hq, dtype=torch.float32, device=dev),
        batch=len(sl), num_qo_heads=hq, num_kv_heads=num_kv_heads, head_dim=d,
        block_size=block_size, tail_block_size=tail_block_size,
        sealed_cols=max([x // block_size for x in sl] + [0]),
        tail_cols=max([_ceil(x, tail_block_size) for x in tl_] + [0]),
        num_warps=nw, fallback_args=fallback_args or {}, chunk0=chunk,
        item_tokens=_item_tokens(sl, ptr),
        conflict_free=CONFLICT_FREE if conflict_free is None else conflict_free)
    return plan


def pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables, sealed_lens,
                        tail_k, tail_v, tail_tables, tail_lens, scale):
    """Same contract as reference.pq_decode_attention (plans, then runs)."""
    from . import decode_attention as da
    return da.pq_decode_attention(q, k_codes, v_codes, k_codebook, v_codebook, sealed_tables,
                                  sealed_lens, tail_k, tail_v, tail_tables, tail_lens, scale)


# ------------------------------------------------------------------------ encode

@dataclass(slots=True)
class CudaPQEncodePlan:
    """cpre [Hkv, M, 256, 4 | 8] fp32: (-2c, ||c||^2) per centroid, float4-aligned, for the
    brute-force kernel. dsub 2 also gets cell tables (kernels/pq_cells.py): cents
    [Hkv, M, 256, 2] fp32, bp [Hkv, M, 2, G+1] fp32, recs [Hkv, M, G*G, cmax+1] u8
    (count, candidates); `cells` None = brute force only."""
    cpre: torch.Tensor
    num_kv_heads: int
    m: int
    dsub: int
    tokens_per_thread: int = 4
    cells: dict | None = None
    num_sms: int = 132

    def run(self, x, slots, k_codes=None, v_codes=None) -> None:
        from .pq_encode import check_encode_args
        hkv, m, dsub = self.num_kv_heads, self.m, self.dsub
        codes, bs, so_off, so_m = check_encode_args(x, slots, k_codes, v_codes, hkv, m, dsub, self.cpre.device)
        n = x.shape[0]
        if n == 0:
            return
        xb = "true" if x.dtype == torch.bfloat16 else "false"
        xf = "true" if x.dtype == torch.float32 else "false"
        s64 = "true" if slots.dtype == torch.int64 else "false"
        if self.cells is not None and _cells_aligned(x):
            c = self.cells
            tpb = c["tokens_per_block"] or _tokens_per_block(n, m // 16 * hkv, self.num_sms)
            vec = int(so_m == 1 and codes.data_ptr() % 4 == 0 and codes.stride(0) % 4 == 0
                      and codes.stride(1) % 4 == 0 and so_off % 4 == 0)
            fn = _function(f"pq_encode_cells<{c['grid']}, {c['cmax']}, {xb}, {xf}, {s64}>", x.device)
            _launch(fn, x.device, (m // 16, _ceil(n, tpb), hkv), (256,),
                    (_p(x), _i64(x.stride(0)), _i64(x.stride(1)), _p(c["cents"]), _p(c["bp"]),
                     _p(c["recs"]), _p(slots), _p(codes), _i64(codes.stride(0)),
                     _i64(codes.stride(1)), _i64(so_off), _i64(so_m), _i32(n), _i32(m),
                     _i32(bs), _i32(tpb), _i32(vec)))
            return
        t = self.tokens_per_thread
        mg = 8 if dsub == 2 else 4
        fn = _function(f"pq_encode<{dsub}, {t}, {mg}, {xb}, {xf}, {s64}>", x.device)
        _launch(fn, x.device, (_ceil(n, 32 * t), hkv, m // mg), (32 * mg,),
                (_p(x), _i64(x.stride(0)), _i64(x.stride(1)), _p(self.cpre), _p(slots),
                 _p(codes), _i64(codes.stride(0)), _i64(codes.stride(1)), _i64(so_off),
                 _i64(so_m), _i32(n), _i32(m), _i32(bs)))


def _cells_aligned(x: torch.Tensor) -> bool:
    """The cell kernel loads 8 x values per thread as 16 B (fp16/bf16) or 2 x 16 B (fp32)."""
    v = 8 if x.element_size() == 2 else 4
    return x.data_ptr() % 16 == 0 and x.stride(0) % v == 0 and x.stride(1) % v == 0


def _tokens_per_block(n: int, groups: int, num_sms: int) -> int:
    """About 8 blocks per SM in total (6 fit at once): enough tokens per block to amortise
    staging 36 KB of centroids, enough blocks to keep the tail wave short."""
    return max(64, _ceil(_ceil(n * groups, 8 * num_sms), 64) * 64)


def encode_supported(codebook: torch.Tensor) -> bool:
    if not (codebook.is_cuda and available()) or codebook.dim() != 4:
        return False
    _, m, c, dsub = codebook.shape
    return c == 256 and dsub in (2, 4) and m % (8 if dsub == 2 else 4) == 0


def plan_pq_encode(codebook: torch.Tensor, tokens_per_thread: int = 4, cells: bool = True,
                   grid: int = 32, cmax: int = 7, tokens_per_block: int = 0) -> CudaPQEncodePlan:
    """codebook [Hkv, M, 256, dsub]. dsub 2 with M % 16 == 0 (and not fp64, whose reference
    arithmetic is fp64) also builds the cell tables on the codebook's device."""
    hkv, m, c, dsub = codebook.shape
    cb = codebook.float()
    pre = torch.zeros(hkv, m, 256, 4 if dsub == 2 else 8, dtype=torch.float32,
                      device=codebook.device)
    pre[..., :dsub] = -2.0 * cb
    pre[..., 2 if dsub == 2 else 4] = (cb * cb).sum(-1)
    tabs = None
    if (cells and dsub == 2 and m % 16 == 0 and codebook.dtype != torch.float64
            and torch.cuda.get_device_capability(codebook.device) >= (8, 0)):   # __reduce_max_sync
        from .pq_cells import build_cell_tables
        t = build_cell_tables(codebook, grid=grid, cmax=cmax)
        tabs = dict(cents=cb.contiguous(), bp=t.bp.contiguous(),
                    recs=torch.cat([t.counts.unsqueeze(-1), t.lists], -1).contiguous(),
                    grid=grid, cmax=cmax, tokens_per_block=tokens_per_block)
    return CudaPQEncodePlan(cpre=pre.contiguous(), num_kv_heads=hkv, m=m, dsub=dsub,
                            tokens_per_thread=tokens_per_thread, cells=tabs,
                            num_sms=torch.cuda.get_device_properties(codebook.device).multi_processor_count)


_encode_plans: dict = {}


def encode_plan(codebook: torch.Tensor, refresh: bool = False) -> CudaPQEncodePlan:
    """The plan of a codebook (precomputed -2c and ||c||^2, and for dsub 2 the cell
    tables, a few hundred ms per layer on an H100), cached per codebook tensor: a
    cache's codebooks are set once and read on every seal, so SetCodebooks builds
    them (dispatch.prepare_encode) rather than the first seal. refresh: rebuild even if
    cached (new codebooks may sit where freed ones were, with the same key)."""
    key = (codebook.data_ptr(), codebook._version, tuple(codebook.shape), codebook.dtype)
    plan = _encode_plans.get(key)
    if plan is None or refresh:
        if len(_encode_plans) > 4096:
            _encode_plans.clear()
        plan = _encode_plans[key] = plan_pq_encode(codebook)
    return plan


def pq_encode_to_slots(x, codebook, slots, k_codes=None, v_codes=None) -> None:
    """Same contract as reference.pq_encode_to_slots."""
    encode_plan(codebook).run(x, slots, k_codes=k_codes, v_codes=v_codes)
