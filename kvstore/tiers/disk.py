"""The disk tier under a cache's GPU and host pools (docs/design.md, Tiers; the host
tier: host.py).

GPU pool -> pinned host pool -> LMDB. A block crosses tiers as its payload:
the bytes of every layer's K then V (codes for PQ blocks, fp16 for tail
blocks; storage.pack/unpack). Sequences move whole: in the host tier their
block ids point into the host pools; on disk they are a manifest plus block
values written in one LMDB transaction. Sealed blocks with a content hash are
stored under that hash (deduplicated, and found again after a restart). The
disk has a byte bound: DiskTier keeps its books.

Sequences are a cache's own: two caches of one fingerprint (the same model and
codebooks under two names) share blocks, never sequences. Their keys: disk_keys.py.
"""
from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvstore.errors import DataLoss, KVStoreError, ResourceExhausted, quote

from .disk_keys import FP_BYTES, block_key, describe, manifest_key, part, refs, seq_block, seq_block_key, seq_key
from .lmdb_store import LMDBStore, entry_bytes
from .staging import gather_checked

log = logging.getLogger("kvstore.lmdb")

@dataclass(slots=True)
class SeqImage:
    """One sequence as write_sequences stores it. hashed and others None: its
    blocks are on disk already and only the manifest is rewritten."""
    cache: str
    tenant: str
    seq_id: str
    manifest: dict
    hashed: list[tuple[bytes, torch.Tensor]] | None = None   # (content hash, payload row)
    others: list[torch.Tensor] | None = None                 # payload rows stored under the sequence


def _under_store_lock(fn):
    """Caches run requests in parallel and share one DiskTier per store: its
    books and the writes they decide (evictions, the byte bound) change
    together, under the store's lock (cold_store.LMDBStore)."""
    @functools.wraps(fn)
    def locked(self, *args, **kwargs):
        with self.store.lock:
            return fn(self, *args, **kwargs)
    return locked


class DiskTier:
    """Every cache's view of one LMDB store: one instance per store (of()),
    since the byte bound is the store's.

    The bound (store.max_bytes, 0: none) counts every entry. Content-hashed
    blocks that no sequence manifest references are a cache of prefix blocks:
    when a write needs room the least recently used of them go first. What a
    manifest holds (its blocks, hashed or not, and itself) is never evicted:
    a sequence write that cannot fit is refused whole (ResourceExhausted), a spill
    keeps what fits. Recency lives in memory (at open: key order)."""

    def __init__(self, store: LMDBStore):
        self.store = store
        self.pins: dict[bytes, int] = {}                         # block key -> manifests referencing it
        self.lru: OrderedDict[bytes, None] = OrderedDict()       # unreferenced block keys, oldest first
        self.lru_bytes = 0
        self.counters = dict(evictions=0, evicted_bytes=0, skipped_spills=0, dropped_sequences=0)
        self.device_checksums = None        # prepare(): the row check of restores to a GPU
        good = {k: json.loads(v) for k, v in store.scan(b"M")}     # checked: a refused manifest is not here
        refused = [k for k in store.keys(b"M") if k not in good] + [k for k in store.dropped_keys if k[:1] == b"M"]
        if refused:
            self._drop_sequences(refused)
        # What outlives a daemon is what was offloaded or persist (docs/operations.md, Signals): the
        # copies memory pressure made are no sequence's now, and would count as held under the bound.
        pressure = [k for k, m in good.items() if not (m.get("durable") or m.get("persist"))]
        if pressure:
            self._delete_sequences(pressure)
            for k in pressure:
                del good[k]
            log.info("LMDB store %s: dropped the disk copies of %d sequences that memory pressure, not Offload or "
                     "persist, had moved there (blocks stay cached): %s", store.path, len(pressure), _named(pressure))
        stray = [k for k in store.keys(b"S") if b"M" + k[1:-4] not in good]    # no manifest: a verification lost it
        if stray:
            store.write_batch([], stray, sync=True)
        short = [k for k, m in good.items() if not self._complete(k, m)]
        if short:
            # Listed all the same: a call naming one is DATA_LOSS naming it (read_sequence), not
            # NOT_FOUND as for an id never used, and Free drops what is left of it.
            log.warning("LMDB store %s: %d sequences miss blocks of their disk copy (dropped as damaged, or "
                        "deleted behind the store's back): listed, DATA_LOSS when a call pages one in; free "
                        "them: %s", store.path, len(short), _named(short))
        for k, m in good.items():
            for b in refs(k[1:1 + FP_BYTES], m):
                self.pins[b] = self.pins.get(b, 0) + 1
        for k in store.keys(b"B"):
            if k not in self.pins:
                self._unreferenced(k)
        self._fit_bound()       # a smaller bound than last time

    def prepare(self, device, checksums) -> None:
        """A cache on `device` restores from here. On a GPU, rows are checked where
        they land by checksums(rows [n, width] uint8) -> int64 [n] of XXH3-64s
        (kernels.xxh3_64_rows, from the engine: tiers import no kernels), run once
        now to build its kernel (else the first restore pays 0.9 s of JIT on an H100 host)."""
        if torch.device(device).type == "cuda":
            self.device_checksums = checksums
            checksums(torch.zeros((1, 256), dtype=torch.uint8, device=device))

    @classmethod
    def of(cls, store: LMDBStore) -> "DiskTier":
        if store.books is None:
            store.books = cls(store)
        return store.books

    def _complete(self, mk: bytes, m: dict) -> bool:
        """Whether every block the manifest under mk names is stored."""
        fp, seq = mk[1:1 + FP_BYTES], mk[1:]
        return (all(self.store.contains(k) for k in refs(fp, m))
                and all(self.store.contains(seq_block(seq, i)) for i in range(m["n_other"])))

    def _drop_sequences(self, mks: list[bytes]) -> None:
        """At open: sequences whose manifest was refused (or the start's verification dropped
        it) cannot be listed (what they hold is unknown): their manifests and own blocks go
        (durably), logged and counted; their hashed blocks stay cached (checked when read)."""
        self._delete_sequences(mks)
        self.counters["dropped_sequences"] += len(mks)
        log.warning("LMDB store %s: %d sequences dropped: their manifest failed its checksum or the start's "
                    "verification (what they held is unknown): %s", self.store.path, len(mks), _named(mks))

    def _delete_sequences(self, mks: list[bytes]) -> None:
        """At open, before the books: mks and their own blocks go, durably (hashed blocks stay cached)."""
        own = [k for mk in mks for k in self.store.keys(b"S" + mk[1:])]
        self.store.write_batch([], list(mks) + own, sync=True)

    # ------------------------------------------------------------ books
    def _unreferenced(self, k: bytes) -> None:
        self.lru[k] = None
        self.lru_bytes += self.store.size(k)

    def _pin(self, k: bytes) -> None:
        self.pins[k] = self.pins.get(k, 0) + 1
        if k in self.lru:
            del self.lru[k]
            self.lru_bytes -= self.store.size(k)

    def _unpin(self, k: bytes) -> None:
        self.pins[k] -= 1
        if not self.pins[k]:
            del self.pins[k]
            if self.store.contains(k):
                self._unreferenced(k)       # the newest of the cache: just released by a sequence

    def _fit_bound(self) -> None:
        """Over the bound (opened under a smaller one, a sequence written past it): the
        unreferenced blocks go until it holds, or none is left."""
        if self.store.max_bytes and self.store.used_bytes > self.store.max_bytes:
            evict = self._victims(0, set())
            self._write([], [], list(self.lru) if evict is None else evict)

    def _victims(self, need: int, keep: set[bytes]) -> list[bytes] | None:
        """Unreferenced blocks to delete, oldest first, so that need more bytes
        fit the bound; None if even all of them would not do."""
        if not self.store.max_bytes:
            return []
        over = self.store.used_bytes + need - self.store.max_bytes
        out = []
        for k in self.lru:
            if over <= 0:
                break
            if k not in keep:
                out.append(k)
                over -= self.store.size(k)
        return out if over <= 0 else None

    def _write(self, puts: list, deletes: list[bytes], evict: list[bytes], sync=False, keep=frozenset()) -> None:
        try:
            self._commit(puts, deletes, evict, sync)
        except ResourceExhausted as e:
            # A full filesystem (no bound, or other files filled it since): the oldest unreferenced blocks
            # (keep: this write's), as many bytes as it grows the store, go; their pages take the write.
            gone, spare, room = set(evict), [], self.store.growth(puts, deletes)
            for k in (self.lru if puts and e.field == "lmdb" else ()):
                if room > 0 and k not in keep and k not in gone:
                    spare.append(k)
                    room -= self.store.size(k)
            if not spare:
                raise
            log.warning("%s: dropping %d unreferenced prefix blocks for its pages", e, len(spare))
            self._commit([], [], spare)
            self._commit(puts, deletes, evict, sync)

    def _commit(self, puts: list, deletes: list[bytes], evict: list[bytes], sync: bool = False) -> None:
        freed = [(k, self.store.size(k)) for k in evict]
        self.store.write_batch(puts, deletes + evict, sync=sync)
        for k, n in freed:
            del self.lru[k]
            self.lru_bytes -= n
        self.counters["evictions"] += len(freed)
        self.counters["evicted_bytes"] += sum(n for _, n in freed)

    @_under_store_lock
    def held_bytes(self) -> int:
        """Bytes that sequences hold: never evicted by the bound."""
        return self.store.used_bytes - self.lru_bytes

    # -------------------------------------------------------- sequences
    @_under_store_lock
    def write_sequences(self, fp: bytes, images: list[SeqImage], sync: bool, past_bound: bool = False) -> int:
        """One transaction: per sequence its new hashed blocks, its other
        blocks and its manifest (replacing an older copy), plus the evictions
        that make room. Returns payload bytes written. ResourceExhausted, and nothing
        written, if it cannot fit the bound; past_bound (persist sequences at the stop):
        written anyway once every evictable block is gone (over it until freed)."""
        puts, deletes, pin, unpin, nbytes, new = [], [], [], [], 0, set()
        for im in images:
            mk = manifest_key(fp, im.cache, im.tenant, im.seq_id)
            old = self._manifest(mk)
            if im.others is not None:
                if old is not None:     # its other blocks go, or are overwritten just below
                    deletes += [seq_block_key(fp, im.cache, im.tenant, im.seq_id, i) for i in range(old["n_other"])]
                elif self.store.contains(mk):     # an old manifest that was refused: all its own blocks go
                    deletes += self.store.keys(b"S" + mk[1:])
                for h, payload in im.hashed:
                    k = block_key(fp, h)
                    if not self.store.contains(k) and k not in new:
                        new.add(k)
                        puts.append((k, _view(payload)))
                        nbytes += payload.numel()
                for i, payload in enumerate(im.others):
                    puts.append((seq_block_key(fp, im.cache, im.tenant, im.seq_id, i), _view(payload)))
                    nbytes += payload.numel()
            puts.append((mk, json.dumps(im.manifest).encode()))
            pin += refs(fp, im.manifest)
            unpin += refs(fp, old) if old is not None else []
        need = self.store.growth(puts, deletes)
        keep = set(pin) | {k for k, _ in puts}
        evict = self._victims(need, keep)
        if evict is None and past_bound:
            evict = [k for k in self.lru if k not in keep]
        if evict is None:
            raise ResourceExhausted("sequence_ids", f"the disk tier cannot take {need} more bytes: {self.held_bytes()} "
                                    f"of its {self.store.max_bytes} (--lmdb-max-bytes) are held by sequences")
        self._write(puts, deletes, evict, sync, keep)
        for k in pin:
            self._pin(k)
        for k in unpin:
            self._unpin(k)
        return nbytes

    @_under_store_lock
    def read_sequence(self, fp: bytes, cache: str, tenant: str, seq_id: str, manifest: dict, main_bytes: int,
                      tail_bytes: int, device, field: str = "sequence_ids"
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (sealed rows [n, main_bytes], tail rows [t, tail_bytes]) uint8 on
        device, read straight from LMDB's map (staging.gather: parallel copies
        into pinned memory overlapping the host-to-device copies), each row
        checked against its stored checksum (staging.gather_checked). field: the
        request's name for the sequence, which a DATA_LOSS names."""
        other = iter(range(manifest["n_other"]))
        seq = seq_key(fp, cache, tenant, seq_id)

        def keys(hashes):
            return [block_key(fp, bytes.fromhex(h)) if h else seq_block(seq, next(other)) for h in hashes]
        sealed_keys, tail_keys = keys(manifest["sealed_hashes"]), keys(manifest["tail_hashes"])
        out, checks, refused = [], [], []
        with self.store.reader(buffers=True) as txn:
            for ks, width in ((sealed_keys, main_bytes), (tail_keys, tail_bytes)):
                values, sums = zip(*(self.store.stored(txn, k) for k in ks)) if ks else ((), ())
                bad = [i for i, v in enumerate(values) if v is None or len(v) != width]
                if bad:
                    refused.append((ks, values, width, bad))
                if bad or not ks:
                    out.append(None)
                    continue
                rows, verdict = gather_checked(values, sums, width, device, self.device_checksums)
                out.append(rows)
                checks.append((ks, values, width, verdict))      # a device check runs while the next part is read
            refused += [(ks, values, width, bad) for ks, values, width, verdict in checks if (bad := verdict())]
            if refused:         # every part checked first, so that the count is the sequence's
                self._refuse_sequence(refused, len(sealed_keys) + len(tail_keys), tenant, seq_id, field)
        return out[0], out[1]

    def _refuse_sequence(self, refused, total: int, tenant, seq_id, field: str):
        for ks, values, width, bad in refused:
            for i in bad:
                if values[i] is not None and len(values[i]) == width:
                    self.store.refuse(ks[i])
        raise DataLoss(field, f"sequence {quote(seq_id)} (tenant {quote(tenant)}): "
                       f"{sum(len(r[3]) for r in refused)} of its {total} blocks on disk are missing or failed "
                       "their checksums; nothing was served (free the sequence to drop its disk copy)")

    @_under_store_lock
    def delete_sequence(self, fp: bytes, cache: str, tenant: str, seq_id: str, manifest: dict,
                        sync: bool = False) -> None:
        keys = [seq_block_key(fp, cache, tenant, seq_id, i) for i in range(manifest["n_other"])]
        self._write([], keys + [manifest_key(fp, cache, tenant, seq_id)], [], sync)
        for k in refs(fp, manifest):
            self._unpin(k)
        self._fit_bound()

    def manifests(self, fp: bytes, cache: str) -> list[dict]:
        return [json.loads(v) for _, v in self.store.scan(b"M" + fp + part(cache))]

    def _manifest(self, mk: bytes) -> dict | None:
        """The manifest under mk; None if there is none or it was refused
        (what it pinned then stays pinned: its references are unknown)."""
        v = self.store.get_many([mk])[0] if self.store.contains(mk) else None
        return None if v is None else json.loads(v)

    # ------------------------------------------------------ cached blocks
    @_under_store_lock
    def has_block(self, fp: bytes, h: bytes) -> bool:
        return self.store.contains(block_key(fp, h))

    @_under_store_lock
    def read_blocks(self, fp: bytes, hashes: list[bytes], width: int, device) -> torch.Tensor:
        """Payloads [n, width] uint8 on device of the leading blocks of `hashes`
        that are on disk (n < len(hashes) where one is missing: evicted since it
        was looked up), in one read transaction; they become the most recent."""
        keys = [block_key(fp, h) for h in hashes]
        values, sums = [], []
        with self.store.reader(buffers=True) as txn:
            for k in keys:
                v, s = self.store.stored(txn, k)
                if v is None or len(v) != width:
                    break
                values.append(v)
                sums.append(s)
            rows, verdict = gather_checked(values, sums, width, device, self.device_checksums)
        bad = verdict()
        if bad:           # served up to the first refused block; the refused ones no sequence holds go
            n = min(bad)
            for i in bad:
                self.store.refuse(keys[i])
            self._forget([keys[i] for i in bad if keys[i] in self.lru])
            rows = rows[:n]
        for k in keys[:len(rows)]:
            if k in self.lru:
                self.lru.move_to_end(k)
        return rows

    @_under_store_lock
    def put_blocks(self, fp: bytes, items: list[tuple[bytes, torch.Tensor]]) -> int:
        """Spill cached blocks: as many as fit the bound after evicting older
        unreferenced blocks, the rest skipped (all, where the filesystem refuses the
        write: a cached block is a copy nobody holds). Returns bytes written."""
        puts, new = [], set()
        for h, p in items:
            k = block_key(fp, h)
            if k in self.lru:
                self.lru.move_to_end(k)
            elif not self.store.contains(k) and k not in new:
                new.add(k)
                puts.append((k, _view(p)))
        if self.store.max_bytes:
            room = self.store.max_bytes - self.held_bytes()     # what evicting every older block leaves
            fit = 0
            while fit < len(puts) and entry_bytes(*puts[fit]) <= room:
                room -= entry_bytes(*puts[fit])
                fit += 1
            self.counters["skipped_spills"] += len(puts) - fit
            puts = puts[:fit]
        if not puts:
            return 0
        evict = self._victims(self.store.growth(puts, []), {k for k, _ in puts})
        assert evict is not None, "spills were cut to what the bound holds"
        try:
            self._write(puts, [], evict, keep={k for k, _ in puts})
        except KVStoreError as e:     # the filesystem refused (fs_errors): cached copies, not kept
            self.counters["skipped_spills"] += len(puts)
            log.warning("%s: %d cached blocks not spilled", e, len(puts))
            return 0
        for k, _ in puts:
            if k not in self.pins:      # else a block a damaged sequence's copy missed, back: held by it again
                self._unreferenced(k)
        return sum(v.nbytes for _, v in puts)

    def _forget(self, keys: list[bytes]) -> None:
        """Delete unreferenced blocks that were refused when read."""
        if keys:
            sizes = [self.store.size(k) for k in keys]
            self.store.write_batch([], keys)
            for k, n in zip(keys, sizes):
                del self.lru[k]
                self.lru_bytes -= n

    # ------------------------------------------------------------- state
    def sync(self) -> None:
        self.store.sync()

    @_under_store_lock
    def stats(self) -> dict:
        return dict(self.store.stats(), held_bytes=self.held_bytes(), **self.counters)

    @_under_store_lock
    def check_invariants(self) -> None:
        """The books: unreferenced blocks are exactly the stored block keys no
        manifest pins, and their bytes add up."""
        assert self.lru.keys().isdisjoint(self.pins), "a block is both referenced and evictable"
        stored = self.store.keys(b"B")
        assert all(k in self.lru or k in self.pins for k in stored), "a stored block is missing from the books"
        assert all(self.store.contains(k) for k in self.lru), "an evictable block is not stored"
        assert self.lru_bytes == sum(self.store.size(k) for k in self.lru), "evictable bytes drifted"
        # Over the bound only with nothing left to evict (a store opened under a smaller bound).
        assert not self.store.max_bytes or self.store.used_bytes <= self.store.max_bytes or not self.lru, \
            "over the byte bound"


def _named(mks: list[bytes]) -> str:
    """The first sequences of manifest keys, for a log line."""
    return ", ".join(describe(mk) for mk in mks[:8]) + (" ..." if len(mks) > 8 else "")


def _view(payload: torch.Tensor) -> memoryview:
    return memoryview(payload.contiguous().numpy())
