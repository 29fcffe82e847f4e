"""One cache namespace: its pools, tensors and sequences; allocation with
prefix hits, fork and free. The write and read paths (docs/design.md) are in
write_path.py and read_path.py. Every method validates all of its input
before it changes any state, so a rejected call leaves the cache as it was."""
from __future__ import annotations

import math
import threading
from array import array

import torch

from kvstore import kernels
from kvstore.codec.codebooks import Codebooks, fingerprint
from kvstore.core.block_pool import BlockPool
from kvstore.core.config import CacheConfig
from kvstore.core.hashing import chain_hashes, tenant_root
from kvstore.core.names import check_name
from kvstore.core.sequence import Sequence, token_array
from kvstore.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, quote
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.policy import Tiering
from kvstore.tiers.redis import RedisTier

from . import books, prefix
from .block_io import BlockIO
from .decode_graphs import DecodeGraphs
from .read_path import ReadPath
from .results import AllocateResult
from .storage import Fp16Store, PQStore
from .storage import ids_to
from .window import MAX_POSITIONS, WindowedBlocks
from .write_path import WritePath


class Cache(WritePath, ReadPath, WindowedBlocks):
    def __init__(self, cfg: CacheConfig, cold_store=None, redis_store=None):
        self.cfg = cfg
        # Guards everything below: every request on this cache holds it, so a
        # long request here never waits on, or stalls, another cache (Engine).
        self.lock = threading.RLock()
        self.bs = cfg.block_size
        self.is_pq = cfg.codec.kind == "pq"
        self.sinks = cfg.sinks                    # S: fp16 tokens at the front of every sequence
        self.sink_blocks = self.sinks // self.bs
        self.main_pool = BlockPool(cfg.capacity_blocks())
        if self.is_pq:
            self.main: PQStore | Fp16Store = PQStore(cfg, self.main_pool.capacity)
            self.tail_pool = BlockPool(cfg.tail_capacity_blocks())
            self.tail = Fp16Store(cfg, self.tail_pool.capacity)
            self.tail_pool.on_evict = self._tail_evicted
        else:
            # The fp16 codec needs no separate tail: sealing just relabels blocks.
            self.main = Fp16Store(cfg, self.main_pool.capacity)
            self.tail_pool, self.tail = self.main_pool, self.main
        # The pools' blocks as payloads, what the tiers move (tiers/interface.py).
        self.main_io = BlockIO(self.main, self.main_device)
        self.tail_io = BlockIO(self.tail, self.tail.k.device) if self.is_pq else self.main_io
        # The most committed tokens one sequence can ever hold: every main-pool
        # block sealed, plus the sinks and the R + block_size tail it keeps in
        # fp16 (the fp16 codec keeps them in the main pool too). A longer prompt
        # or append can never fit: it is misuse, not a lack of room.
        self.max_tokens = self.main_pool.capacity * self.bs + (
            self.sinks + cfg.residual + self.bs if self.is_pq else 0)
        self.codebooks: Codebooks | None = None
        self.codebooks_sha = ""           # theirs, hashed once: GetCache asks it on every adapter request
        self.fingerprint = fingerprint(cfg, None)
        self.seqs: dict[tuple[str, str], Sequence] = {}
        self.counters = dict(prefix_query_tokens=0, prefix_hit_tokens=0, appended_tokens=0,
                             sealed_blocks=0, dedup_blocks=0, attend_calls=0)
        self.init_window()                # every layer slides: blocks that left the window go (window.py)
        self.protect: set[int] = set()    # ids of the sequences of the request at hand
        self.graphs = DecodeGraphs()      # CUDA graphs of small decode steps (decode_graphs.py)
        host = disk = None
        if cfg.host_bytes:
            host = HostTier(self.main.block_bytes(), self.tail.block_bytes(), cfg.host_blocks(),
                            pin=cfg.device.startswith("cuda"))
        if cold_store is not None:
            disk = DiskTier.of(cold_store)
            disk.prepare(self.main_device, kernels.xxh3_64_rows)
        self.tiering = Tiering(self, host, disk) if (host or disk) else None
        if self.tiering is not None and not self.is_pq:
            self.tiering.restore()
        # The shared Redis tier below both (tiers/redis.py): hashed main-pool blocks go up to it, prefix misses ask it.
        self.redis = RedisTier(redis_store, self) if redis_store is not None else None
        if self.redis is not None and self.tiering is None:     # else its spills put them (tiers/below.py)
            self.main_pool.on_evict = lambda evicted: self.redis.spill(evicted, fp16=False)

    def changing(self, s: Sequence) -> None:
        """s's committed tokens are about to change: a disk copy of what it
        was goes first."""
        if s.manifest is not None:
            self.tiering.changing(s)

    def after_write(self, publish: bool = True) -> None:
        """Publish the blocks this write hashed (publish: their data is in place);
        keep free GPU blocks above the low watermark."""
        if publish:
            self.publish()
        if self.tiering is None or not self.cfg.low_watermark:
            return
        want = int(self.cfg.low_watermark * self.main_pool.capacity)
        if self.main_pool.num_allocatable() < want:
            self.tiering.make_room(want, 0, self.protect, whole=False)

    def publish(self) -> None:
        """Queue the main-pool blocks hashed since the last call for the Redis
        tier. Called after the request's encodes (they are in the blocks by then)."""
        if self.redis is not None:
            self.redis.flush()

    # ------------------------------------------------------------ codebooks
    def set_codebooks(self, cb: Codebooks) -> None:
        if not self.is_pq:
            raise FailedPrecondition("codebooks", f"cache {quote(self.cfg.name)} uses the fp16 codec")
        cb.validate(self.cfg)
        if self.seqs:
            raise FailedPrecondition("codebooks", f"cache {quote(self.cfg.name)} has {len(self.seqs)} live sequences; "
                                     "codebooks can change only on an empty cache")
        self.main.set_codebooks(cb)
        self.graphs.clear()                # captured with the old codebooks' addresses
        self.codebooks, self.codebooks_sha = cb, cb.sha256()
        self.fingerprint = fingerprint(self.cfg, cb)
        # Blocks hashed under the old fingerprint must never be found again.
        self.main_pool.clear_hashes()
        self.tail_pool.clear_hashes()
        if self.tiering is not None:
            if self.tiering.host is not None:
                self.tiering.host.main_pool.clear_hashes()
                self.tiering.host.tail_pool.clear_hashes()
            self.tiering.restore()

    def _require_ready(self) -> None:
        if self.is_pq and self.codebooks is None:
            raise FailedPrecondition("codebooks", f"cache {quote(self.cfg.name)} has no codebooks yet "
                                     "(SetCodebooks or TrainCodebooks first)")

    # ------------------------------------------------------------- helpers
    def seq(self, tenant: str, seq_id: str, field: str = "sequence_id") -> Sequence:
        """field: the request's name for the id (sequence_ids where a request names several)."""
        s = self.seqs.get((tenant, seq_id))
        if s is None:
            raise NotFound(field, f"no sequence {quote(seq_id)} in cache {quote(self.cfg.name)}")
        return s

    def sealed_count(self, length: int) -> int:
        """Sealed blocks a sequence of `length` committed tokens has: after the
        S sink tokens, the tail keeps at most R + block_size tokens."""
        return max(0, math.ceil((length - self.sinks - self.cfg.residual - self.bs) / self.bs))

    # Positions map to blocks as: block i < sink_blocks is tail[i]; the sealed
    # blocks follow; then tail[sink_blocks:] (core/sequence.py).
    def tail_index(self, s: Sequence, pos: torch.Tensor) -> torch.Tensor:
        """Host positions of fp16 tokens -> their index in the concatenated tail blocks."""
        return torch.where(pos < self.sinks, pos, pos - len(s.sealed) * self.bs)

    def tail_block_index(self, j: int, n_sealed: int) -> int:
        """Block index (in position order) of tail[j] when n_sealed blocks are sealed."""
        return j if j < self.sink_blocks else j + n_sealed

    def block_at(self, s: Sequence, i: int) -> tuple[BlockPool, int]:
        """(pool, block id) of the sequence's block i in position order."""
        j = i - self.sink_blocks
        if 0 <= j < len(s.sealed):
            return self.main_pool, s.sealed[j]
        return self.tail_pool, s.tail[i if j < 0 else i - len(s.sealed)]

    def check_length(self, n: int, field: str) -> None:
        """A sequence holding n committed tokens in its blocks must fit the cache (max_tokens)."""
        if n > self.max_tokens:
            raise InvalidArgument(field, f"a sequence of {n} tokens: one sequence of cache {quote(self.cfg.name)} "
                                  f"holds at most {self.max_tokens} (its pools' capacity)")

    def prompt_ids(self, prompt) -> array:
        """Check a prompt's ids (count first, before anything is copied) -> array('i').
        A cache that frees what left the window holds at most the window of a prompt's hits."""
        if self.window and len(prompt) > MAX_POSITIONS:
            raise InvalidArgument("prompt_token_ids", f"{len(prompt)} tokens: more than {MAX_POSITIONS} positions")
        if not self.window:
            self.check_length(len(prompt), "prompt_token_ids")
        return token_array(prompt, "prompt_token_ids")

    def _check_new_sequence(self, tenant: str, seq_id: str, field: str = "sequence_id") -> None:
        """field: the request field naming the new id (Fork: new_sequence_id)."""
        check_name(field, seq_id)
        if (tenant, seq_id) in self.seqs:
            raise AlreadyExists(field, f"sequence {quote(seq_id)} already exists")
        if len(self.seqs) >= self.cfg.max_sequences:
            raise ResourceExhausted(field, f"cache holds max_sequences={self.cfg.max_sequences}")

    def _alloc_tail(self, n: int, field: str = "tail") -> list[int]:
        """n fp16 blocks (the tail pool; the main pool for codec fp16), zeroed.

        NOTE: their slots are written token by token, and a Reserve commits
        slots whatever the client wrote into them; a block keeps whatever its
        previous owner (any tenant) left in it, so it is cleared here, on the
        stream of the call (ordered before a mapped client's writes by the
        Reserve's CUDA scope). Blocks that are written whole as they are
        handed out (sealing, page-in, prefix blocks from a lower tier) come
        straight from the pools."""
        ids = self.tail_pool.allocate(n) if n > 0 else []
        if ids is None:
            raise ResourceExhausted(field, f"need {n} fp16 tail blocks, {self.tail_pool.num_allocatable()} free")
        if ids:
            self.tail.zero_blocks(ids_to(self.tail.k.device, ids))
        return ids

    def _root(self, tenant: str) -> bytes:
        """h_{-1}: tenants share prefix blocks only if the cache says so."""
        return tenant_root(tenant, self.cfg.share_prefixes_across_tenants)

    def _extend_hashes(self, s: Sequence) -> None:
        parent = s.hashes[-1] if s.hashes else self._root(s.tenant)
        s.hashes += chain_hashes(s.token_ids, self.bs, self.fingerprint, parent, start_block=len(s.hashes))

    def _register_hashes(self, s: Sequence) -> None:
        """Make committed full blocks findable by prefix lookups."""
        full = s.length // self.bs
        while s.hashed_upto < min(full, len(s.hashes)):
            i = s.hashed_upto
            pool, bid = self.block_at(s, i)
            if self.sink_blocks <= i < self.sink_blocks + s.freed:    # a hole holds nothing
                pass
            elif self.is_pq and pool is self.tail_pool:
                self.hash_fp16(bid, i, s.hashes[i])
            else:
                pool.set_hash(bid, s.hashes[i])
            s.hashed_upto += 1

    # ------------------------------------------------------------- allocate
    def prompt_hashes(self, tenant: str, prompt: array) -> tuple[bytes, list[bytes]]:
        """-> (the fingerprint they were made with, the chained hashes of the
        prompt's full blocks). Reads no state but the fingerprint: callers run it
        outside the cache lock (a long prompt hashes for a while) and pass it to
        allocate(), which redoes it if the codebooks changed in between."""
        fp = self.fingerprint
        return fp, chain_hashes(prompt, self.bs, fp, self._root(tenant))

    def allocate(self, tenant: str, seq_id: str, prompt, hashed: tuple[bytes, list[bytes]] | None = None
                 ) -> AllocateResult:
        """prompt: token ids (a list, or prompt_ids()' array); hashed: prompt_hashes() of it."""
        self._require_ready()
        self._check_new_sequence(tenant, seq_id)
        prompt = self.prompt_ids(prompt)
        if hashed is None or hashed[0] != self.fingerprint:
            hashed = self.prompt_hashes(tenant, prompt)
        hashes = hashed[1]
        p = prefix.search(self, hashes, self.sealed_count(len(prompt)))
        hits = p.hits
        if hits and len(hits) * self.bs == len(prompt):
            hits.pop()     # the caller must compute at least one token to get logits
        # Hold every hit first, so that making room for the fresh blocks can
        # neither move nor reuse them (an "encode" source only until encoded).
        self.main_pool.ref([b for kind, b in hits if kind == "main"])
        self.tail_pool.ref([b for kind, b in hits if kind in ("tail", "encode")])
        fresh = [i for i, (kind, _) in enumerate(hits) if kind in ("encode", "below", "encode16")]    # new main blocks
        fresh_tail = [i for i, (kind, _) in enumerate(hits) if kind == "fp16"]              # new tail blocks
        if self.tiering is not None and (len(fresh) > self.main_pool.num_allocatable()
                                         or len(fresh_tail) > self.tail_pool.num_allocatable()):
            self.tiering.make_room(len(fresh), len(fresh_tail), set(), whole=False)
        cut = self._room_cut(hits)
        if cut < len(hits):      # serve a shorter prefix: up to the first fresh block there is no room for
            self.main_pool.release([b for kind, b in hits[cut:] if kind == "main"])
            self.tail_pool.release([b for kind, b in hits[cut:] if kind in ("tail", "encode")])
            hits, fresh, fresh_tail = hits[:cut], [i for i in fresh if i < cut], [i for i in fresh_tail if i < cut]
        s = Sequence(seq_id, tenant, self.cfg.geometry.num_layers, token_ids=prompt, hashes=hashes)
        new = dict(zip(fresh, self.main_pool.allocate(len(fresh))))
        new_tail = dict(zip(fresh_tail, self.tail_pool.allocate(len(fresh_tail))))
        enc = [i for i in fresh if hits[i][0] == "encode"]
        if enc:
            k, v = self.tail.read_blocks(slice(None), ids_to(self.tail.k.device, [hits[i][1] for i in enc]))
            self.main.encode_blocks(ids_to(k.device, [new[i] for i in enc]), k, v)
            self.tail_pool.release([hits[i][1] for i in enc])
        enc = [i for i in fresh if hits[i][0] == "encode16"]
        if enc:              # fp16 forms from below of blocks that seal here
            rows = prefix.cat(p.fp16_rows)
            k, v = self.tail.payload_kv(rows[ids_to(rows.device, [hits[i][1] for i in enc])])
            self.main.encode_blocks(ids_to(k.device, [new[i] for i in enc]), k, v)
        # Blocks encoded here seal in this sequence as in a write: counted with the write path's.
        self.counters["sealed_blocks"] += sum(hits[i][0] in ("encode", "encode16") for i in fresh)
        tiers = [p.tiers[j] for j in self._unpack_rows(hits, "below", new, p.rows, self.main_io)]
        fp16_tiers = [p.fp16_tiers[j] for j in self._unpack_rows(hits, "fp16", new_tail, p.fp16_rows, self.tail_io)]
        fp16_tiers += [p.fp16_tiers[hits[i][1]] for i in enc]
        if self.tiering is not None:
            self.tiering.served([t for t in tiers + fp16_tiers if t != "redis"])
        if self.redis is not None:
            self.redis.served(tiers.count("redis"), fp16_tiers.count("redis"))
        for i, (kind, b) in enumerate(hits):
            # A block from this host's host or disk tier is not put to Redis again: it
            # went up when it was first hashed here (or when it spilled), and a put of
            # an 8K-token prefix is a 250 MB copy to the host on the request's stream.
            if i in new:
                bid = new[i]
                self.main_pool.set_hash(bid, hashes[i], announce=kind != "below" or p.tiers[b] == "redis")
            elif i in new_tail:
                bid = new_tail[i]
                self.hash_fp16(bid, i, hashes[i], announce=p.fp16_tiers[b] == "redis")
            else:
                bid = b
            if kind in ("tail", "fp16") or not self.is_pq:   # sinks and tail; fp16: relabelled as sealed just below
                s.tail.append(bid)
            else:
                s.sealed.append(bid)
        s.length = len(hits) * self.bs
        s.hashed_upto = len(hits)
        if not self.is_pq:   # like an append of these tokens: the tail keeps at most R + block_size
            self._seal(s, self.sealed_count(s.length), None, None)
        self.seqs[(tenant, seq_id)] = s
        self.release_window(s)            # hits the window has left already
        self.counters["prefix_query_tokens"] += len(prompt)
        self.counters["prefix_hit_tokens"] += s.length
        self.publish()
        return AllocateResult(cached_tokens=s.length, hit_blocks=len(hits))

    def _room_cut(self, hits: list[tuple[str, object]]) -> int:
        """How many of the hits fit the room the pools have for their fresh blocks."""
        main, tail = self.main_pool.num_allocatable(), self.tail_pool.num_allocatable()
        for i, (kind, _) in enumerate(hits):
            main -= kind in ("encode", "below", "encode16")
            tail -= kind == "fp16"
            if main < 0 or tail < 0:
                return i
        return len(hits)

    def _unpack_rows(self, hits, kind: str, new: dict[int, int], parts: list, io) -> list[int]:
        """Write the rows read from below that hits of `kind` name into their new
        blocks (io's pool) -> the rows used."""
        at = [i for i in new if hits[i][0] == kind]
        if not at:
            return []
        payload = prefix.cat(parts)
        rows = [hits[i][1] for i in at]
        if rows != list(range(len(payload))):
            payload = payload[ids_to(payload.device, rows)]
        io.unpack([new[i] for i in at], payload)
        return rows

    def hash_fp16(self, bid: int, i: int, h: bytes, announce: bool = True) -> None:
        """Tail-pool block bid, block i of its sequence, is full: findable by h.
        A pq cache's fp16 blocks go below the GPU when evicted (tiers/below.py);
        its sink blocks (i < sink_blocks) also go up to Redis now (unless
        announce is False): its other fp16 blocks seal as the sequence grows,
        and their PQ codes go up then, a quarter to an eighth of the bytes."""
        self.tail_pool.set_hash(bid, h, announce=announce)   # fp16 codec: the main pool (Redis is its on_hash)
        if self.is_pq and i < self.sink_blocks and announce and self.redis is not None:
            self.redis.note(bid, h, fp16=True)

    def _tail_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        """The tail pool is about to reuse cached blocks: their fp16 form goes below (to Redis alone without tiers)."""
        if self.tiering is not None:
            self.tiering.spill_fp16(evicted)
        elif self.redis is not None:
            self.redis.spill(evicted, fp16=True)

    # ------------------------------------------------------- fork and free
    def fork_room(self, src: Sequence) -> int:
        """fp16 tail blocks a fork of src takes: its own copy of src's partial last block."""
        return int(src.length % self.bs != 0 and self.blocks_of(src)[1] > 0)

    def fork(self, src: Sequence, tenant: str, dst_id: str) -> None:
        """Share every full block of src; copy its partial last block (copy-on-write)."""
        self._check_new_sequence(tenant, dst_id, "new_sequence_id")
        if any(src.pending) or src.reserved:
            raise FailedPrecondition("sequence_id", f"sequence {quote(src.seq_id)} has uncommitted tokens")
        partial = self.fork_room(src) > 0
        shared_tail = src.tail[:-1] if partial else list(src.tail)
        if partial:
            self.check_room(0, 1, 0, "new_sequence_id")     # its copy of the partial block
        new = self._alloc_tail(1, "new_sequence_id") if partial else []     # its copy of the partial block
        self.main_pool.ref(src.held_sealed())
        self.tail_pool.ref(shared_tail)
        if partial:
            self.tail.copy_block(src.tail[-1], new[0])
        dst = Sequence(dst_id, tenant, src.num_layers, length=src.length, sealed=list(src.sealed), freed=src.freed,
                       tail=shared_tail + new, token_ids=array("i", src.token_ids), hashes=list(src.hashes),
                       hashed_upto=src.hashed_upto)
        self.seqs[(tenant, dst_id)] = dst

    def offload(self, seqs: list[Sequence], drop_uncommitted: bool = False, past_bound: bool = False) -> int:
        """Offload: each durable on disk, or none moved. Uncommitted tokens refuse it, or with drop_uncommitted
        (persist sequences at the stop or a lease's lapse: nobody will finish their step) are dropped; past_bound:
        DiskTier.write_sequences. -> tokens dropped."""
        for s in seqs:
            if (any(s.pending) or s.reserved) and not drop_uncommitted:
                raise FailedPrecondition("sequence_ids", f"sequence {quote(s.seq_id)} has uncommitted tokens")
        dropped = sum(self.drop_uncommitted(s) for s in seqs) if drop_uncommitted else 0
        self.protect = set()
        self.tiering.offload(seqs, past_bound)
        return dropped

    def free(self, s: Sequence) -> None:
        if self.tiering is not None:
            self.tiering.free(s)          # its disk copy first, then host blocks
        if s.tier == "gpu":
            if self.is_pq and self.redis is not None:
                # A chat's next turn may come to another host: the freed prompt + answer's
                # full fp16 blocks (not sealed yet) go up now, not when they are evicted.
                self.redis.spill([(b, h) for b in s.tail if (h := self.tail_pool.blocks[b].hash) is not None],
                                 fp16=True)
            # Release back to front: the newest blocks are the least likely to
            # be shared prefixes, so they should be evicted first.
            self.tail_pool.release(s.tail[::-1])
            self.main_pool.release(s.held_sealed()[::-1] + s.seal_blocks[::-1])
        del self.seqs[(s.tenant, s.seq_id)]

    @property
    def main_device(self) -> torch.device:
        return self.main.k_codes.device if self.is_pq else self.main.k.device

    # --------------------------------------------------------------- books
    def stats(self) -> dict:
        return books.stats(self)

    def check_invariants(self) -> None:
        books.check_invariants(self)
