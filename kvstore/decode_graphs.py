"""CUDA graphs for the decode attention of small batches (AppendAttend, Attend).

DESIGN §4: run launches allocate nothing and never synchronise, so they can be
captured. A graph holds the attention launches of one layer for one batch
shape and one pair of caller buffers (q in, out written in place); it reads
its work items and block tables from one static int32 buffer. A call packs
those on the host, copies them in with one H2D copy from a pinned slot, and
replays: three CUDA calls where the eager path makes ~15 Python-level ops and
two argument-packing launches (bench/NOTES-rpc.md).

An AppendAttend's graph also writes the new tokens into the fp16 tail
(index_put_ at slots read from the meta buffer), where k and v come from a
registered buffer too: the two per-token copies of the eager write cost more
host time than the whole replay (bench/NOTES-rpc.md, session 5).

Off with KVSTORE_CUDA_GRAPHS=0. Only calls whose q and out are views of a
caller's registered buffer come here (their addresses repeat call after
call); a cache whose calls keep missing (new addresses) stops capturing.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from . import pinned

log = logging.getLogger("kvstore.graphs")
ENABLED = os.environ.get("KVSTORE_CUDA_GRAPHS", "1") != "0"
MAX_BATCH = 8           # larger batches: the eager path's overhead is small against their work
MAX_GRAPHS = 256        # per cache (LRU); a graph holds its plan's workspace (~100 KB-1 MB)
SPARE_ITEMS = 16        # plan capacity past the first call's items, for longer sequences later
MIN_COLS = 16           # table columns of a new graph (doubled as sequences outgrow them)
MAX_META = 1 << 19      # bytes of a graph's items and tables (one pinned slot holds 1 MiB)


def _cols(n: int) -> int:
    return max(MIN_COLS, 1 << max(0, n - 1).bit_length())


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    plan: object
    meta: torch.Tensor           # int32 [items | item_ptr | sealed table | tail table]
    lse: torch.Tensor
    width: int                   # ints per work item (5: CUDA PQ plan, 4: Triton)
    cols: tuple[int, int]        # (sealed, tail) table columns; sealed 0 for fp16


class DecodeGraphs:
    """Per cache: the graphs of its small decode steps, keyed by layer, batch,
    caller buffers, scale, table widths and stream."""

    def __init__(self):
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.hits = self.captures = 0
        self.enabled = ENABLED
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._eager: set[tuple] = set()     # keys whose plan left its CUDA kernels: never captured
        self._seen: OrderedDict[tuple, None] = OrderedDict()     # keys met once, not captured yet
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self.graphs.clear()
            self._eager.clear()
            self._seen.clear()

    def attend(self, cache, layer: int, seqs, q: torch.Tensor, scale: float, out: torch.Tensor | None,
               new: tuple | None = None) -> tuple[torch.Tensor | None, bool]:
        """-> (out [B, Hq, d] written by a replay (or by the eager run of a new
        graph), or None: not for this path, the caller runs eagerly; whether
        the new tokens were written too).

        new: (slots, k, v) of an AppendAttend whose tokens are counted but not
        written yet: [(tail block, offset)] and k, v [len(slots), Hkv, d]. When
        k and v sit at addresses that repeat (a registered buffer), the graph
        writes them first, reading the slots from its meta buffer; else the
        caller writes them and the graph of the attention alone replays."""
        if (not self.enabled or out is None or len(seqs) > MAX_BATCH or q.device.type != "cuda"
                or torch.cuda.is_current_stream_capturing()):
            return None, False
        bs = cache.bs
        if cache.is_pq:
            sealed = [s.sealed for s in seqs]
            tail = [s.tail for s in seqs]
            lens = ([len(s.sealed) * bs for s in seqs],
                    [s.layer_length(layer) - len(s.sealed) * bs for s in seqs])
            cols = (_cols(max(len(r) for r in sealed)), _cols(max(len(r) for r in tail)))
            cb = (cache.main.k_cb[layer].data_ptr(), cache.main.v_cb[layer].data_ptr())
        else:
            sealed, tail = None, [s.sealed + s.tail for s in seqs]
            lens = ([s.layer_length(layer) for s in seqs],)
            cols = (0, _cols(max(len(r) for r in tail)))
            cb = 0
        if 4 * len(seqs) * (cols[0] + cols[1] + 64) > MAX_META:
            return None, False
        stream = torch.cuda.current_stream(q.device)
        key = (layer, len(seqs), q.data_ptr(), out.data_ptr(), q.dtype, float(scale), cols, cb,
               stream.cuda_stream)
        if new is not None and len(new[0]) <= MAX_BATCH and new[1].is_cuda:
            got = self._run(cache, layer, seqs, q, scale, out, lens, sealed, tail, cols,
                            key + (new[1].data_ptr(), new[2].data_ptr(), len(new[0])), new)
            if got is not None:
                return got, True
        return self._run(cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, None), False

    # ------------------------------------------------------------ internals
    def _run(self, cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, new):
        """Replay key's graph, or capture it on its second call -> out, or None."""
        if key in self._eager:
            return None
        with self._lock:
            g = self.graphs.get(key)
            if g is not None:
                self.graphs.move_to_end(key)
        if g is not None:
            try:
                items, ptr = g.plan.rows(*lens)
            except ValueError:      # more work items than the graph has room for: a new one
                g = None
            else:
                self._copy_meta(g, items, ptr, sealed, tail, len(seqs), new)
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

    def _copy_meta(self, g: _Graph, items, ptr, sealed, tail, b: int, new=None) -> None:
        """Pack items, item_ptr, the tables and the new tokens' slots as the graph's
        meta buffer lays them out; one copy from a pinned slot, ordered on the
        current stream."""
        n_items, sc, tc = len(items), g.cols[0], g.cols[1]
        host = np.zeros(g.meta.numel(), dtype=np.int32)
        host[:n_items] = items
        host[n_items:n_items + b + 1] = ptr
        o = n_items + b + 1
        for rows, cols in ((sealed, sc), (tail, tc)):
            if rows is None:
                continue
            for i, r in enumerate(rows):
                if r:
                    host[o + i * cols:o + i * cols + len(r)] = r
            o += b * cols
        if new is not None:         # [blocks | offsets] of the tokens the graph writes
            nw = len(new[0])
            host[o:o + 2 * nw] = [blk for blk, _ in new[0]] + [off for _, off in new[0]]
        ring = pinned._get_ring()
        slot, buf = ring.acquire()
        try:
            stage = buf.view(torch.uint8)[:host.nbytes]
            stage.numpy()[:] = host.view(np.uint8)
            g.meta.view(torch.uint8).copy_(stage, non_blocking=True)
        finally:
            ring.release(slot, buf, g.meta.device)

    def _capture(self, cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, new):
        from kvstore.kernels import cuda_pq
        from kvstore.kernels import decode_attention as da
        if self.captures >= MAX_GRAPHS and self.hits < 2 * self.captures:
            # Addresses that do not repeat, or more layers x buffers than the LRU
            # holds: graphs would not pay for their captures.
            self.enabled = False
            log.info("decode graphs off for this cache: %d captures, %d replays", self.captures, self.hits)
            return None
        dev, b, hq, d = q.device, len(seqs), q.shape[1], q.shape[2]
        if cache.is_pq:
            plan = da.plan_pq_decode(*lens, num_qo_heads=hq, num_kv_heads=cache.main.k_codes.shape[2],
                                     head_dim=d, block_size=cache.bs, tail_block_size=cache.tail.k.shape[3],
                                     device=dev, spare_items=SPARE_ITEMS)
            width = 5 if isinstance(plan, cuda_pq.CudaPQPlan) else 4
        else:
            plan = da.plan_paged_decode(*lens, num_qo_heads=hq, num_kv_heads=cache.main.k.shape[2], head_dim=d,
                                        block_size=cache.bs, device=dev, spare_items=SPARE_ITEMS)
            width = 4
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
        g = _Graph(torch.cuda.CUDAGraph(), plan, meta, lse, width, cols)
        items, ptr = plan.rows(*lens)
        self._copy_meta(g, items, ptr, sealed, tail, b, new)

        def run():
            if new is not None:     # the new tokens first: the attention reads them
                idx = (w_blocks.long(), w_offs.long())
                w_dst[0].index_put_(idx, w_src[0])
                w_dst[1].index_put_(idx, w_src[1])
            if cache.is_pq:
                plan.run_pq(q, cache.main.k_codes[layer], cache.main.v_codes[layer], cache.main.k_cb[layer],
                            cache.main.v_cb[layer], st, cache.tail.k[layer], cache.tail.v[layer], tt, scale,
                            out=out, lse=lse, trusted=True)
            else:
                plan.run_paged(q, cache.main.k[layer], cache.main.v[layer], tt, scale, out=out, lse=lse,
                               trusted=True)
        run()           # this call's result, and every kernel compiled and loaded before capture
        if getattr(plan, "_fallback", None) is not None:
            # The CUDA plan handed these buffers to its Triton fallback, whose items
            # are not in meta: no graph for them.
            self._eager.add(key)
            return out
        side = self._streams.get(dev.index)
        if side is None:
            side = self._streams[dev.index] = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        try:
            side.wait_stream(cur)
            with torch.cuda.graph(g.graph, stream=side, capture_error_mode="thread_local"):
                run()
            cur.wait_stream(side)
        except RuntimeError as e:       # not capturable here: eager from now on
            self.enabled = False
            log.warning("decode graphs off: capture failed (%s)", e)
            return out
        self.captures += 1
        with self._lock:
            self.graphs[key] = g
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        return out

