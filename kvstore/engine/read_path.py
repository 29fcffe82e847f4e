"""The read path of a cache: decode attention and Retrieve."""
from __future__ import annotations

import math
import time

import torch

from kvstore import kernels
from kvstore.kernels import cpu_decode
from kvstore.kernels.plan import pq_window_starts, window_start

from kvstore.core.sequence import Sequence
from kvstore.cuda import runtime as cuda_rt
from kvstore.cuda.pinned import block_table, staged
from kvstore.errors import InvalidArgument, quote

from .storage import ids_to


class ReadPath:
    """Mixed into Cache; builds block tables and calls the kernels."""

    _kept_plan: tuple | None = None     # (key, tables as lists, plan, device tables): _step_plan
    _sink_rows: torch.Tensor | None = None     # [L, Hq] fp32 on the pools' device: layer_sink_logits

    # ------------------------------------------------------------- reading
    @staticmethod
    def check_visible(layer: int, seqs: list[Sequence]) -> None:
        """Every sequence has a token to attend to at this layer."""
        for s in seqs:
            if s.layer_length(layer) == 0:
                raise InvalidArgument("sequence_ids", f"sequence {quote(s.seq_id)} has no tokens at layer {layer}")

    def layer_sink_logits(self, layer: int) -> torch.Tensor | None:
        """The layer's learned sink logits [Hq] fp32 on the pools' device (float32's lowest
        for a head without one: kernels.sink_table), or None: the cache has none. Built
        once: a decode graph reads them at a fixed address."""
        if not self.cfg.sink_logits:
            return None
        if self._sink_rows is None:
            self._sink_rows = kernels.sink_table(self.cfg.sink_logits, self.cfg.geometry.num_layers,
                                                 self.main_device)
        return self._sink_rows[layer]

    def decode_lens(self, layer: int, seqs: list[Sequence]) -> tuple[list[int], ...]:
        """The kernels' lengths of a decode step at this layer (router.plan_decode's
        lens): pq (sealed tokens, tail tokens), fp16 (tokens,); a windowed layer adds
        each range's first token in its window or chunk (kernels/plan.py)."""
        window, chunk = self.cfg.window(layer), self.cfg.chunk(layer)
        if self.is_pq:
            sealed = [len(s.sealed) * self.bs for s in seqs]
            lens = (sealed, [s.layer_length(layer) - n for s, n in zip(seqs, sealed)])
            if window or chunk:
                st = [pq_window_starts(s.layer_length(layer), window, self.sinks, n, chunk)
                      for s, n in zip(seqs, sealed)]
                lens += ([a for a, _ in st], [b for _, b in st])
            return lens
        lens = ([s.layer_length(layer) for s in seqs],)
        if window or chunk:
            lens += ([window_start(n, window, chunk) for n in lens[0]],)
        return lens

    def attend(self, layer: int, seqs: list[Sequence], q: torch.Tensor, scale: float,
               out: torch.Tensor | None = None, new: tuple | None = None) -> torch.Tensor:
        """q [B, Hq, d] -> out [B, Hq, d]: decode attention of one query token per
        sequence over every token visible at this layer. out: where to write it
        (q's shape, dtype and device, contiguous), e.g. the caller's buffer.
        new: (slots, k, v) of tokens append_layer_batch(defer_write=True) counted
        but left to write: written here first (by the decode graph if it can)."""
        wrote = False
        try:
            self._require_ready()
            dev = q.device
            self.check_visible(layer, seqs)
            graphed = None
            if dev.type == "cuda" and out is not None:
                graphed, wrote = self.graphs.attend(self, layer, seqs, q, scale, out, new)
            if new is not None and not wrote:
                self.tail.write_tokens(layer, *new)
                wrote = True
        finally:
            if new is not None and not wrote:     # an error above: the counted tokens hold their data anyway
                self.tail.write_tokens(layer, *new)
        if new is not None:     # the blocks these tokens filled: packed before, their rows were zeros
            self.publish()
        if dev.type == "cpu":
            res = self._attend_cpu(layer, seqs, q, scale)
            if out is None:
                out = res
            else:
                out.copy_(res)
        elif graphed is not None:
            pass        # replayed (or captured) into out
        else:
            out = self._run_kernels(layer, seqs, q, scale, out)
        now = time.monotonic()
        for s in seqs:
            s.last_use = now
        self.counters["attend_calls"] += 1
        return out

    def _run_kernels(self, layer: int, seqs: list[Sequence], q: torch.Tensor, scale: float,
                     out: torch.Tensor | None, query_tokens: int = 1) -> torch.Tensor:
        """The GPU path of attend (q [B, Hq, d]) and attend_multi (q [B, T, Hq, d], out of
        the same shape): the hot path holds a plan (docs/design.md, Read path): block
        tables and work items built on the host and copied in one go (pinned.staged), then
        the kernels, which take the engine's own pool tensors unchecked."""
        plan, tables = self._step_plan(layer, seqs, q, query_tokens)
        if self.is_pq:
            out, lse = plan.run_pq(q, self.main.k_codes[layer], self.main.v_codes[layer], self.main.k_cb[layer],
                                   self.main.v_cb[layer], tables[0], self.tail.k[layer], self.tail.v[layer],
                                   tables[1], scale, out=out, trusted=True, codebook_image=self.main.image(layer))
        else:
            out, lse = plan.run_paged(q, self.main.k[layer], self.main.v[layer], tables[0], scale, out=out,
                                      trusted=True)
        sinks = self.layer_sink_logits(layer)
        return out if sinks is None else kernels.fold_sink_logits(out, lse, sinks)

    def _step_plan(self, layer: int, seqs: list[Sequence], q: torch.Tensor, query_tokens: int) -> tuple:
        """-> (plan, device block tables) for this call. Every layer of a step has the same
        lengths and tables (a step's tokens are appended at each layer before any block
        seals), so the last call's plan and tables are reused while they describe these
        sequences: on a multi-token prefill chunk of 128 tokens, building them took 40 %
        of the engine's host time a call. Kept per stream: a plan's workspace is only
        reused in that stream's order."""
        dev, hq, d = q.device, q.shape[-2], q.shape[-1]
        # Lengths stay host lists: the kernels plan on the host, and a device tensor would
        # cost a synchronisation to read back.
        lens = self.decode_lens(layer, seqs)
        aligned = kernels.query_aligned(q) if self.is_pq else True
        key = (query_tokens, hq, d, q.dtype, aligned, cuda_rt.current_stream(dev).cuda_stream,
               tuple(map(tuple, lens)))
        kept = self._kept_plan
        if (kept is not None and kept[0] == key and len(kept[1]) == len(seqs)
                and all(a == s.sealed and b == s.tail for (a, b), s in zip(kept[1], seqs))):
            return kept[2], kept[3]
        common = dict(num_qo_heads=hq, head_dim=d, block_size=self.bs, device=dev, dtype=q.dtype,
                      softcap=self.cfg.logit_softcap, query_tokens=query_tokens)
        with staged(dev):
            if self.is_pq:
                kc = self.main.k_codes[layer]
                # Sinks then tail as one fp16 table: attention does not care about token order.
                tables = (block_table([s.sealed for s in seqs], dev), block_table([s.tail for s in seqs], dev))
                plan = kernels.plan_decode("pq", *lens, num_kv_heads=kc.shape[1],
                                           tail_block_size=self.tail.k.shape[3], kv_dtype=self.tail.k.dtype,
                                           codebook_dtype=self.main.k_cb.dtype, aligned=aligned, **common)
            else:
                tables = (block_table([s.sealed + s.tail for s in seqs], dev),)
                plan = kernels.plan_decode("paged", *lens, num_kv_heads=self.main.k.shape[2], **common)
        self._kept_plan = (key, [(list(s.sealed), list(s.tail)) for s in seqs], plan, tables)
        return plan, tables

    def _attend_cpu(self, layer: int, seqs: list[Sequence], q: torch.Tensor, scale: float) -> torch.Tensor:
        """The CPU device: no block tables, no plan; see kernels/cpu_decode.py. K/V are
        gathered in position order (sinks, sealed, tail), so a window is a slice. Holes
        (window.py) lie before every window: left out, the positions after them shift."""
        outs = []
        window, chunk = self.cfg.window(layer), self.cfg.chunk(layer)
        sinks = self.layer_sink_logits(layer)
        for i, s in enumerate(seqs):
            k, v = self._positional_cpu(layer, s)      # held tokens: holes left out
            gone = s.freed * self.bs
            lo = window_start(s.layer_length(layer), window, chunk) - gone
            assert lo >= (self.sinks if gone else 0), f"{s.seq_id}: layer {layer} reads a hole"
            outs.append(cpu_decode.attend_one(q[i], k[:, lo:], v[:, lo:], scale, self.cfg.logit_softcap, sinks))
        out = outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)
        return out.to(q.dtype)

    def _positional_cpu(self, layer: int, s: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [Hkv, n, d] fp32 of the tokens visible at this layer and still held, in
        position order (a sliding cache's freed blocks, s.freed of them, left out)."""
        n = s.layer_length(layer) - s.freed * self.bs
        if self.is_pq:
            ns = len(s.held_sealed()) * self.bs
            tail = torch.tensor(s.tail, dtype=torch.long)
            k = cpu_decode.gather_tokens(self.tail.k[layer], tail, n - ns)
            v = cpu_decode.gather_tokens(self.tail.v[layer], tail, n - ns)
            if ns:
                ks, vs = cpu_decode.dequantize_tokens(self.main.k_codes[layer], self.main.v_codes[layer],
                                                      self.main.k_cb[layer], self.main.v_cb[layer],
                                                      s.held_sealed())
                s0 = self.sinks      # the tail's first S tokens are positions [0, S)
                k = torch.cat([k[:, :s0], ks, k[:, s0:]], dim=1)
                v = torch.cat([v[:, :s0], vs, v[:, s0:]], dim=1)
            return k, v
        blocks = torch.tensor(s.held_sealed() + s.tail, dtype=torch.long)
        return (cpu_decode.gather_tokens(self.main.k[layer], blocks, n),
                cpu_decode.gather_tokens(self.main.v[layer], blocks, n))

    def attend_multi(self, layer: int, seqs: list[Sequence], q: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, new: tuple | None = None) -> torch.Tensor:
        """q [B, T, Hq, d]: the T newest tokens of each sequence at this layer (appended
        already, or counted and given as `new`, which is written first) -> out
        [B * T, Hq, d]: query i of a sequence attends to its earlier tokens and new
        tokens 0..i, read from the codes (no fp16 copy of sealed K/V). out: where to write
        it ([B * T, Hq, d], q's dtype and device, contiguous), as in attend(). The caller
        checked the layer has no window and (pq) that the T tokens are all in the tail."""
        if new is not None:      # first: the counted tokens hold their data whatever fails below
            self.tail.write_tokens(layer, *new)
            self.publish()
        self._require_ready()
        self.check_visible(layer, seqs)
        b, t, hq, d = q.shape
        dev = q.device
        if dev.type == "cpu":
            sinks = self.layer_sink_logits(layer)
            res = torch.cat([cpu_decode.attend_causal(q[i], *self._positional_cpu(layer, s), scale,
                                                      self.cfg.logit_softcap, sinks)
                             for i, s in enumerate(seqs)])
            out = res.to(q.dtype) if out is None else out.copy_(res)
        else:
            o4 = self._run_kernels(layer, seqs, q, scale, None if out is None else out.view(b, t, hq, d), t)
            out = o4.view(b * t, hq, d)
        now = time.monotonic()
        for s in seqs:
            s.last_use = now
        self.counters["attend_calls"] += 1
        return out

    def retrieve(self, s: Sequence, start: int, end: int, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [nl, end - start, Hkv, d] of committed tokens in position
        order: sinks exact, sealed ones dequantized, tail ones exact."""
        if not 0 <= start < end <= s.length:      # the engine's checks named the field already
            raise InvalidArgument("end", f"range [{start}, {end}) outside the {s.length} committed tokens")
        self.check_held(s, start, end)
        s0 = self.sinks if s.sealed else 0       # sealed tokens are [s0, s1)
        s1 = s0 + len(s.sealed) * self.bs
        parts = []
        if start < min(end, s0):
            parts.append(self._read_fp16(s, layers, start, min(end, s0)))
        if max(start, s0) < min(end, s1):
            a, b = max(start, s0) - s0, min(end, s1) - s0
            b0, b1 = a // self.bs, math.ceil(b / self.bs)
            k, v = self.main.read_blocks(layers, ids_to(self.main_device, s.sealed[b0:b1]))
            parts.append((k[:, a - b0 * self.bs:b - b0 * self.bs], v[:, a - b0 * self.bs:b - b0 * self.bs]))
        if end > max(start, s1):
            parts.append(self._read_fp16(s, layers, max(start, s1), end))
        s.last_use = time.monotonic()
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    def _read_fp16(self, s: Sequence, layers: slice, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, end) that sit contiguously in the fp16 blocks (all sinks, or all tail)."""
        t0 = int(self.tail_index(s, torch.tensor(start)))
        t1 = t0 + end - start
        b0, b1 = t0 // self.bs, math.ceil(t1 / self.bs)
        k, v = self.tail.read_blocks(layers, ids_to(self.tail.k.device, s.tail[b0:b1]))
        return k[:, t0 - b0 * self.bs:t1 - b0 * self.bs], v[:, t0 - b0 * self.bs:t1 - b0 * self.bs]
