"""Cached blocks below the GPU (docs/design.md, Tiers): freed blocks with a
content hash are copied down before their slot is reused (GPU -> host ->
disk, and to Redis what it may not have yet), and a prompt's prefix blocks
are found there and read back.

Two kinds of block live there, each under its content hash: sealed blocks
(the main pool's payloads: PQ codes, or fp16 blocks of the fp16 codec) and a
pq cache's sink blocks (its first sink_tokens in fp16, the tail pool's
payloads). A hash names a block index of its chain and the fingerprint fixes
the sink count, so one key never means both; the widths differ, so each kind
is spilled, looked up and read with its own pools. Other fp16 tail blocks
are not kept below: their sealed form is."""
from __future__ import annotations

import torch

from .staging import put_rows, to_host


class CachedBelow:
    """The spill and prefix-read half of Tiering (policy.py), which sets c, host,
    disk, counters and _moved."""

    def _hooks(self) -> None:
        self.c.main_pool.on_evict = lambda evicted: self._spill_gpu(evicted, sink=False)
        if self.host is not None:
            self.host.main_pool.on_evict = lambda evicted: self._spill_host(evicted, sink=False)
            self.host.tail_pool.on_evict = lambda evicted: self._spill_host(evicted, sink=True)

    def _kind(self, sink: bool):
        """(GPU payloads, host pool, host rows) of sealed or sink blocks."""
        c, h = self.c, self.host
        if sink:
            return c.tail_io, h and h.tail_pool, h and h.tail
        return c.main_io, h and h.main_pool, h and h.main

    # ------------------------------------------------------------ spilling
    def spill_sinks(self, evicted: list[tuple[int, bytes]]) -> None:
        """Cached GPU sink blocks (Cache.hash_fp16) are about to be reused."""
        self._spill_gpu(evicted, sink=True)

    def _spill_gpu(self, evicted: list[tuple[int, bytes]], sink: bool) -> None:
        """GPU cached blocks are about to be reused: keep their payload below."""
        todo = [(b, h) for b, h in evicted if not self._below_has(h, sink)]
        if not todo:
            return
        io, pool, rows = self._kind(sink)
        payload = io.pack([b for b, _ in todo])
        if self.c.redis is not None:      # ---- Redis tier: the ones it may not have yet (redis.py)
            self.c.redis.put([h for _, h in todo], payload)
        if pool is not None:
            ids = pool.allocate(len(todo))
            if ids is not None:
                self.host.put(rows, ids, payload)
                for i, (_, h) in zip(ids, todo):
                    pool.set_hash(i, h)
                pool.release(ids)           # cached on the host, findable
                self.counters["spilled_blocks"] += len(todo)
                self._moved("bytes_down", "host", payload.numel())
                return
        if self.disk is not None:
            self._spill_disk([(h, p) for (_, h), p in zip(todo, to_host(payload))], payload.shape[1])

    def _spill_host(self, evicted: list[tuple[int, bytes]], sink: bool) -> None:
        """Host cached blocks are about to be reused (on the host, only sink
        blocks of the tail pool carry a hash): down to disk, and to Redis."""
        if self.disk is None and self.c.redis is None:
            return
        rows = self._kind(sink)[2]
        self.host.settle()
        items = [(h, rows[b].clone()) for b, h in evicted]
        if self.c.redis is not None:      # ---- Redis tier: the ones it may not have yet (redis.py)
            self.c.redis.put([h for h, _ in items], torch.stack([p for _, p in items]))
        if self.disk is not None:
            self._spill_disk(items, rows.shape[1])

    def _spill_disk(self, items: list[tuple[bytes, torch.Tensor]], width: int) -> None:
        self._moved("bytes_down", "disk", n := self.disk.put_blocks(self.c.fingerprint, items))
        self.counters["spilled_blocks"] += n // width

    def _below_has(self, h: bytes, sink: bool) -> bool:
        pool = self._kind(sink)[1]
        if pool is not None and pool.lookup(h) is not None:
            return True
        return self.disk is not None and self.disk.has_block(self.c.fingerprint, h)

    # ---------------------------------------------------------- prefix hits
    def lookup_below(self, h: bytes, sink: bool = False) -> tuple[str, object] | None:
        """Where below the GPU a sealed (or sink) block with hash h is: ("host",
        host block id) or ("disk", h); fetch_below reads a run of them at once."""
        pool = self._kind(sink)[1]
        if pool is not None:
            b = pool.lookup(h)
            if b is not None:
                return "host", b
        if self.disk is not None and self.disk.has_block(self.c.fingerprint, h):
            return "disk", h
        return None

    def fetch_below(self, found: list[tuple[str, object]], device, sink: bool = False) -> torch.Tensor:
        """Payloads [n, block bytes] uint8 on device of lookup_below's answers, in order:
        host rows by DMA from the pinned pool, disk rows in one read transaction; n <
        len(found) where a disk block went since its lookup (another cache's spill
        evicted it). Host rows are copied on the current stream: a later spill into
        their slots queues behind the copy."""
        io, _, pool_rows = self._kind(sink)
        width = io.block_bytes()
        host = [i for i, (t, _) in enumerate(found) if t == "host"]
        disk = [i for i, (t, _) in enumerate(found) if t == "disk"]
        if not host:            # all from disk: its rows as they are, no copy into a second buffer
            return self.disk.read_blocks(self.c.fingerprint, [h for _, h in found], width, device)
        rows, n = torch.empty((len(found), width), dtype=torch.uint8, device=device), len(found)
        if disk:
            got = self.disk.read_blocks(self.c.fingerprint, [found[i][1] for i in disk], width, device)
            if len(got) < len(disk):
                n, disk = disk[len(got)], disk[:len(got)]
            put_rows(rows, disk, got)
        host = [i for i in host if i < n]
        if host:
            put_rows(rows, host, self.host.get(pool_rows, [found[i][1] for i in host], device))
        return rows[:n]

    def served(self, tiers: list[str]) -> None:
        """Count prefix blocks from below that a sequence got."""
        for t in tiers:
            self.counters["prefix_hits_" + t] += 1
