"""One cache namespace: its pools, tensors, sequences and the write/read paths
of DESIGN §4. Every method validates all of its input before it changes any
state, so a rejected call leaves the cache exactly as it was."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvstore.kernels import dispatch

from .block_pool import BlockPool
from .codebooks import Codebooks, fingerprint
from .config import CacheConfig
from .errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from .hashing import chain_hashes
from .sequence import Sequence
from .storage import Fp16Store, PQStore

MAX_TOKEN_ID = 2**31 - 1


@dataclass(slots=True)
class AllocateResult:
    cached_tokens: int
    hit_blocks: int


@dataclass(slots=True)
class ReserveResult:
    slot_mapping: list[int]     # tail-pool slot (block * bs + offset) of each reserved token
    sealed_blocks: list[int]
    tail_blocks: list[int]
    length: int                 # tokens visible after the reservation


class Cache:
    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self.bs = cfg.block_size
        self.is_pq = cfg.codec.kind == "pq"
        self.main_pool = BlockPool(cfg.capacity_blocks())
        if self.is_pq:
            self.main: PQStore | Fp16Store = PQStore(cfg, self.main_pool.capacity)
            self.tail_pool = BlockPool(cfg.tail_capacity_blocks())
            self.tail = Fp16Store(cfg, self.tail_pool.capacity)
        else:
            # The fp16 codec needs no separate tail: sealing just relabels blocks.
            self.main = Fp16Store(cfg, self.main_pool.capacity)
            self.tail_pool, self.tail = self.main_pool, self.main
        self.codebooks: Codebooks | None = None
        self.fingerprint = fingerprint(cfg, None)
        self.seqs: dict[tuple[str, str], Sequence] = {}
        self.counters = dict(prefix_query_tokens=0, prefix_hit_tokens=0, appended_tokens=0,
                             sealed_blocks=0, dedup_blocks=0, attend_calls=0)

    # ------------------------------------------------------------ codebooks
    def set_codebooks(self, cb: Codebooks) -> None:
        if not self.is_pq:
            raise FailedPrecondition("codebooks", f"cache {self.cfg.name!r} uses the fp16 codec")
        cb.validate(self.cfg)
        if self.seqs:
            raise FailedPrecondition("codebooks", f"cache {self.cfg.name!r} has {len(self.seqs)} live sequences; "
                                     "codebooks can change only on an empty cache")
        self.main.set_codebooks(cb)
        self.codebooks = cb
        self.fingerprint = fingerprint(self.cfg, cb)
        # Blocks hashed under the old fingerprint must never be found again.
        self.main_pool.clear_hashes()
        self.tail_pool.clear_hashes()

    def _require_ready(self) -> None:
        if self.is_pq and self.codebooks is None:
            raise FailedPrecondition("codebooks", f"cache {self.cfg.name!r} has no codebooks yet "
                                     "(SetCodebooks or TrainCodebooks first)")

    # ------------------------------------------------------------- helpers
    def seq(self, tenant: str, seq_id: str) -> Sequence:
        s = self.seqs.get((tenant, seq_id))
        if s is None:
            raise NotFound("sequence_id", f"no sequence {seq_id!r} in cache {self.cfg.name!r}")
        return s

    def sealed_count(self, length: int) -> int:
        """Sealed blocks a sequence of `length` committed tokens has: the tail
        keeps at most R + block_size tokens."""
        return max(0, math.ceil((length - self.cfg.residual - self.bs) / self.bs))

    def _check_tokens(self, ids: list[int], field: str) -> None:
        for t in ids:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidArgument(field, f"token id {t} outside [0, 2^31)")

    def _check_new_sequence(self, tenant: str, seq_id: str) -> None:
        if not seq_id or len(seq_id) > 256:
            raise InvalidArgument("sequence_id", "must be 1-256 characters")
        if (tenant, seq_id) in self.seqs:
            raise AlreadyExists("sequence_id", f"sequence {seq_id!r} already exists")
        if len(self.seqs) >= self.cfg.max_sequences:
            raise ResourceExhausted("sequence_id", f"cache holds max_sequences={self.cfg.max_sequences}")

    def _alloc_tail(self, n: int) -> list[int]:
        ids = self.tail_pool.allocate(n) if n > 0 else []
        if ids is None:
            raise ResourceExhausted("tail", f"need {n} fp16 tail blocks, {self.tail_pool.num_allocatable()} free")
        return ids

    def _extend_hashes(self, s: Sequence) -> None:
        parent = s.hashes[-1] if s.hashes else b""
        s.hashes += chain_hashes(s.token_ids, self.bs, self.fingerprint, parent, start_block=len(s.hashes))

    def _register_hashes(self, s: Sequence) -> None:
        """Make committed full blocks findable by prefix lookups."""
        full = s.length // self.bs
        while s.hashed_upto < min(full, len(s.hashes)):
            i = s.hashed_upto
            if i < len(s.sealed):
                self.main_pool.set_hash(s.sealed[i], s.hashes[i])
            else:
                self.tail_pool.set_hash(s.tail[i - len(s.sealed)], s.hashes[i])
            s.hashed_upto += 1

    def _seal(self, s: Sequence, count: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Append `count` new sealed blocks; k, v [L, count * bs, Hkv, d] hold
        their tokens (unused for fp16, where the tail blocks are relabelled).
        Capacity was checked by the caller."""
        if count <= 0:
            return
        if not self.is_pq:
            s.sealed += s.tail[:count]
            del s.tail[:count]
            return
        first = len(s.sealed)
        hits: dict[int, int] = {}
        for j in range(count):
            i = first + j
            if i < len(s.hashes):
                bid = self.main_pool.lookup(s.hashes[i])
                if bid is not None:
                    hits[j] = bid
        # Ref the hits before allocating, so allocation cannot evict them.
        self.main_pool.ref(list(hits.values()))
        todo = [j for j in range(count) if j not in hits]
        new = self.main_pool.allocate(len(todo))
        assert new is not None, "main-pool capacity was checked before sealing"
        if todo:
            sel = torch.tensor([j * self.bs + t for j in todo for t in range(self.bs)], device=k.device)
            self.main.encode_blocks(torch.tensor(new, device=k.device),
                                    k.index_select(1, sel), v.index_select(1, sel))
        ids = [hits.get(j) for j in range(count)]
        for j, bid in zip(todo, new):
            ids[j] = bid
            # Blocks already registered as tail blocks get their sealed twin
            # registered now; the rest are registered at commit.
            if first + j < min(s.hashed_upto, len(s.hashes)):
                self.main_pool.set_hash(bid, s.hashes[first + j])
        s.sealed += ids
        self.counters["sealed_blocks"] += count
        self.counters["dedup_blocks"] += len(hits)

    def _main_free_after(self, release_tail: list[int]) -> int:
        """Main-pool blocks allocatable once `release_tail` are released (fp16 shares the pool)."""
        n = self.main_pool.num_allocatable()
        if not self.is_pq:
            n += sum(1 for b in release_tail if self.tail_pool.blocks[b].ref_cnt == 1)
        return n

    # ------------------------------------------------------------- allocate
    def allocate(self, tenant: str, seq_id: str, prompt: list[int]) -> AllocateResult:
        self._require_ready()
        self._check_new_sequence(tenant, seq_id)
        self._check_tokens(prompt, "prompt_token_ids")
        hashes = chain_hashes(prompt, self.bs, self.fingerprint)
        n_sealed = self.sealed_count(len(prompt))
        hits: list[tuple[str, int]] = []          # ("main" | "tail" | "encode", block id)
        for i, h in enumerate(hashes):
            if self.is_pq and i < n_sealed:
                bid = self.main_pool.lookup(h)
                if bid is not None:
                    hits.append(("main", bid))
                    continue
                tb = self.tail_pool.lookup(h)    # another sequence still holds it in fp16
                if tb is None:
                    break
                hits.append(("encode", tb))
            else:
                bid = self.tail_pool.lookup(h)
                if bid is None:
                    break
                hits.append(("tail", bid))
        if hits and len(hits) * self.bs == len(prompt):
            hits.pop()     # the caller must compute at least one token to get logits
        n_enc = sum(1 for kind, _ in hits if kind == "encode")
        main_refs = [b for kind, b in hits if kind == "main"]
        # Encoding needs fresh main blocks; if there are too few, serve a shorter prefix.
        reclaimable = self.main_pool.num_allocatable() - sum(
            1 for b in main_refs if self.main_pool.blocks[b].ref_cnt == 0)
        if n_enc > reclaimable:
            cut = [i for i, (kind, _) in enumerate(hits) if kind == "encode"][reclaimable]
            hits = hits[:cut]
        s = Sequence(seq_id, tenant, self.cfg.geometry.num_layers, token_ids=list(prompt), hashes=hashes)
        self.main_pool.ref([b for kind, b in hits if kind == "main"])
        self.tail_pool.ref([b for kind, b in hits if kind == "tail"])
        enc_src = [b for kind, b in hits if kind == "encode"]
        new = self.main_pool.allocate(len(enc_src)) or []
        if enc_src:
            k, v = self.tail.read_blocks(slice(None), torch.tensor(enc_src, device=self.tail.k.device))
            self.main.encode_blocks(torch.tensor(new, device=k.device), k, v)
        it = iter(new)
        for i, (kind, b) in enumerate(hits):
            if kind == "tail":
                s.tail.append(b)
            else:
                bid = b if kind == "main" else next(it)
                if kind == "encode":
                    self.main_pool.set_hash(bid, hashes[i])
                s.sealed.append(bid)
        s.length = len(hits) * self.bs
        s.hashed_upto = len(hits)
        self.seqs[(tenant, seq_id)] = s
        self.counters["prefix_query_tokens"] += len(prompt)
        self.counters["prefix_hit_tokens"] += s.length
        return AllocateResult(cached_tokens=s.length, hit_blocks=len(hits))

    # --------------------------------------------------------------- append
    def _apply_token_ids(self, s: Sequence, start: int, ids: list[int]) -> None:
        """Record (already checked) ids of tokens [start, start + len(ids));
        they extend the hash chain only if every earlier id is known."""
        known = s.token_ids[start:start + len(ids)]
        if len(s.token_ids) >= start:
            s.token_ids.extend(ids[len(known):])
            self._extend_hashes(s)

    def room_needed(self, s: Sequence, n: int, layer: int | None) -> tuple[int, int, int]:
        """(main blocks, tail blocks, tail blocks freed by sealing) that
        appending n tokens (all layers, or one layer) will take at most."""
        if layer is None:
            T = s.length + n
            n_sealed = max(self.sealed_count(T), len(s.sealed))
            seal = n_sealed - len(s.sealed)
            if not self.is_pq:
                return 0, max(0, math.ceil(T / self.bs) - len(s.sealed) - len(s.tail)), 0
            freed = sum(1 for b in s.tail[:seal] if self.tail_pool.blocks[b].ref_cnt == 1)
            return seal, max(0, math.ceil(T / self.bs) - max(n_sealed, len(s.sealed) + len(s.tail))), freed
        end = s.length + s.pending[layer] + n
        tail = max(0, math.ceil(end / self.bs) - len(s.sealed) - len(s.tail))
        commit = min(p + (n if i == layer else 0) for i, p in enumerate(s.pending))
        seal = max(self.sealed_count(s.length + commit), len(s.sealed)) - len(s.sealed)
        return (seal if self.is_pq else 0), tail, 0

    def check_room(self, main: int, tail: int, freed: int, field: str = "k") -> None:
        if self.is_pq:
            if main > self.main_pool.num_allocatable():
                raise ResourceExhausted(field, f"need {main} blocks, {self.main_pool.num_allocatable()} free")
            if tail > self.tail_pool.num_allocatable() + freed:
                raise ResourceExhausted(field, f"need {tail} fp16 tail blocks, "
                                        f"{self.tail_pool.num_allocatable() + freed} free")
        elif tail > self.main_pool.num_allocatable():
            raise ResourceExhausted(field, f"need {tail} blocks, {self.main_pool.num_allocatable()} free")

    def append(self, s: Sequence, k: torch.Tensor, v: torch.Tensor, token_ids: list[int] | None) -> None:
        """All layers, n tokens: k, v [L, n, Hkv, d]. Validated by the caller."""
        self._require_ready()
        if any(s.pending) or s.reserved:
            raise FailedPrecondition("sequence_id", f"sequence {s.seq_id!r} has uncommitted per-layer or reserved tokens")
        n = k.shape[1]
        if token_ids is not None:
            if len(token_ids) != n:
                raise InvalidArgument("token_ids", f"{len(token_ids)} ids for {n} tokens")
            self._check_tokens(token_ids, "token_ids")
            known = s.token_ids[s.length:s.length + n]
            if known != token_ids[:len(known)]:
                raise InvalidArgument("token_ids", f"differ from the ids given at Allocate for positions {s.length}..")
        T = s.length + n
        n_sealed0 = len(s.sealed)
        seal_count = max(self.sealed_count(T), n_sealed0) - n_sealed0
        main_need, need_tail, freed = self.room_needed(s, n, None)
        self.check_room(main_need, need_tail, freed)
        release = s.tail[:seal_count] if self.is_pq else []
        # ---- validated; mutate from here on
        if token_ids is not None:
            self._apply_token_ids(s, s.length, token_ids)
        sealed_tok = n_sealed0 * self.bs
        if self.is_pq and seal_count:
            old_k, old_v = self.tail.read_blocks(slice(None), torch.tensor(s.tail, device=k.device)) if s.tail \
                else (k[:, :0], v[:, :0])
            have = s.length - sealed_tok
            seal_tok = seal_count * self.bs
            kk = torch.cat([old_k[:, :have], k], dim=1)[:, :seal_tok]
            vv = torch.cat([old_v[:, :have], v], dim=1)[:, :seal_tok]
            self.tail_pool.release(release)
            del s.tail[:len(release)]
            self._seal(s, seal_count, kk, vv)
        s.tail += self._alloc_tail(need_tail)
        start = max(s.length, len(s.sealed) * self.bs)   # first token that lands in the tail
        self._write_tail(s, slice(None), start, k[:, start - s.length:], v[:, start - s.length:])
        s.length = T
        if not self.is_pq:
            self._seal(s, max(self.sealed_count(T), n_sealed0) - len(s.sealed), None, None)
        self._register_hashes(s)
        s.last_use = time.monotonic()
        self.counters["appended_tokens"] += n

    def _write_tail(self, s: Sequence, layers: slice, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens [start, start + n) of k, v [nl, n, Hkv, d] into the tail."""
        n = k.shape[1]
        if n == 0:
            return
        pos = torch.arange(start, start + n) - len(s.sealed) * self.bs
        tail_ids = torch.tensor(s.tail, dtype=torch.long)
        blocks = tail_ids[pos // self.bs].to(self.tail.k.device)
        offs = (pos % self.bs).to(self.tail.k.device)
        self.tail.write(layers, blocks, offs, k, v)

    def append_layer(self, s: Sequence, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One layer, n tokens: k, v [n, Hkv, d]. Tokens commit (and seal) once
        every layer has appended them."""
        self._require_ready()
        if s.reserved:
            raise FailedPrecondition("sequence_id", f"sequence {s.seq_id!r} has reserved tokens")
        n = k.shape[0]
        start = s.length + s.pending[layer]
        end = start + n
        main_need, need, _ = self.room_needed(s, n, layer)
        self.check_room(main_need, need, 0)
        new_pending = s.pending.copy()
        new_pending[layer] += n
        commit = min(new_pending)
        s.tail += self._alloc_tail(need)
        self._write_tail(s, slice(layer, layer + 1), start, k.unsqueeze(0), v.unsqueeze(0))
        s.pending = new_pending
        if commit:
            s.pending = [p - commit for p in s.pending]
            s.length += commit
            self.counters["appended_tokens"] += commit
            self._commit(s)
        s.last_use = time.monotonic()

    def _commit(self, s: Sequence) -> None:
        """Seal what the committed length allows, taking data from the tail."""
        self._register_hashes(s)
        count = max(self.sealed_count(s.length), len(s.sealed)) - len(s.sealed)
        if count <= 0:
            return
        if self.is_pq:
            ids = s.tail[:count]
            k, v = self.tail.read_blocks(slice(None), torch.tensor(ids, device=self.tail.k.device))
            self._seal(s, count, k, v)
            self.tail_pool.release(ids)
            del s.tail[:count]
        else:
            self._seal(s, count, None, None)

    def reserve(self, s: Sequence, n: int) -> ReserveResult:
        """Commit the previous reservation (its slots were written by the
        client in every layer), then hand out slots for n more tokens."""
        self._require_ready()
        if any(s.pending):
            raise FailedPrecondition("sequence_id", f"sequence {s.seq_id!r} has uncommitted per-layer tokens")
        end = s.length + s.reserved + n
        need = max(0, math.ceil(end / self.bs) - len(s.sealed) - len(s.tail))
        seal_count = max(self.sealed_count(s.length + s.reserved), len(s.sealed)) - len(s.sealed)
        if self.is_pq and seal_count > self.main_pool.num_allocatable():
            raise ResourceExhausted("num_tokens", f"need {seal_count} blocks to seal")
        if need > self.tail_pool.num_allocatable():
            raise ResourceExhausted("num_tokens", f"need {need} tail blocks, {self.tail_pool.num_allocatable()} free")
        s.tail += self._alloc_tail(need)
        if s.reserved:
            s.length += s.reserved
            self.counters["appended_tokens"] += s.reserved
            s.reserved = 0
            self._commit(s)
        first = len(s.sealed) * self.bs
        slots = [s.tail[(p - first) // self.bs] * self.bs + (p - first) % self.bs
                 for p in range(s.length, s.length + n)]
        s.reserved = n
        s.last_use = time.monotonic()
        return ReserveResult(slots, list(s.sealed), list(s.tail), s.length + n)

    # ------------------------------------------------------- fork and free
    def fork(self, src: Sequence, tenant: str, dst_id: str) -> None:
        """Share every full block of src; copy its partial last block (copy-on-write)."""
        self._check_new_sequence(tenant, dst_id)
        if any(src.pending) or src.reserved:
            raise FailedPrecondition("sequence_id", f"sequence {src.seq_id!r} has uncommitted tokens")
        partial = src.length % self.bs != 0 and len(src.tail) > 0
        shared_tail = src.tail[:-1] if partial else list(src.tail)
        new = self._alloc_tail(1) if partial else []
        self.main_pool.ref(src.sealed)
        self.tail_pool.ref(shared_tail)
        if partial:
            self.tail.copy_block(src.tail[-1], new[0])
        dst = Sequence(dst_id, tenant, src.num_layers, length=src.length, sealed=list(src.sealed),
                       tail=shared_tail + new, token_ids=list(src.token_ids), hashes=list(src.hashes),
                       hashed_upto=src.hashed_upto)
        self.seqs[(tenant, dst_id)] = dst

    def free(self, s: Sequence) -> None:
        # Release back to front: the newest blocks are the least likely to be
        # shared prefixes, so they should be evicted first.
        self.tail_pool.release(s.tail[::-1])
        self.main_pool.release(s.sealed[::-1])
        del self.seqs[(s.tenant, s.seq_id)]

    # ------------------------------------------------------------- reading
    def attend(self, layer: int, seqs: list[Sequence], q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, d] -> out [B, Hq, d]: decode attention of one query token per
        sequence over every token visible at this layer."""
        self._require_ready()
        dev = q.device
        for s in seqs:
            if s.layer_length(layer) == 0:
                raise InvalidArgument("sequence_ids", f"sequence {s.seq_id!r} has no tokens at layer {layer}")
        if self.is_pq:
            sealed = _table([s.sealed for s in seqs], dev)
            sealed_lens = torch.tensor([len(s.sealed) * self.bs for s in seqs], dtype=torch.int32, device=dev)
            tail = _table([s.tail for s in seqs], dev)
            tail_lens = torch.tensor([s.layer_length(layer) - len(s.sealed) * self.bs for s in seqs],
                                     dtype=torch.int32, device=dev)
            out, _ = dispatch.pq_decode_attention(
                q, self.main.k_codes[layer], self.main.v_codes[layer], self.main.k_cb[layer], self.main.v_cb[layer],
                sealed, sealed_lens, self.tail.k[layer], self.tail.v[layer], tail, tail_lens, scale)
        else:
            table = _table([s.sealed + s.tail for s in seqs], dev)
            lens = torch.tensor([s.layer_length(layer) for s in seqs], dtype=torch.int32, device=dev)
            out, _ = dispatch.paged_decode_attention(q, self.main.k[layer], self.main.v[layer], table, lens, scale)
        now = time.monotonic()
        for s in seqs:
            s.last_use = now
        self.counters["attend_calls"] += 1
        return out

    def retrieve(self, s: Sequence, start: int, end: int, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [nl, end - start, Hkv, d] of committed tokens: sealed ones
        dequantized, tail ones exact."""
        if not 0 <= start < end <= s.length:
            raise InvalidArgument("end", f"range [{start}, {end}) outside the {s.length} committed tokens")
        sealed_tok = len(s.sealed) * self.bs
        parts_k, parts_v = [], []
        if start < sealed_tok:
            b0, b1 = start // self.bs, math.ceil(min(end, sealed_tok) / self.bs)
            k, v = self.main.read_blocks(layers, torch.tensor(s.sealed[b0:b1], device=self.main_device))
            lo = start - b0 * self.bs
            hi = lo + min(end, sealed_tok) - start
            parts_k.append(k[:, lo:hi])
            parts_v.append(v[:, lo:hi])
        if end > sealed_tok:
            t0 = max(start, sealed_tok) - sealed_tok
            t1 = end - sealed_tok
            b0, b1 = t0 // self.bs, math.ceil(t1 / self.bs)
            k, v = self.tail.read_blocks(layers, torch.tensor(s.tail[b0:b1], device=self.tail.k.device))
            parts_k.append(k[:, t0 - b0 * self.bs:t1 - b0 * self.bs])
            parts_v.append(v[:, t0 - b0 * self.bs:t1 - b0 * self.bs])
        s.last_use = time.monotonic()
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)

    @property
    def main_device(self) -> torch.device:
        return self.main.k_codes.device if self.is_pq else self.main.k.device

    # --------------------------------------------------------------- stats
    def stats(self) -> dict:
        main = self.main_pool.stats()
        tail = self.tail_pool.stats() if self.is_pq else None
        tokens = sum(s.length for s in self.seqs.values())
        sealed_tokens = sum(len(s.sealed) * self.bs for s in self.seqs.values())
        c = self.counters
        used_bytes = main.used * self.cfg.bytes_per_block()
        if self.is_pq:
            used_bytes += tail.used * self.bs * self.cfg.fp16_bytes_per_token()
        return dict(
            main=main, tail=tail, sequences=len(self.seqs), tokens=tokens, sealed_tokens=sealed_tokens,
            bytes_per_token=self.cfg.bytes_per_token(), fp16_bytes_per_token=self.cfg.fp16_bytes_per_token(),
            compression_ratio=self.cfg.fp16_bytes_per_token() / self.cfg.bytes_per_token(),
            used_bytes=used_bytes,
            effective_bytes_per_token=(used_bytes / tokens) if tokens else 0.0,
            prefix_hit_rate=(c["prefix_hit_tokens"] / c["prefix_query_tokens"]) if c["prefix_query_tokens"] else 0.0,
            **c)

    def check_invariants(self) -> None:
        """Pool accounting and ref counts equal the references sequences hold."""
        main_refs: dict[int, int] = {}
        tail_refs: dict[int, int] = main_refs if not self.is_pq else {}
        for s in self.seqs.values():
            for b in s.sealed:
                main_refs[b] = main_refs.get(b, 0) + 1
            for b in s.tail:
                tail_refs[b] = tail_refs.get(b, 0) + 1
            assert len(s.sealed) >= self.sealed_count(s.length), f"{s.seq_id}: tail too long"
            assert (len(s.sealed) + len(s.tail)) * self.bs >= s.max_length(), f"{s.seq_id}: blocks do not cover tokens"
            assert len(s.sealed) * self.bs <= s.length, f"{s.seq_id}: sealed beyond committed length"
        self.main_pool.check_invariants(main_refs)
        if self.is_pq:
            self.tail_pool.check_invariants(tail_refs)


def _table(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    t = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        if r:
            t[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return t.to(device)
