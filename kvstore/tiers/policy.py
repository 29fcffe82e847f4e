"""Moving a cache's blocks between GPU, host and disk (docs/design.md, Tiers).

Policy: when an allocation would fail, the least recently used sequences that
nobody is writing to (no pending or reserved tokens, not in the request at
hand) move down whole: to the pinned host pool, or to LMDB when the host is
full or absent. Cached (freed, hashed) GPU blocks are copied to the host
before their slot is reused, and host cached blocks to LMDB, so prefix hits
survive eviction (below.py). Any access pages a sequence back in; Offload writes it to
LMDB and returns once the transaction is durable, and that copy stays until
the sequence is freed or changed. Holes (engine/window.py) stay holes: never moved.

Books: every move takes the references it needs first (hits it will share,
so that making room can neither move nor reuse them), then makes room, then
allocates what it checked, and on any failure gives back all it took.
"""
from __future__ import annotations

import logging
import time
from array import array
from collections import Counter

from kvstore.core.hashing import fp16_key, form_key
from kvstore.core.sequence import Sequence
from kvstore.errors import FailedPrecondition, ResourceExhausted

from .below import CachedBelow
from .disk import DiskTier, SeqImage, block_key
from .host import HostTier
from .interface import TieredCache
from .manifests import layout, legacy_layout, made_with, unlisted_elsewhere, warn_unlisted
from .staging import index, to_host

log = logging.getLogger("kvstore.tiers")

# Manifest fields a restart needs, on disk but not in memory (the sequence holds them).
_HELD = ("token_ids", "hashes")


def _written(s: Sequence, manifest: dict) -> dict:
    """The manifest as written to disk: with s's token ids and hashes."""
    return dict(manifest, token_ids=s.token_ids.tolist(), hashes=[h.hex() for h in s.hashes])


class Tiering(CachedBelow):
    def __init__(self, cache: TieredCache, host: HostTier | None, disk: DiskTier | None):
        self.c = cache
        self.host = host
        self.disk = disk
        self._refused = ""      # why the disk tier refused the sequence make_room moved down last
        self.counters = dict(offloads_host=0, offloads_disk=0, page_ins_host=0, page_ins_disk=0,
                             bytes_down=0, bytes_up=0, spilled_blocks=0, prefix_hits_host=0, prefix_hits_disk=0,
                             bytes_down_host=0, bytes_down_disk=0, bytes_up_host=0, bytes_up_disk=0)
        self._hooks()

    def _moved(self, way: str, tier: str, n: int) -> None:
        """n bytes moved down to / up from tier: the total and the tier's share."""
        self.counters[way] += n
        self.counters[f"{way}_{tier}"] += n

    # --------------------------------------------------------------- room
    def make_room(self, main: int, tail: int, protect: set, whole: bool = True) -> str | None:
        """Move LRU sequences down until the GPU pools can give main + tail blocks -> None,
        or why not: the disk tier's refusal of a sequence ("" where moving every movable
        sequence would not make room, or the host tier cannot take them). Blocks the
        caller holds references on stay where they are. Where moving every movable
        sequence would not make room, none moves: a refused call changes nothing. whole=False
        (some room helps: a prefix hit, the low watermark) moves what the host tier takes."""
        c = self.c
        self._refused = ""
        if not c.fits_after_moves(main, tail, protect) or (whole and not self._host_takes(main, tail, protect)):
            return ""
        movable = c.movable(protect)
        while not c.gpu_fits(main, tail):
            victim = _lru(s for s in movable if s.tier == "gpu")
            if victim is None or not self.move_down(victim, protect):
                return self._refused
        return None

    def _host_takes(self, main: int, tail: int, protect: set) -> bool:
        """Without a disk tier, whether the host tier could take, in make_room's order, the
        sequences it moves until the GPU pools give main + tail (host room at its least)."""
        c, h = self.c, self.host
        if self.disk is not None:          # the disk takes what the host cannot (its bound aside)
            return True
        host = [h.main_pool.num_allocatable(), h.tail_pool.num_allocatable()]
        gpu = [c.main_pool.num_allocatable(), c.tail_pool.num_allocatable()]
        moved, planned = Counter(), set()
        for s in sorted(c.movable(protect), key=lambda s: s.last_use):
            if c.pools_fit(main, tail, *gpu):
                return True
            hashes = [self._sealed_hash(s, i) for i in range(s.freed, len(s.sealed))]
            new = [x for x in hashes if x is None or (x not in planned and h.main_pool.lookup(x) is None)]
            host = [host[0] - len(new), host[1] - len(s.tail)]
            if min(host) < 0:
                return False
            planned.update(x for x in new if x is not None)
            for pool, blocks in ((c.main_pool, s.held_sealed()), (c.tail_pool, s.tail)):
                for b in blocks:
                    moved[id(pool), b] += 1
                    if moved[id(pool), b] == pool.blocks[b].ref_cnt:      # its last reference moved
                        gpu[0 if pool is c.main_pool else 1] += 1     # codec fp16: one pool
        return c.pools_fit(main, tail, *gpu)

    def move_down(self, s: Sequence, protect: set = frozenset()) -> bool:
        """GPU -> host if it fits there, else -> disk. False: no room below."""
        if self.host is not None and self.to_host(s, protect):
            return True
        if self.disk is None:
            return False
        try:
            self._to_disk([s], durable=False)
        except ResourceExhausted as e:
            self._refused = e.message
            return False
        return True

    def _host_room(self, main: int, tail: int, protect: set) -> bool:
        """Move LRU host sequences to disk until the host pools can give main + tail."""
        h = self.host
        if main > h.main_pool.capacity or tail > h.tail_pool.capacity:
            return False
        while h.main_pool.num_allocatable() < main or h.tail_pool.num_allocatable() < tail:
            victim = _lru(v for v in self.c.seqs.values() if v.tier == "host" and id(v) not in protect)
            if victim is None or self.disk is None:
                return False
            try:
                self._to_disk([victim], durable=False)
            except ResourceExhausted as e:
                self._refused = e.message
                return False
        return True

    def _sealed_hash(self, s: Sequence, j: int) -> bytes | None:
        """Content hash of sealed block j (behind the sink blocks), if registered."""
        i = self.c.sink_blocks + j
        return s.hashes[i] if i < min(s.hashed_upto, len(s.hashes)) else None

    # ------------------------------------------------------------- moves
    def to_host(self, s: Sequence, protect: set = frozenset()) -> bool:
        """GPU -> host, sharing blocks the host already holds. False (and
        nothing changed but host sequences moved to disk) if it does not fit."""
        c, h = self.c, self.host
        assert s.tier == "gpu"
        hits = {}
        for i in range(s.freed, len(s.sealed)):
            hi = self._sealed_hash(s, i)
            hb = h.main_pool.lookup(hi) if hi is not None else None
            if hb is not None:
                hits[i] = hb
        h.main_pool.ref(list(hits.values()))
        todo = [i for i in range(s.freed, len(s.sealed)) if i not in hits]
        alloc = tail_ids = None
        done = False
        try:
            if not self._host_room(len(todo), len(s.tail), protect | {id(s)}):
                return False
            alloc = h.main_pool.allocate(len(todo))
            tail_ids = h.tail_pool.allocate(len(s.tail))
            assert alloc is not None and tail_ids is not None, "host room was made"
            if todo:
                payload = c.main_io.pack([s.sealed[i] for i in todo])
                h.put(h.main, alloc, payload)
                self._moved("bytes_down", "host", payload.numel())
            if s.tail:
                payload = c.tail_io.pack(s.tail)
                h.put(h.tail, tail_ids, payload)
                self._moved("bytes_down", "host", payload.numel())
            host_main = [hits.get(i, c.null_block) for i in range(len(s.sealed))]     # holes stay holes
            for i, hb in zip(todo, alloc):
                host_main[i] = hb
                hi = self._sealed_hash(s, i)
                if hi is not None:
                    h.main_pool.set_hash(hb, hi)
            known = min(s.hashed_upto, len(s.hashes))
            for j, hb in enumerate(tail_ids if c.is_pq else []):     # full fp16 blocks stay findable there
                i = c.tail_block_index(j, len(s.sealed))
                if i < known:
                    h.tail_pool.set_hash(hb, fp16_key(s.hashes[i]))
            done = True
        finally:
            if not done:
                h.tail_pool.release(tail_ids or [])
                h.main_pool.release((alloc or []) + list(hits.values()))
        self._release(s)
        s.sealed, s.tail, s.tier = host_main, tail_ids, "host"
        s.rebuilt_table()
        self.counters["offloads_host"] += 1
        return True

    def offload(self, seqs: list[Sequence], past_bound: bool = False) -> None:
        """Offload: every sequence durable on disk, or (ResourceExhausted) none moved
        (past_bound: DiskTier.write_sequences)."""
        if self.disk is None:
            raise FailedPrecondition("sequence_ids", "no disk tier configured (start the daemon with --lmdb PATH)")
        self._to_disk(seqs, durable=True, past_bound=past_bound)
        self._fp16_forms_to_disk(seqs)

    def _fp16_forms_to_disk(self, seqs: list[Sequence]) -> None:
        """The fp16 forms the GPU tail pool still holds of the sequences' blocks go
        to disk too (as spills, below.py): those of blocks sealed since their prompt
        are in no image, and without them the prompt's tail range misses after a
        restart (a generated token seals what was the prompt's fp16 tail)."""
        c, found = self.c, {}
        for s in seqs if c.is_pq else []:
            for h in s.hashes[c.sink_blocks:min(s.hashed_upto, len(s.hashes))]:
                tb = c.tail_pool.lookup(h)
                if tb is not None and not self.disk.has_block(c.fingerprint, fp16_key(h)):
                    found[h] = tb
        if found:
            rows = to_host(c.tail_io.pack(list(found.values())))
            self._spill_disk([(fp16_key(h), r) for h, r in zip(found, rows)], rows.shape[1])

    def _to_disk(self, seqs: list[Sequence], durable: bool, past_bound: bool = False) -> None:
        """Write the sequences to LMDB in one transaction, then let go of their blocks.
        A sequence whose disk copy is current is not written again."""
        c = self.c
        images = []
        for s in seqs:
            m = s.manifest
            if m is None:
                images.append(self._image(s, durable))
            elif durable and not m.get("durable"):      # a pressure copy, durable from now on
                images.append(SeqImage(c.cfg.name, s.tenant, s.seq_id, _written(s, dict(m, durable=True))))
        if images:
            self._moved("bytes_down", "disk", self.disk.write_sequences(c.fingerprint, images, sync=durable,
                                                                            past_bound=past_bound))
        elif durable:
            self.disk.sync()
        written = {(im.tenant, im.seq_id): {k: v for k, v in im.manifest.items() if k not in _HELD}
                   for im in images}
        for s in seqs:
            s.manifest = written.get((s.tenant, s.seq_id), s.manifest)
            if s.tier != "disk":
                self._release(s)
                s.sealed, s.tail, s.tier = [], [], "disk"
                s.rebuilt_table()
                self.counters["offloads_disk"] += 1

    def _image(self, s: Sequence, durable: bool) -> SeqImage:
        c, held = self.c, s.held_sealed()
        if s.tier == "gpu":
            sealed = to_host(c.main_io.pack(held)) if held else None
            tail = to_host(c.tail_io.pack(s.tail)) if s.tail else None
        else:
            self.host.settle()
            sealed = self.host.main[held] if held else None
            tail = self.host.tail[s.tail] if s.tail else None
        # Blocks with a content hash go under their key (deduplicated, found by
        # prefix lookups after a restart): sealed blocks and, codec fp16, every
        # block under the hash; a pq cache's fp16 blocks under fp16_key (below.py).
        hashed, others, block_hashes = [], [], []
        known = min(s.hashed_upto, len(s.hashes))
        rows = [sealed[i] for i in range(len(held))] + [tail[j] for j in range(len(s.tail))]
        index = ([c.sink_blocks + s.freed + i for i in range(len(held))]     # block index of each row
                 + [c.tail_block_index(j, len(s.sealed)) for j in range(len(s.tail))])
        for r, (i, payload) in enumerate(zip(index, rows)):
            if i < known:
                k = form_key(s.hashes[i], c.is_pq and r >= len(held))
                hashed.append((k, payload))
                block_hashes.append(k.hex())
            else:
                others.append(payload)
                block_hashes.append("")
        manifest = dict(seq_id=s.seq_id, tenant=s.tenant, length=s.length, hashed_upto=s.hashed_upto,
                        sealed_hashes=block_hashes[:len(held)], tail_hashes=block_hashes[len(held):],
                        n_tail=len(s.tail), n_other=len(others), durable=durable, freed=s.freed,
                        layout=layout(c.cfg), made_with=made_with(c), persist=s.persist, pinned=s.pinned)
        return SeqImage(c.cfg.name, s.tenant, s.seq_id, _written(s, manifest), hashed, others)

    def _release(self, s: Sequence) -> None:
        if s.tier == "gpu":
            self.c.tail_pool.release(s.tail[::-1])
            self.c.main_pool.release(s.held_sealed()[::-1])
        elif s.tier == "host":
            self.host.tail_pool.release(s.tail[::-1])
            self.host.main_pool.release(s.held_sealed()[::-1])

    def page_in(self, s: Sequence, protect: set, field: str = "sequence_ids") -> None:
        """Bring a host or disk sequence back to the GPU pools. A durable disk
        copy stays (Offload's promise), and so does a persist sequence's pressure
        copy, its one way through a kill, until the sequence changes; another goes."""
        c = self.c
        if s.tier == "gpu":
            return
        held = s.held_sealed()                    # the rows below: holes were never moved
        n_sealed = s.held_sealed_count()
        n_tail = len(s.tail) if s.tier == "host" else s.manifest["n_tail"]
        h0 = c.sink_blocks + s.freed              # block index of row 0
        # Read first: a copy that cannot be read fails before anything changes.
        if s.tier == "host":
            sealed_payload = self.host.get(self.host.main, held, c.main_io.device) if held else None
            tail_payload = self.host.get(self.host.tail, s.tail, c.tail_io.device) if s.tail else None
        else:
            sealed_payload, tail_payload = self.disk.read_sequence(
                c.fingerprint, c.cfg.name, s.tenant, s.seq_id, s.manifest, c.main_io.block_bytes(),
                c.tail_io.block_bytes(), c.main_io.device, field)
        known = min(s.hashed_upto, len(s.hashes))
        hits = {i: c.main_pool.lookup(s.hashes[h0 + i]) for i in range(n_sealed) if h0 + i < known}
        hits = {i: b for i, b in hits.items() if b is not None}
        c.main_pool.ref(list(hits.values()))
        todo = [i for i in range(n_sealed) if i not in hits]
        new = new_tail = None
        done = False
        try:
            refused = self.make_room(len(todo), n_tail, protect | {id(s)})
            if refused is not None:
                raise ResourceExhausted(field, f"no GPU room to page in sequence {s.seq_id!r}"
                                               + (f" (a sequence could not move down: {refused})" if refused else ""))
            new = c.main_pool.allocate(len(todo))
            new_tail = c.tail_pool.allocate(n_tail)
            assert new is not None and new_tail is not None, "GPU room was made"
            if todo:
                rows = sealed_payload if len(todo) == n_sealed else sealed_payload[index(sealed_payload.device, todo)]
                c.main_io.unpack(new, rows)
                self._moved("bytes_up", s.tier, rows.numel())
            if n_tail:
                c.tail_io.unpack(new_tail, tail_payload)
                self._moved("bytes_up", s.tier, tail_payload.numel())
            done = True
        finally:
            if not done:
                c.tail_pool.release(new_tail or [])
                c.main_pool.release((new or []) + list(hits.values()))
        sealed = [hits.get(i) for i in range(n_sealed)]
        for i, b in zip(todo, new):
            sealed[i] = b
            if h0 + i < known:      # not put to Redis again: it went up when it was first hashed
                c.main_pool.set_hash(b, s.hashes[h0 + i], announce=False)
        for j, b in enumerate(new_tail):          # full sink and tail blocks are findable again
            i = c.tail_block_index(j, s.freed + n_sealed)
            if i < known:                         # not put to Redis again: below.py puts what spills
                c.hash_fp16(b, i, s.hashes[i], announce=False)
        below = s.tier
        self._release(s)
        s.sealed, s.tail, s.tier = [c.null_block] * s.freed + sealed, new_tail, "gpu"
        s.rebuilt_table()
        s.last_use = time.monotonic()
        self.counters["page_ins_" + below] += 1
        if below == "disk" and not s.manifest.get("durable") and not s.persist:
            self.disk.delete_sequence(c.fingerprint, c.cfg.name, s.tenant, s.seq_id, s.manifest)
            s.manifest = None

    def changing(self, s: Sequence) -> None:
        """s is about to change: its disk copy goes first (durably, so that a
        restart cannot bring back what it no longer is)."""
        if s.manifest is not None:
            assert s.tier != "disk", "a sequence on disk changes only after a page-in"
            self.disk.delete_sequence(self.c.fingerprint, self.c.cfg.name, s.tenant, s.seq_id, s.manifest, sync=True)
            s.manifest = None

    def free(self, s: Sequence) -> None:
        """The disk copy and host blocks of a sequence being freed (GPU blocks: Cache.free)."""
        if s.manifest is not None:
            self.disk.delete_sequence(self.c.fingerprint, self.c.cfg.name, s.tenant, s.seq_id, s.manifest)
            s.manifest = None
        if s.tier == "host":
            self._release(s)

    def restore(self) -> int:
        """Register the sequences a previous daemon offloaded (Offload, persist) for this
        fingerprint: what outlives a restart (docs/operations.md, Signals; the copies memory
        pressure made of other sequences went when the store was opened: DiskTier)."""
        if self.disk is None:
            return 0
        n, mine, other = 0, layout(self.c.cfg), {}
        for m in self.disk.manifests(self.c.fingerprint, self.c.cfg.name):
            key = (m["tenant"], m["seq_id"])
            if key in self.c.seqs:
                continue
            theirs = m.get("layout") or legacy_layout(self.c, m)
            if theirs != mine:                  # left on disk, untouched, for a cache of its spec
                for f in mine:
                    if theirs.get(f) != mine[f]:
                        other.setdefault(f, (theirs.get(f), mine[f], []))[2].append(m["seq_id"])
                continue
            s = Sequence(m["seq_id"], m["tenant"], self.c.cfg.geometry.num_layers, length=m["length"],
                         token_ids=array("i", m.pop("token_ids")), hashes=[bytes.fromhex(h) for h in m.pop("hashes")],
                         hashed_upto=m["hashed_upto"], freed=m.get("freed", 0))
            s.tier, s.manifest = "disk", m
            s.persist, s.pinned = m.get("persist", False), m.get("pinned", False)    # no session holds it now
            self.c.seqs[key] = s
            n += 1
        for f, (theirs, ours, ids) in other.items():
            warn_unlisted(self.c.cfg.name, ids, f, repr(theirs), repr(ours))
        if not (self.c.is_pq and not self.c.codebooks_sha):     # until its codebooks come, any would differ
            unlisted_elsewhere(self.c, self.disk.store)
        return n

    def stats(self) -> dict:
        out = dict(self.counters)
        if self.host is not None:
            out.update(host_main=self.host.main_pool.stats(), host_tail=self.host.tail_pool.stats(),
                       host_bytes=self.host.nbytes())
        for tier in ("host", "disk"):
            out["sequences_" + tier] = sum(1 for s in self.c.seqs.values() if s.tier == tier)
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out

    def check_invariants(self) -> None:
        """The disk books, and every disk copy a sequence claims is there and pinned."""
        if self.disk is None:
            return
        self.disk.check_invariants()
        for s in self.c.seqs.values():
            if s.manifest is not None:
                for h in s.manifest["sealed_hashes"] + s.manifest["tail_hashes"]:
                    assert not h or self.disk.pins.get(block_key(self.c.fingerprint, bytes.fromhex(h))), \
                        f"{s.seq_id}: a block of its disk copy is not pinned"


def _lru(seqs) -> Sequence | None:
    return min(seqs, key=lambda s: s.last_use, default=None)
