"""The write path of a cache (docs/design.md, Write path): tokens go to the fp16 tail; once
the tail holds more than R + block_size committed tokens after the S sink
tokens, its oldest blocks are encoded into sealed blocks (or, when another
sequence already sealed the same content, shared). The sink blocks at the
front of the tail are never sealed. Every method checks room before it
changes state."""
from __future__ import annotations

import math
import time
from array import array

import torch

from kvstore.core.sequence import Sequence, token_array
from kvstore.errors import FailedPrecondition, InvalidArgument, quote

from .results import ReserveResult
from .room import Room
from .storage import ids_to

SMALL_WRITE = 8      # tokens up to which a per-layer append writes slot by slot
# Tokens of one sequence up to which their slots are Python ints, not index tensors: a
# torch op on a tiny tensor costs ~10 µs on the host, 40 µs for the 4 ops of one slot
# lookup, against 0.6 µs a token in Python (even at ~500 tokens).
SMALL_SLOTS = 256


class WritePath(Room):
    """Mixed into Cache; uses its pools, stores and counters."""

    _deferred: list | None = None

    def _encode(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode whole blocks now, or at flush_encodes() inside a batch."""
        if self._deferred is not None:
            self._deferred.append((block_ids, k, v))
        else:
            self.main.encode_blocks(ids_to(k.device, block_ids), k, v)

    def defer_encodes(self) -> None:
        """Until flush_encodes(), collect seals so a batch encodes in one launch
        for K and one for V, not one per sequence (the block data is already
        copied out of the tail, so nothing reads it in between)."""
        self._deferred = []

    def flush_encodes(self) -> None:
        todo, self._deferred = self._deferred, None
        if todo:
            ids = [b for blocks, _, _ in todo for b in blocks]
            k = torch.cat([kk for _, kk, _ in todo], dim=1)
            v = torch.cat([vv for _, _, vv in todo], dim=1)
            self.main.encode_blocks(ids_to(k.device, ids), k, v)
        self.release_deferred()

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
        first = self.sink_blocks + len(s.sealed)     # block index of the first new sealed block
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
        new = s.seal_blocks[:len(todo)]      # taken when the step's room was checked (Room.hold_seals)
        del s.seal_blocks[:len(new)]
        more = self.main_pool.allocate(len(todo) - len(new))
        assert more is not None, "main-pool capacity was checked before sealing"
        new += more
        if todo:
            sel = ids_to(k.device, [j * self.bs + t for j in todo for t in range(self.bs)])
            self._encode(new, k.index_select(1, sel), v.index_select(1, sel))
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


    # --------------------------------------------------------------- append
    def _apply_token_ids(self, s: Sequence, start: int, ids: array) -> None:
        """Record (already checked: check_token_ids) ids of tokens [start,
        start + len(ids)); they extend the hash chain only if every earlier id
        is known."""
        known = s.token_ids[start:start + len(ids)]
        if len(s.token_ids) >= start:
            s.token_ids.extend(ids[len(known):])
            self._extend_hashes(s)

    @staticmethod
    def token_start(s: Sequence, layer: int | None) -> int:
        """Position of the first token an append (all layers, or one layer) adds."""
        return s.length if layer is None else s.length + s.pending[layer]

    def check_token_ids(self, s: Sequence, n: int, token_ids, layer: int | None = None) -> array:
        """Ids of the n tokens an append (all layers, or `layer`) adds -> them as
        an array('i'). Ids already known for those positions (from Allocate, or
        from another layer of the same tokens) must agree."""
        if len(token_ids) != n:
            raise InvalidArgument("token_ids", f"{len(token_ids)} ids for {n} tokens of sequence {quote(s.seq_id)}")
        ids = token_array(token_ids, "token_ids")
        start = self.token_start(s, layer)
        known = s.token_ids[start:start + n]
        if known != ids[:len(known)]:
            raise InvalidArgument("token_ids", f"differ from the ids already known for positions {start}.. of "
                                               f"sequence {quote(s.seq_id)}")
        return ids

    def append(self, s: Sequence, k: torch.Tensor, v: torch.Tensor, token_ids=None) -> None:
        """All layers, n tokens: k, v [L, n, Hkv, d]. Validated by the caller."""
        self._require_ready()
        if any(s.pending) or s.reserved:
            raise FailedPrecondition("sequence_id", f"sequence {quote(s.seq_id)} has uncommitted per-layer or reserved tokens")
        n = k.shape[1]
        if token_ids is not None:
            token_ids = self.check_token_ids(s, n, token_ids)
        T = s.length + n
        n_sealed0 = len(s.sealed)
        seal_count = max(self.sealed_count(T), n_sealed0) - n_sealed0
        main_need, need_tail, freed = self.room_needed(s, n, None)
        self.check_room(main_need, need_tail, freed)
        ns = self.sink_blocks
        release = s.tail[ns:ns + seal_count] if self.is_pq else []
        # ---- validated; mutate from here on
        self.changing(s)
        s.cut_step = ()
        if token_ids is not None:
            self._apply_token_ids(s, s.length, token_ids)
        if self.is_pq and seal_count:
            first = self.sinks + n_sealed0 * self.bs     # first position to seal
            have = max(0, s.length - first)              # of those, already in tail[ns:]
            n_old = math.ceil(have / self.bs)
            old_k, old_v = (self.tail.read_blocks(slice(None), ids_to(k.device, s.tail[ns:ns + n_old])) if n_old
                            else (k[:, :0], v[:, :0]))
            seal_tok = seal_count * self.bs
            skip = max(0, first - s.length)              # new tokens that are sinks, not sealed
            kk = torch.cat([old_k[:, :have], k[:, skip:]], dim=1)[:, :seal_tok]
            vv = torch.cat([old_v[:, :have], v[:, skip:]], dim=1)[:, :seal_tok]
            self.tail_pool.release(release)
            del s.tail[ns:ns + len(release)]
            self._seal(s, seal_count, kk, vv)
        s.tail += self._alloc_tail(need_tail)
        # New tokens go to the fp16 blocks (sinks or tail) unless they were just sealed.
        pos = torch.arange(s.length, T)
        fp16 = (pos < self.sinks) | (pos >= self.sinks + len(s.sealed) * self.bs) if self.is_pq else None
        if fp16 is not None and not bool(fp16.all()):
            keep = ids_to(k.device, fp16.nonzero().flatten())
            pos, k, v = pos[fp16], k.index_select(1, keep), v.index_select(1, keep)
        self._write_tail(s, slice(None), pos, k, v)
        s.length = T
        if not self.is_pq:
            self._seal(s, max(self.sealed_count(T), n_sealed0) - len(s.sealed), None, None)
        self._register_hashes(s)
        self.release_window(s)
        s.last_use = time.monotonic()
        self.counters["appended_tokens"] += n

    def _tail_slots(self, s: Sequence, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tail block, offset) of the fp16 tokens at host positions pos, host long tensors."""
        idx = self.tail_index(s, pos)
        return torch.tensor(s.tail, dtype=torch.long)[idx // self.bs], idx % self.bs

    def _tail_slot_pairs(self, s: Sequence, start: int, n: int) -> list[tuple[int, int]]:
        """_tail_slots of positions [start, start + n) as Python ints, for a few tokens
        (SMALL_SLOTS)."""
        shift, bs = len(s.sealed) * self.bs, self.bs
        out = []
        for p in range(start, start + n):
            i = p if p < self.sinks else p - shift      # as tail_index
            out.append((s.tail[i // bs], i % bs))
        return out

    def _write_tail(self, s: Sequence, layers: slice, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [nl, n, Hkv, d] (the tokens at host positions pos [n]) into the tail."""
        if pos.numel() == 0:
            return
        blocks, offs = self._tail_slots(s, pos)
        dev = self.tail.k.device
        self.tail.write(layers, ids_to(dev, blocks), ids_to(dev, offs), k, v)

    def append_layer(self, s: Sequence, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One layer, n tokens: k, v [n, Hkv, d]. Tokens commit (and seal) once
        every layer has appended them."""
        self.append_layer_batch([s], layer, k, v, [k.shape[0]])

    def append_layer_batch(self, seqs: list[Sequence], layer: int, k: torch.Tensor, v: torch.Tensor,
                           counts: list[int], defer_write: bool = False,
                           token_ids: list | None = None) -> list[tuple[int, int]] | None:
        """One layer for a batch (decode): counts[i] tokens of seqs[i] in the
        rows of k, v [sum(counts), Hkv, d], written with one scatter. A batch of
        several sequences must have been checked whole (checks.batch_room).
        defer_write: a few tokens are not written but returned as their
        [(tail block, offset)], for attend(new=...) to write before it reads
        them (inside its decode graph); sealing never reads the newest token of
        a layer, so the seals this call queues do not need it. None: written.
        token_ids[i]: ids of seqs[i]'s new tokens, or empty (optional): recorded
        (and hashed once the chain before them is known) as of this layer."""
        self._require_ready()
        for s in seqs:
            if s.reserved:
                raise FailedPrecondition("sequence_id", f"sequence {quote(s.seq_id)} has reserved tokens")
            self.check_step_continues(s, layer)
        ids = [self.check_token_ids(s, n, t, layer) if t is not None and len(t) else None
               for s, n, t in zip(seqs, counts, token_ids or [None] * len(seqs))]
        if len(seqs) == 1:
            main_need, need, _ = self.room_needed(seqs[0], counts[0], layer)
            self.check_room(main_need, need, 0)
        starts = [self.token_start(s, layer) for s in seqs]
        needs = [max(0, math.ceil((start + n) / self.bs) - len(s.sealed) - len(s.tail))
                 for s, start, n in zip(seqs, starts, counts)]
        new = self._alloc_tail(sum(needs))      # one clearing launch for the whole batch
        for s, n in zip(seqs, counts):      # the sequences whose committed tokens change now
            if min(p + (n if i == layer else 0) for i, p in enumerate(s.pending)):
                self.changing(s)
        slots = []
        for s, start, n, need in zip(seqs, starts, counts, needs):
            s.tail += new[:need]
            del new[:need]
            slots.append((s, start, n))
        toks = None
        if k.shape[0] <= SMALL_WRITE:    # a decode step of a few sequences: no index tensors
            toks = []
            for s, start, n in slots:
                toks += self._tail_slot_pairs(s, start, n)
            if not defer_write:
                self.tail.write_tokens(layer, toks, k, v)
                toks = None
        else:
            idx = [self._tail_slots(s, torch.arange(start, start + n)) for s, start, n in slots]
            dev = self.tail.k.device
            self.tail.write(slice(layer, layer + 1), ids_to(dev, torch.cat([b for b, _ in idx])),
                            ids_to(dev, torch.cat([o for _, o in idx])), k.unsqueeze(0), v.unsqueeze(0))
        for s, start, t in zip(seqs, starts, ids):
            if not any(s.pending):          # the step begins
                s.step_ids_from = len(s.token_ids)
            if t is not None:
                self._apply_token_ids(s, start, t)
        now = time.monotonic()
        for s, n in zip(seqs, counts):
            s.cut_step = ()
            s.pending[layer] += n
            commit = min(s.pending)
            if commit:
                s.pending = [p - commit for p in s.pending]
                s.length += commit
                self.counters["appended_tokens"] += commit
                self._commit(s)
            if not any(s.pending):
                s.step_ids_from = None
            self.hold_seals(s)
            s.last_use = now
        return toks

    @staticmethod
    def check_step_continues(s: Sequence, layer: int) -> None:
        """Refuse a per-layer append that would continue, at a layer it had not reached, a
        step drop_uncommitted dropped: it would write one step's K/V beside another's."""
        if s.cut_step and layer not in s.cut_step:
            raise FailedPrecondition("layer", f"{layer} continues a step of sequence {quote(s.seq_id)} that was "
                                     f"dropped uncommitted (its session's lease lapsed, or an offload dropped it; "
                                     f"layers {list(s.cut_step)} had written it): run the step again from one "
                                     "of those layers")

    def _commit(self, s: Sequence) -> None:
        """Seal what the committed length allows, taking data from the tail; release
        what left the window."""
        self._register_hashes(s)
        count = max(self.sealed_count(s.length), len(s.sealed)) - len(s.sealed)
        if count > 0:
            self._seal_committed(s, count)
        self.release_window(s)

    def _seal_committed(self, s: Sequence, count: int) -> None:
        if self.is_pq:
            ns = self.sink_blocks
            assert len(s.tail) >= ns + count, f"{s.seq_id}: sealing past the tail"
            ids = s.tail[ns:ns + count]
            k, v = self.tail.read_blocks(slice(None), ids_to(self.tail.k.device, ids))
            self._seal(s, count, k, v)
            self.tail_pool.release(ids)
            del s.tail[ns:ns + count]
        else:
            self._seal(s, count, None, None)

    def drop_uncommitted(self, s: Sequence) -> int:
        """Drop what a step appended to some layers but not all, and a Reserve's
        slots: the committed tokens stay, and the tail blocks only the dropped
        ones used go back. -> tokens dropped (the most of any layer)."""
        n = max(s.pending) + s.reserved
        if n:
            s.cut_step, s.cut_reserve = tuple(i for i, p in enumerate(s.pending) if p), s.reserved > 0
            s.pending, s.reserved = [0] * len(s.pending), 0
            # The ids the step recorded, and the hash of a block they completed, go with it: the
            # step may come again with other tokens, which must not be found under these.
            if s.step_ids_from is not None:
                del s.token_ids[max(s.length, s.step_ids_from):]
                del s.hashes[len(s.token_ids) // self.bs:]
                s.step_ids_from = None
            keep = max(0, math.ceil(s.length / self.bs) - len(s.sealed))
            extra = s.tail[keep:]
            del s.tail[keep:]
            self.tail_pool.release(extra[::-1])
            self.hold_seals(s)
        return n

    @staticmethod
    def check_reservations_kept(seqs: list[Sequence]) -> None:
        """Refuse a Reserve once for each sequence whose reserved slots a lapse dropped:
        committing nothing, it would hand out the same positions for the next step, and
        the worker would hold a token the sequence lacks. The refusal is the notice: it
        clears the mark, and the step runs again with the next Reserve."""
        cut = [s for s in seqs if s.cut_reserve]
        for s in cut:
            s.cut_reserve = False
        if cut:
            raise FailedPrecondition("sequence_ids", f"sequences {[s.seq_id for s in cut][:8]}: the slots their last "
                                     "Reserve handed out were dropped, uncommitted (their session's lease lapsed, "
                                     "or an offload dropped them): write that step again (the next Reserve hands "
                                     "out its slots)")

    def reserve_touches_gpu(self, s: Sequence, n: int) -> bool:
        """Whether reserve(s, n) must be ordered after the client's writes (its
        stream's work waited for), or may run GPU work: sealing (PQ encodes read
        the tail), allocating blocks (an evicted block is copied out before the
        client may write it), paging in; or committing what the client wrote so
        that others may read it on other streams: a block it completes gets its
        hash (a prefix hit for any sequence: shared, encoded, put to Redis), and
        a Reserve of none leaves the sequence free to move, fork or offload.
        Most decode steps do none of these."""
        if s.reserved and (n == 0 or min((s.length + s.reserved) // self.bs, len(s.hashes)) > s.hashed_upto):
            return True
        return (s.tier != "gpu" or self.tail_blocks_for(s, n) > 0
                or (self.is_pq and (self.seals_at_reserve(s) > 0 or self.reserve_room(s, n)[0] > 0)))

    def reserve(self, s: Sequence, n: int, known: tuple[int, int] = (0, 0)) -> ReserveResult:
        """Commit the previous reservation (its slots were written by the
        client in every layer), then hand out slots for n more tokens.
        known = (sealed blocks the caller holds, their table epoch): when still a
        prefix of the table, only the blocks after it are returned."""
        self._require_ready()
        if any(s.pending):
            raise FailedPrecondition("sequence_id", f"sequence {quote(s.seq_id)} has uncommitted per-layer tokens")
        main, need = self.reserve_room(s, n)
        self.check_room(main, need, 0, "num_tokens")
        if s.reserved:
            self.changing(s)
        s.tail += self._alloc_tail(need)
        if s.reserved:
            s.length += s.reserved
            self.counters["appended_tokens"] += s.reserved
            s.reserved = 0
            self._commit(s)
        if n <= SMALL_SLOTS:        # a decode or verify step: a Reserve of a batch pays this per sequence
            slots = [b * self.bs + o for b, o in self._tail_slot_pairs(s, s.length, n)]
        else:
            blocks, offs = self._tail_slots(s, torch.arange(s.length, s.length + n))
            slots = (blocks * self.bs + offs).tolist()
        s.reserved = n
        self.hold_seals(s)
        s.last_use = time.monotonic()
        start = known[0] if known[1] == s.table_epoch and known[0] <= len(s.sealed) else 0
        return ReserveResult(slots, s.sealed[start:], list(s.tail), s.length + n, start, s.table_epoch)

