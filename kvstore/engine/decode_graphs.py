"""CUDA graphs for the decode attention of small batches (AppendAttend, Attend).

The plan/run split (docs/design.md, Read path): run launches allocate nothing and never synchronise, so they can be
captured. A graph holds the attention launches of one layer for one batch
shape and one pair of caller buffers (q in, out written in place); it reads
its work items and block tables from one static int32 buffer. A call packs
those into the graph's own pinned copy of that buffer, copies it in with one
H2D copy, and replays: three CUDA calls where the eager path makes ~15
Python-level ops and two argument-packing launches (docs/rpc.md).
Work items depend only on the lengths and the plan's parameters, and every
layer of a decode step has the same lengths: they are computed once a step.

An AppendAttend's graph also writes the new tokens into the fp16 tail
(index_put_ at slots read from the meta buffer), where k and v come from a
registered buffer too: the two per-token copies of the eager write cost more
host time than the whole replay (docs/rpc.md).

Off with KVSTORE_CUDA_GRAPHS=0. Only calls whose q and out are views of a
caller's registered buffer come here (their addresses repeat call after
call); a cache whose calls keep missing (new addresses) stops capturing.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.cuda import runtime as cuda_rt, pinned

log = logging.getLogger("kvstore.graphs")
ENABLED = os.environ.get("KVSTORE_CUDA_GRAPHS", "1") != "0"
MAX_BATCH = 8           # larger batches: the eager path's overhead is small against their work
MAX_GRAPHS = 256        # per cache (LRU); a graph holds its plan's workspace (~100 KB-1 MB)
SPARE_ITEMS = 16        # plan capacity past the first call's items, for longer sequences later
MIN_COLS = 16           # table columns of a new graph (doubled as sequences outgrow them)
MAX_META = 1 << 19      # bytes of a graph's items and tables (one pinned slot holds 1 MiB)
MAX_ROWS = 512          # (plan parameters, lengths) -> work items, kept across a step's layers
# One capture at a time in the process: caches run requests in parallel (each
# under its own lock), and torch.cuda.graph's entry (synchronize, empty_cache)
# must not run while another thread captures (the allocator asserts that no
# capture is under way). Work outside captures needs no lock: captures are
# thread-local, on each cache's own side stream.
_capture_lock = threading.Lock()


def _cols(n: int) -> int:
    return max(MIN_COLS, 1 << max(0, n - 1).bit_length())


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    plan: object
    meta: torch.Tensor           # int32 [items | item_ptr | sealed table | tail table | new blocks | new offsets]
    lse: torch.Tensor
    width: int                   # ints per work item (the plan's item_width)
    cols: tuple[int, int]        # (sealed, tail) table columns; sealed 0 for fp16
    rows_sig: object = None      # what plan.rows() depends on besides the lengths (_rows_sig, interned)
    # Two host copies of meta, used in turn: [int32 tensor (pinned on CUDA), its
    # numpy view, the event recorded after its last H2D copy or None]. The
    # second lets a call pack while the previous call's copy is still queued.
    hosts: list = dataclasses.field(default_factory=list)
    turn: int = 0
    stream: object = None        # the torch stream it replays on (its handle is in the key); None: CPU (tests)
    device_index: int = 0


def _rows_sig(plan) -> tuple:
    """A plan's type, item capacity and scalar parameters: plans with equal
    ones give equal rows() for equal lengths (sealed_cols and tail_cols are
    what rows() sets, not what it reads)."""
    return (type(plan).__name__, plan.items.shape[0]) + tuple(
        (f.name, v) for f in dataclasses.fields(plan)
        if f.name not in ("sealed_cols", "tail_cols")
        and isinstance(v := getattr(plan, f.name), (int, float, bool, str, type(None))))


def _host_copies(n: int, device: torch.device) -> list:
    pin = device.type == "cuda"
    out = []
    for _ in range(2):
        t = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        out.append([t, t.numpy(), None])
    return out


def pack_meta(host: np.ndarray, items: np.ndarray, ptr: np.ndarray, sealed, tail, b: int,
              cols: tuple[int, int], new=None) -> None:
    """Fill all of host (int32, a graph's meta layout) for one call: items
    (padded to the plan's capacity), item_ptr [b + 1], the sealed and tail
    tables [b, cols] zero-padded (sealed None for fp16), then the new tokens'
    [blocks | offsets]."""
    n_items = len(items)
    host[:n_items] = items
    host[n_items:n_items + b + 1] = ptr
    o = n_items + b + 1
    for rows, c in ((sealed, cols[0]), (tail, cols[1])):
        if rows is None:
            continue
        host[o:o + b * c] = 0
        for i, r in enumerate(rows):
            if r:
                host[o + i * c:o + i * c + len(r)] = r
        o += b * c
    if new is not None:
        nw = len(new[0])
        host[o:o + 2 * nw] = [blk for blk, _ in new[0]] + [off for _, off in new[0]]
        o += 2 * nw
    assert o == len(host), f"meta layout: packed {o} of {len(host)} ints"


class DecodeGraphs:
    """Per cache: the graphs of its small decode steps, keyed by layer, batch,
    caller buffers, scale, table widths and stream."""

    def __init__(self):
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.hits = self.captures = 0
        self.enabled = ENABLED
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._seen: OrderedDict[tuple, None] = OrderedDict()     # keys met once, not captured yet
        self._rows: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # (rows_sig, lengths) -> (items, item_ptr)
        self._sigs: dict[tuple, int] = {}   # _rows_sig -> a small int: hashed per call instead of ~15 pairs
        self.rows_hits = 0
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            dropped = list(self.graphs.values())
            self.graphs.clear()
            self._seen.clear()
            self._rows.clear()
            self._sigs.clear()
        for g in dropped:
            _drop(g)

    def attend(self, cache, layer: int, seqs, q: torch.Tensor, scale: float, out: torch.Tensor | None,
               new: tuple | None = None) -> tuple[torch.Tensor | None, bool]:
        """-> (out [B, Hq, d] written by a replay (or by the eager run of a new
        graph), or None: not for this path, the caller runs eagerly; whether
        the new tokens were written too).

        new: (slots, k, v) of an AppendAttend whose tokens are counted but not
        written yet: [(tail block, offset)] and k, v [len(slots), Hkv, d]. When
        k and v sit at addresses that repeat (a registered buffer), the graph
        writes them first, reading the slots from its meta buffer; else they are
        written here, before the graph of the attention alone replays (or the
        caller's eager attention runs): the attention must see them either way."""
        if (not self.enabled or out is None or len(seqs) > MAX_BATCH or q.device.type != "cuda"
                or torch.cuda.is_current_stream_capturing()):
            return None, False
        lens = cache.decode_lens(layer, seqs)     # a windowed layer's start indices included
        if cache.is_pq:
            sealed = [s.sealed for s in seqs]
            tail = [s.tail for s in seqs]
            cols = (_cols(max(len(r) for r in sealed)), _cols(max(len(r) for r in tail)))
            # The codebooks' addresses (layer is in the key too): no per-layer views
            cb = (cache.main.k_cb.data_ptr(), cache.main.v_cb.data_ptr())
        else:
            sealed, tail = None, [s.sealed + s.tail for s in seqs]
            cols = (0, _cols(max(len(r) for r in tail)))
            cb = 0
        if 4 * len(seqs) * (cols[0] + cols[1] + 64) > MAX_META:
            return None, False
        stream = cuda_rt.current_stream(q.device)
        key = (layer, len(seqs), q.data_ptr(), out.data_ptr(), q.dtype, float(scale), cols, cb,
               stream.cuda_stream)
        if new is not None:
            if len(new[0]) <= MAX_BATCH and new[1].is_cuda:
                got = self._run(cache, layer, seqs, q, scale, out, lens, sealed, tail, cols,
                                key + (new[1].data_ptr(), new[2].data_ptr(), len(new[0])), new)
                if got is not None:
                    return got, True
            cache.tail.write_tokens(layer, *new)
        return self._run(cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, None), new is not None

    # ------------------------------------------------------------ internals
    def _run(self, cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, new):
        """Replay key's graph, or capture it on its second call -> out, or None."""
        with self._lock:
            g = self.graphs.get(key)
            if g is not None:
                self.graphs.move_to_end(key)
        if g is not None:
            rows = self._rows_of(g, lens)
            if rows is None:        # more work items than the graph has room for: a new one
                g = None
            else:
                self._copy_meta(g, *rows, sealed, tail, len(seqs), new)
                g.graph.replay()
                self.hits += 1
                return out
        elif key not in self._seen:
            # Capture on a key's second call: buffers whose addresses change every
            # call (a q the engine converted, say) never cost a capture.
            self._seen[key] = None
            if len(self._seen) > 4 * MAX_GRAPHS:
                self._seen.popitem(last=False)
            return None
        return self._capture(cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, new)

    def _rows_of(self, g: _Graph, lens) -> tuple[np.ndarray, np.ndarray] | None:
        """g.plan.rows(*lens) as int32 arrays, computed once for all graphs with
        g's plan parameters; None: more items than the plan has room for."""
        key = (g.rows_sig, tuple(map(tuple, lens)))
        hit = self._rows.get(key)
        if hit is not None:
            self.rows_hits += 1
            return hit
        try:
            items, ptr = g.plan.rows(*lens)
        except ValueError:
            return None
        if len(self._rows) >= MAX_ROWS:
            self._rows.clear()
        hit = self._rows[key] = (np.asarray(items, dtype=np.int32), np.asarray(ptr, dtype=np.int32))
        return hit

    def _copy_meta(self, g: _Graph, items, ptr, sealed, tail, b: int, new=None) -> None:
        """Pack items, item_ptr, the tables and the new tokens' slots into one of
        the graph's host copies of meta and copy it in, ordered on the graph's
        stream. When both copies still wait for their last H2D copy (the stream
        is behind), a pinned ring slot takes the call: the host never waits
        for the GPU."""
        rt = cuda_rt.runtime() if g.stream is not None else None
        if rt is not None and rt.getDevice() != g.device_index:
            rt = None
        for turn in (g.turn, g.turn ^ 1):
            h = g.hosts[turn]
            if h[2] is None or cuda_rt.event_done(h[2], rt):
                break
        else:
            h = None
        if h is not None:
            g.turn = turn ^ 1
            pack_meta(h[1], items, ptr, sealed, tail, b, g.cols, new)
            if g.stream is None:
                g.meta.copy_(h[0])
            elif rt is not None and h[2] is not None:
                # torch's pinned pool does not see this copy: _drop() waits for it
                rt.memcpyAsync(g.meta.data_ptr(), h[0].data_ptr(), h[1].nbytes, rt.memcpyHostToDevice,
                               g.stream.cuda_stream)
                cuda_rt.record(h[2], g.stream, rt)
            else:
                g.meta.copy_(h[0], non_blocking=True)
                if h[2] is None:
                    h[2] = torch.cuda.Event()
                h[2].record(g.stream)
            return
        host = np.empty(g.meta.numel(), dtype=np.int32)
        pack_meta(host, items, ptr, sealed, tail, b, g.cols, new)
        ring = pinned._get_ring()
        slot, buf = ring.acquire()
        try:
            stage = buf.view(torch.uint8)[:host.nbytes]
            stage.numpy()[:] = host.view(np.uint8)
            g.meta.view(torch.uint8).copy_(stage, non_blocking=True)
        finally:
            ring.release(slot, buf, g.meta.device)

    def _capture(self, cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, new):
        from kvstore import kernels
        if self.captures >= MAX_GRAPHS and self.hits < 2 * self.captures:
            # Addresses that do not repeat, or more layers x buffers than the LRU
            # holds: graphs would not pay for their captures.
            self.enabled = False
            log.info("decode graphs off for this cache: %d captures, %d replays", self.captures, self.hits)
            return None
        dev, b, hq, d = q.device, len(seqs), q.shape[1], q.shape[2]
        if cache.is_pq:
            plan = kernels.plan_decode("pq", *lens, num_qo_heads=hq, num_kv_heads=cache.main.k_codes.shape[2],
                                       head_dim=d, block_size=cache.bs, tail_block_size=cache.tail.k.shape[3],
                                       device=dev, dtype=q.dtype, kv_dtype=cache.tail.k.dtype,
                                       codebook_dtype=cache.main.k_cb.dtype, aligned=kernels.query_aligned(q),
                                       spare_items=SPARE_ITEMS, softcap=cache.cfg.logit_softcap)
        else:
            plan = kernels.plan_decode("paged", *lens, num_qo_heads=hq, num_kv_heads=cache.main.k.shape[2],
                                       head_dim=d, block_size=cache.bs, device=dev, dtype=q.dtype,
                                       spare_items=SPARE_ITEMS, softcap=cache.cfg.logit_softcap)
        width = plan.item_width
        cap = plan.items.shape[0]
        nw = len(new[0]) if new is not None else 0
        n = cap * width + b + 1 + b * (cols[0] + cols[1]) + 2 * nw
        meta = torch.zeros(n, dtype=torch.int32, device=dev)
        plan.items = meta[:cap * width].view(cap, width)
        plan.item_ptr = meta[cap * width:cap * width + b + 1]
        o = cap * width + b + 1
        st = meta[o:o + b * cols[0]].view(b, cols[0])
        o += b * cols[0]
        tt = meta[o:o + b * cols[1]].view(b, cols[1])
        o += b * cols[1]
        w_blocks, w_offs = meta[o:o + nw], meta[o + nw:o + 2 * nw]
        if new is not None:
            # [nt, bs, Hkv, d] view of the layer's fp16 blocks: (block, offset) picks a token's [Hkv, d]
            w_dst = (cache.tail.k[layer].permute(0, 2, 1, 3), cache.tail.v[layer].permute(0, 2, 1, 3))
            w_src = new[1:]
        lse = torch.empty(b, hq, dtype=torch.float32, device=dev)
        sig = self._sigs.setdefault(_rows_sig(plan), len(self._sigs))
        g = _Graph(torch.cuda.CUDAGraph(), plan, meta, lse, width, cols, sig, _host_copies(n, dev),
                   stream=torch.cuda.current_stream(dev), device_index=dev.index or 0)
        rows = self._rows_of(g, lens)
        assert rows is not None, "a plan made for these lengths has room for their items"
        self._copy_meta(g, *rows, sealed, tail, b, new)
        sinks = cache.layer_sink_logits(layer)

        def run():
            if new is not None:     # the new tokens first: the attention reads them
                idx = (w_blocks.long(), w_offs.long())
                w_dst[0].index_put_(idx, w_src[0])
                w_dst[1].index_put_(idx, w_src[1])
            if cache.is_pq:
                plan.run_pq(q, cache.main.k_codes[layer], cache.main.v_codes[layer], cache.main.k_cb[layer],
                            cache.main.v_cb[layer], st, cache.tail.k[layer], cache.tail.v[layer], tt, scale,
                            out=out, lse=lse, trusted=True, codebook_image=cache.main.image(layer))
            else:
                plan.run_paged(q, cache.main.k[layer], cache.main.v[layer], tt, scale, out=out, lse=lse,
                               trusted=True)
            if sinks is not None:
                kernels.fold_sink_logits(out, lse, sinks)
        run()           # this call's result, and every kernel compiled and loaded before capture
        side = self._streams.get(dev.index)
        if side is None:
            side = self._streams[dev.index] = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        if not _capture_lock.acquire(blocking=False):
            return out          # another cache is capturing: this call ran eagerly, a later one captures
        try:
            side.wait_stream(cur)
            with torch.cuda.graph(g.graph, stream=side, capture_error_mode="thread_local"):
                run()
            cur.wait_stream(side)
        except RuntimeError as e:       # not capturable here: eager from now on
            self.enabled = False
            log.warning("decode graphs off: capture failed (%s)", e)
            return out
        finally:
            _capture_lock.release()
        self.captures += 1
        with self._lock:
            dropped = [self.graphs.pop(key)] if key in self.graphs else []
            self.graphs[key] = g
            while len(self.graphs) > MAX_GRAPHS:
                dropped.append(self.graphs.popitem(last=False)[1])
        for old in dropped:
            _drop(old)
        return out


def _drop(g: _Graph) -> None:
    """A graph leaves (LRU, recapture, clear: rare): its host copies go back
    to torch's pinned pool, which did not see the copies made from them
    through cupy, so wait for their last ones."""
    for h in g.hosts:
        if h[2] is not None:
            h[2].synchronize()

