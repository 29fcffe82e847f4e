"""One cache namespace: its pools, tensors and sequences; allocation with
prefix hits, fork and free. The write and read paths of DESIGN §4 are in
write_path.py and read_path.py. Every method validates all of its input
before it changes any state, so a rejected call leaves the cache as it was."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .block_pool import BlockPool
from .codebooks import Codebooks, fingerprint
from .config import CacheConfig
from .errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from .hashing import chain_hashes
from .read_path import ReadPath
from .sequence import Sequence
from .storage import Fp16Store, PQStore
from .write_path import ReserveResult, WritePath  # noqa: F401 (re-exported)

MAX_TOKEN_ID = 2**31 - 1


@dataclass(slots=True)
class AllocateResult:
    cached_tokens: int
    hit_blocks: int


class Cache(WritePath, ReadPath):
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

