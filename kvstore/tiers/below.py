"""Cached blocks below the GPU (docs/design.md, Tiers): freed blocks with a
content hash are copied down before their slot is reused (GPU -> host ->
disk, and to Redis what it may not have yet), and a prompt's prefix blocks
are found there and read back.

Two kinds of block live there: sealed blocks (the main pool's payloads: PQ
codes, or fp16 blocks of the fp16 codec), stored under their chained hash h,
and a pq cache's fp16 blocks (its tail pool's payloads: sink blocks and the
newest tokens' blocks), stored under fp16_key(h): a block in one prompt's
fp16 tail is sealed in a longer prompt's, so its two forms need two keys.
The widths differ too, so each kind is spilled, looked up and read with its
own pools."""
from __future__ import annotations

import time

import torch

from kvstore.core.hashing import form_key

from .staging import put_rows, to_host

KEEP_BATCH = 256            # blocks a write of keep_on_disk takes


class CachedBelow:
    """The spill and prefix-read half of Tiering (policy.py), which sets c, host,
    disk, counters and _moved. fp16: the kind (above); the pools below hold keys."""

    def _hooks(self) -> None:
        self.c.main_pool.on_evict = lambda evicted: self._spill_gpu(evicted, fp16=False)
        if self.host is not None:
            self.host.main_pool.on_evict = lambda evicted: self._spill_host(evicted, fp16=False)
            self.host.tail_pool.on_evict = lambda evicted: self._spill_host(evicted, fp16=True)

    def _kind(self, fp16: bool):
        """(GPU payloads, host pool, host rows) of sealed or fp16 blocks."""
        c, h = self.c, self.host
        if fp16:
            return c.tail_io, h and h.tail_pool, h and h.tail
        return c.main_io, h and h.main_pool, h and h.main

    # ------------------------------------------------------------ spilling
    def spill_fp16(self, evicted: list[tuple[int, bytes]]) -> None:
        """Cached GPU tail-pool blocks of a pq cache are about to be reused."""
        self._spill_gpu(evicted, fp16=True)

    def _spill_gpu(self, evicted: list[tuple[int, bytes]], fp16: bool) -> None:
        """GPU cached blocks are about to be reused: keep their payload below."""
        keys = [(b, form_key(h, fp16)) for b, h in evicted]
        held = [self._below_has(k, fp16) for _, k in keys]
        down = [i for i, h in enumerate(held) if not h]
        up = []
        if (redis := self.c.redis) is not None:
            # ---- Redis tier: the ones it may not have yet (redis.py). One this host keeps
            # below too was put when it sealed or first spilled, unless Redis lost what it
            # held since (restarted empty): then it goes up again, or other hosts would miss
            # it for as long as this host's disk keeps it
            lost = redis.lost_since_start()
            up = [i for i, (_, k) in enumerate(keys) if (lost or not held[i]) and not redis.knows(k)]
        need = sorted(set(up) | set(down))
        if not need:
            return
        io, pool, rows = self._kind(fp16)
        packed = io.pack([keys[i][0] for i in need])          # once, for both
        row = {i: r for r, i in enumerate(need)}

        def rows_of(idx: list[int]) -> torch.Tensor:
            return packed if len(idx) == len(need) else \
                packed.index_select(0, torch.tensor([row[i] for i in idx], device=packed.device))
        if up:
            redis.put([keys[i][1] for i in up], rows_of(up))
        if not down:
            return
        todo, payload = [keys[i] for i in down], rows_of(down)
        # As many as the host pool has room for go there, the newest (evicted
        # comes least recently used first); the rest to disk.
        n = min(len(todo), pool.num_allocatable()) if pool is not None else 0
        if n:
            ids, cut = pool.allocate(n), len(todo) - n
            self.host.put(rows, ids, payload[cut:])
            for i, (_, k) in zip(ids, todo[cut:]):
                pool.set_hash(i, k)
            pool.release(ids)               # cached on the host, findable
            self.counters["spilled_blocks"] += n
            self._moved("bytes_down", "host", payload[cut:].numel())
            todo, payload = todo[:cut], payload[:cut]
        if todo and self.disk is not None:
            self._spill_disk([(k, p) for (_, k), p in zip(todo, to_host(payload))], payload.shape[1])

    def _spill_host(self, evicted: list[tuple[int, bytes]], fp16: bool) -> None:
        """Host cached blocks (hashed by their keys) are about to be reused: down to disk, and to Redis."""
        if self.disk is None and self.c.redis is None:
            return
        rows = self._kind(fp16)[2]
        self.host.settle()
        items = [(k, rows[b].clone()) for b, k in evicted]
        if self.c.redis is not None:      # ---- Redis tier: the ones it may not have yet (redis.py)
            self.c.redis.put([k for k, _ in items], torch.stack([p for _, p in items]))
        if self.disk is not None:
            self._spill_disk(items, rows.shape[1])

    def keep_on_disk(self, deadline: float) -> int:
        """The daemon stops: blocks with a content hash that no disk copy holds yet
        (the GPU pools', held or cached, then the host tier's), the most recently used
        first, are written to disk until `deadline` (monotonic), so that the next
        daemon's prompts hit them. -> how many were."""
        if self.disk is None:
            return 0
        c, h, n = self.c, self.host, 0
        sources = [(c.main_pool, lambda ids: to_host(c.main_io.pack(ids)), False)]
        if c.is_pq:
            sources.append((c.tail_pool, lambda ids: to_host(c.tail_io.pack(ids)), True))
        if h is not None:
            h.settle()
            sources += [(h.main_pool, lambda ids: h.main[ids], None), (h.tail_pool, lambda ids: h.tail[ids], None)]
        for pool, rows_of, fp16 in sources:         # fp16 None: the host pools, hashed by their keys
            hashed = sorted((b for b in pool.blocks if b.hash is not None), key=lambda b: -b.last_use)
            todo = [(b.block_id, b.hash if fp16 is None else form_key(b.hash, fp16)) for b in hashed]
            todo = [(b, k) for b, k in todo if not self.disk.has_block(c.fingerprint, k)]
            for i in range(0, len(todo), KEEP_BATCH):
                if time.monotonic() > deadline:
                    return n
                part = todo[i:i + KEEP_BATCH]
                rows = rows_of([b for b, _ in part])
                kept = self._spill_disk([(k, r) for (_, k), r in zip(part, rows)], rows.shape[1])
                if not kept:            # past the bound, or the filesystem refused them
                    return n
                n += kept
        return n

    def _spill_disk(self, items: list[tuple[bytes, torch.Tensor]], width: int) -> int:
        """-> how many of the blocks were written."""
        self._moved("bytes_down", "disk", n := self.disk.put_blocks(self.c.fingerprint, items))
        self.counters["spilled_blocks"] += n // width
        return n // width

    def _below_has(self, k: bytes, fp16: bool) -> bool:
        pool = self._kind(fp16)[1]
        if pool is not None and pool.lookup(k) is not None:
            return True
        return self.disk is not None and self.disk.has_block(self.c.fingerprint, k)

    # ---------------------------------------------------------- prefix hits
    def lookup_below(self, h: bytes, fp16: bool = False) -> tuple[str, object] | None:
        """Where below the GPU the sealed (or fp16) form of block h is: ("host",
        host block id) or ("disk", its key); fetch_below reads a run of them at once."""
        k, pool = form_key(h, fp16), self._kind(fp16)[1]
        if pool is not None:
            b = pool.lookup(k)
            if b is not None:
                return "host", b
        if self.disk is not None and self.disk.has_block(self.c.fingerprint, k):
            return "disk", k
        return None

    def fetch_below(self, found: list[tuple[str, object]], device, fp16: bool = False) -> torch.Tensor:
        """Payloads [n, block bytes] uint8 on device of lookup_below's answers, in order:
        host rows by DMA from the pinned pool, disk rows in one read transaction; n <
        len(found) where a disk block went since its lookup (another cache's spill
        evicted it). Host rows are copied on the current stream: a later spill into
        their slots queues behind the copy."""
        io, _, pool_rows = self._kind(fp16)
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
