"""Moving a cache's blocks between GPU, host and disk (DESIGN §7).

Policy: when an allocation would fail, the least recently used sequences that
nobody is writing to (no pending or reserved tokens, not in the request at
hand) move down whole: to the pinned host pool, or to LMDB when the host is
full or absent. Cached (freed, hashed) GPU blocks are copied to the host
before their slot is reused, and host cached blocks to LMDB, so prefix hits
survive eviction. Any access pages a sequence back in; Offload writes it to
LMDB and returns once the transaction is durable.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .errors import FailedPrecondition, ResourceExhausted
from .sequence import Sequence
from .storage import ids_to
from .tiers import DiskTier, HostTier


class Tiering:
    def __init__(self, cache, host: HostTier | None, disk: DiskTier | None):
        self.c = cache
        self.host = host
        self.disk = disk
        self.counters = dict(offloads_host=0, offloads_disk=0, page_ins_host=0, page_ins_disk=0,
                             bytes_down=0, bytes_up=0, spilled_blocks=0, prefix_hits_host=0, prefix_hits_disk=0)
        cache.main_pool.on_evict = self._spill_gpu_cached
        if host is not None:
            host.main_pool.on_evict = self._spill_host_cached

    # ------------------------------------------------------------ spilling
    def _spill_gpu_cached(self, evicted: list[tuple[int, bytes]]) -> None:
        """GPU cached blocks are about to be reused: keep their payload below."""
        todo = [(b, h) for b, h in evicted if not self._below_has(h)]
        if not todo:
            return
        payload = self.c.main.pack(ids_to(self.c.main_device, [b for b, _ in todo]))
        if self.c.redis is not None:      # ---- Redis tier: the ones it may not have yet (redis_tier.py)
            self.c.redis.put([h for _, h in todo], payload)
        if self.host is not None:
            ids = self.host.main_pool.allocate(len(todo))
            if ids is not None:
                self.host.put(self.host.main, ids, payload)
                for i, (_, h) in zip(ids, todo):
                    self.host.main_pool.set_hash(i, h)
                self.host.main_pool.release(ids)           # cached on the host, findable
                self.counters["spilled_blocks"] += len(todo)
                self.counters["bytes_down"] += payload.numel()
                return
        if self.disk is not None:
            payload = payload.cpu()
            self.counters["bytes_down"] += self.disk.put_blocks(self.c.fingerprint, [(h, p) for (_, h), p in zip(todo, payload)])
            self.counters["spilled_blocks"] += len(todo)

    def _spill_host_cached(self, evicted: list[tuple[int, bytes]]) -> None:
        if self.disk is None and self.c.redis is None:
            return
        self.host.settle()
        items = [(h, self.host.main[b].clone()) for b, h in evicted]
        if self.c.redis is not None:      # ---- Redis tier: the ones it may not have yet (redis_tier.py)
            self.c.redis.put([h for h, _ in items], torch.stack([p for _, p in items]))
        if self.disk is not None:
            self.counters["bytes_down"] += self.disk.put_blocks(self.c.fingerprint, items)

    def _below_has(self, h: bytes) -> bool:
        if self.host is not None and self.host.main_pool.lookup(h) is not None:
            return True
        return self.disk is not None and self.disk.store.contains(b"B" + self.c.fingerprint + h)

    # --------------------------------------------------------------- room
    def make_room(self, main: int, tail: int, protect: set) -> bool:
        """Move LRU sequences down until the GPU pools can give main + tail blocks."""
        c = self.c
        while True:
            if c.is_pq:
                ok = c.main_pool.num_allocatable() >= main and c.tail_pool.num_allocatable() >= tail
            else:
                ok = c.main_pool.num_allocatable() >= main + tail
            if ok:
                return True
            victims = sorted((s for s in c.seqs.values() if s.tier == "gpu" and id(s) not in protect
                              and not any(s.pending) and not s.reserved and (s.sealed or s.tail)),
                             key=lambda s: s.last_use)
            if not victims:
                return False
            try:
                self.move_down(victims[0], sync=False)
            except ResourceExhausted:
                return False

    def move_down(self, s: Sequence, sync: bool) -> None:
        """GPU -> host if it fits, else -> disk."""
        if self.host is not None and self._host_fits(s):
            self.to_host(s)
        elif self.disk is not None:
            self.to_disk(s, sync)
        else:
            raise ResourceExhausted("sequence_id", "no room in the host tier and no disk tier configured")

    def _sealed_hash(self, s: Sequence, j: int) -> bytes | None:
        """Content hash of sealed block j (behind the sink blocks), if known."""
        i = self.c.sink_blocks + j
        return s.hashes[i] if i < len(s.hashes) else None

    def _host_fits(self, s: Sequence) -> bool:
        h = self.host
        hashes = (self._sealed_hash(s, j) for j in range(len(s.sealed)))
        need_main = sum(1 for hj in hashes if hj is None or h.main_pool.lookup(hj) is None)
        if h.main_pool.num_allocatable() < need_main or h.tail_pool.num_allocatable() < len(s.tail):
            self._host_make_room(need_main, len(s.tail))
        return h.main_pool.num_allocatable() >= need_main and h.tail_pool.num_allocatable() >= len(s.tail)

    def _host_make_room(self, main: int, tail: int) -> None:
        if self.disk is None:
            return
        h = self.host
        victims = sorted((s for s in self.c.seqs.values() if s.tier == "host"), key=lambda s: s.last_use)
        for v in victims:
            if h.main_pool.num_allocatable() >= main and h.tail_pool.num_allocatable() >= tail:
                return
            self.to_disk(v, sync=False)

    # ------------------------------------------------------------- moves
    def to_host(self, s: Sequence) -> None:
        c, h = self.c, self.host
        assert s.tier == "gpu"
        host_main = []
        new_idx = []
        for i, b in enumerate(s.sealed):
            hi = self._sealed_hash(s, i)
            hb = h.main_pool.lookup(hi) if hi is not None else None
            if hb is not None:
                h.main_pool.ref([hb])
                host_main.append(hb)
            else:
                host_main.append(None)
                new_idx.append(i)
        alloc = h.main_pool.allocate(len(new_idx))
        tail_ids = h.tail_pool.allocate(len(s.tail))
        assert alloc is not None and tail_ids is not None, "host room was checked"
        if new_idx:
            payload = c.main.pack(ids_to(c.main_device, [s.sealed[i] for i in new_idx]))
            h.put(h.main, alloc, payload)
            self.counters["bytes_down"] += payload.numel()
        for i, hb in zip(new_idx, alloc):
            host_main[i] = hb
            if c.sink_blocks + i < min(s.hashed_upto, len(s.hashes)):
                h.main_pool.set_hash(hb, s.hashes[c.sink_blocks + i])
        if s.tail:
            payload = c.tail.pack(ids_to(c.tail.k.device, s.tail))
            h.put(h.tail, tail_ids, payload)
            self.counters["bytes_down"] += payload.numel()
        self._release(s)
        s.sealed, s.tail, s.tier = host_main, tail_ids, "host"
        s.rebuilt_table()
        self.counters["offloads_host"] += 1

    def to_disk(self, s: Sequence, sync: bool) -> None:
        """Write the sequence to LMDB in one transaction, then let go of its blocks."""
        if self.disk is None:
            raise FailedPrecondition("sequence_ids", "no disk tier configured (start the daemon with --lmdb PATH)")
        c = self.c
        if s.tier == "disk":
            if sync:
                self.disk.store.env.sync(True)
            return
        if s.tier == "gpu":
            sealed = c.main.pack(ids_to(c.main_device, s.sealed)).cpu() if s.sealed else None
            tail = c.tail.pack(ids_to(c.tail.k.device, s.tail)).cpu() if s.tail else None
        else:
            self.host.settle()
            sealed = self.host.main[s.sealed] if s.sealed else None
            tail = self.host.tail[s.tail] if s.tail else None
        # Blocks with a content hash go under that hash (deduplicated, found by
        # prefix lookups after a restart); fp16 tail blocks only where they share
        # the sealed blocks' format (codec fp16).
        hashed, others, block_hashes = [], [], []
        known = min(s.hashed_upto, len(s.hashes))
        rows = [sealed[i] for i in range(len(s.sealed))] + [tail[j] for j in range(len(s.tail))]
        index = ([c.sink_blocks + i for i in range(len(s.sealed))]     # block index of each row, in position order
                 + [c.tail_block_index(j, len(s.sealed)) for j in range(len(s.tail))])
        for r, (i, payload) in enumerate(zip(index, rows)):
            if i < known and (r < len(s.sealed) or not c.is_pq):
                hashed.append((s.hashes[i], payload))
                block_hashes.append(s.hashes[i].hex())
            else:
                others.append(payload)
                block_hashes.append("")
        manifest = dict(seq_id=s.seq_id, tenant=s.tenant, length=s.length, token_ids=s.token_ids,
                        hashes=[h.hex() for h in s.hashes], hashed_upto=s.hashed_upto,
                        sealed_hashes=block_hashes[:len(s.sealed)], tail_hashes=block_hashes[len(s.sealed):],
                        n_tail=len(s.tail), n_other=len(others))
        self.counters["bytes_down"] += self.disk.write_sequence(c.fingerprint, s.tenant, s.seq_id, manifest,
                                                                hashed, others, sync)
        self._release(s)
        s.sealed, s.tail, s.tier, s.manifest = [], [], "disk", manifest
        s.rebuilt_table()
        self.counters["offloads_disk"] += 1

    def _release(self, s: Sequence) -> None:
        if s.tier == "gpu":
            self.c.tail_pool.release(s.tail[::-1])
            self.c.main_pool.release(s.sealed[::-1])
        elif s.tier == "host":
            self.host.tail_pool.release(s.tail[::-1])
            self.host.main_pool.release(s.sealed[::-1])

    def page_in(self, s: Sequence, protect: set) -> None:
        """Bring a host or disk sequence back to the GPU pools."""
        c = self.c
        if s.tier == "gpu":
            return
        n_sealed = len(s.sealed) if s.tier == "host" else len(s.manifest["sealed_hashes"])
        n_tail = len(s.tail) if s.tier == "host" else s.manifest["n_tail"]
        known = min(s.hashed_upto, len(s.hashes))
        gpu_hits = {i: c.main_pool.lookup(s.hashes[c.sink_blocks + i])
                    for i in range(n_sealed) if c.sink_blocks + i < known}
        gpu_hits = {i: b for i, b in gpu_hits.items() if b is not None}
        # Hits that sit cached (unreferenced) stop being allocatable once we ref them.
        cached_hits = sum(1 for b in gpu_hits.values() if c.main_pool.blocks[b].ref_cnt == 0)
        need_main = n_sealed - len(gpu_hits) + cached_hits
        if not self.make_room(need_main, n_tail, protect | {id(s)}):
            raise ResourceExhausted("sequence_ids", f"no GPU room to page in sequence {s.seq_id!r}")
        c.main_pool.ref(list(gpu_hits.values()))
        need_main -= cached_hits
        if s.tier == "host":
            sealed_payload = self.host.get(self.host.main, s.sealed, c.main_device) if s.sealed else None
            tail_payload = self.host.get(self.host.tail, s.tail, c.tail.k.device) if s.tail else None
            self.counters["page_ins_host"] += 1
        else:
            pin = c.main_device.type == "cuda"
            sealed_payload, tail_payload = self.disk.read_sequence(
                c.fingerprint, s.tenant, s.seq_id, s.manifest, c.main.block_bytes(), c.tail.block_bytes(), pin)
            if pin:   # one DMA each from pinned memory
                sealed_payload = sealed_payload.to(c.main_device, non_blocking=True) if n_sealed else None
                tail_payload = tail_payload.to(c.tail.k.device, non_blocking=True) if n_tail else None
            self.counters["page_ins_disk"] += 1
        todo = [i for i in range(n_sealed) if i not in gpu_hits]
        new = c.main_pool.allocate(len(todo))
        new_tail = c.tail_pool.allocate(n_tail)
        assert new is not None and new_tail is not None, "GPU room was made"
        if todo:
            c.main.unpack(ids_to(c.main_device, new), sealed_payload[todo])
            self.counters["bytes_up"] += sealed_payload[todo].numel()
        if n_tail:
            c.tail.unpack(ids_to(c.tail.k.device, new_tail), tail_payload)
            self.counters["bytes_up"] += tail_payload.numel()
        sealed = [gpu_hits.get(i) for i in range(n_sealed)]
        for i, b in zip(todo, new):
            sealed[i] = b
            if c.sink_blocks + i < known:
                c.main_pool.set_hash(b, s.hashes[c.sink_blocks + i])
        for j, b in enumerate(new_tail):          # full sink and tail blocks are findable again
            i = c.tail_block_index(j, n_sealed)
            if i < known:
                c.tail_pool.set_hash(b, s.hashes[i])
        if s.tier == "host":
            self._release(s)
        else:
            self.disk.delete_sequence(c.fingerprint, s.tenant, s.seq_id, s.manifest["n_other"])
            s.manifest = None
        s.sealed, s.tail, s.tier = sealed, new_tail, "gpu"
        s.rebuilt_table()
        s.last_use = time.monotonic()

    def free(self, s: Sequence) -> None:
        if s.tier == "host":
            self._release(s)
        elif s.tier == "disk":
            self.disk.delete_sequence(self.c.fingerprint, s.tenant, s.seq_id, s.manifest["n_other"])

    # ---------------------------------------------------------- prefix hits
    def lookup_below(self, h: bytes) -> torch.Tensor | None:
        """Payload of a sealed block with hash h from the host or disk tier."""
        if self.host is not None:
            b = self.host.main_pool.lookup(h)
            if b is not None:
                self.counters["prefix_hits_host"] += 1
                self.host.settle()
                return self.host.main[b].clone()   # the slot may be reused before we copy
        if self.disk is not None:
            v = self.disk.get_block(self.c.fingerprint, h)
            if v is not None:
                self.counters["prefix_hits_disk"] += 1
                return torch.from_numpy(np.frombuffer(v, dtype=np.uint8).copy())
        return None

    def restore(self) -> int:
        """Register the sequences a previous daemon left on disk for this fingerprint."""
        if self.disk is None:
            return 0
        n = 0
        for m in self.disk.manifests(self.c.fingerprint):
            key = (m["tenant"], m["seq_id"])
            if key in self.c.seqs:
                continue
            s = Sequence(m["seq_id"], m["tenant"], self.c.cfg.geometry.num_layers, length=m["length"],
                         token_ids=m["token_ids"], hashes=[bytes.fromhex(h) for h in m["hashes"]],
                         hashed_upto=m["hashed_upto"])
            s.tier, s.manifest = "disk", m
            self.c.seqs[key] = s
            n += 1
        return n

    def stats(self) -> dict:
        out = dict(self.counters)
        if self.host is not None:
            out["host_main"] = self.host.main_pool.stats()
            out["host_tail"] = self.host.tail_pool.stats()
            out["host_bytes"] = self.host.nbytes()
        out["sequences_host"] = sum(1 for s in self.c.seqs.values() if s.tier == "host")
        out["sequences_disk"] = sum(1 for s in self.c.seqs.values() if s.tier == "disk")
        if self.disk is not None:
            out["disk"] = self.disk.store.stats()
        return out
