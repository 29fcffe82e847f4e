"""The room a call takes in a cache's pools: checked before anything changes (the
sequences it pages in from a lower tier counted with its write), and the main-pool
blocks that committing a step will seal taken as soon as the step's first layer (or a
Reserve's slots) is accepted, held by the sequence until its commit, so that no other
caller can take them between a step's layers and leave it half written."""
from __future__ import annotations

import math

from kvstore.core.sequence import Sequence
from kvstore.errors import ResourceExhausted, quote


class Room:
    """Mixed into Cache (through WritePath); uses its pools and tiering."""

    def resident(self, seqs: list[Sequence], field: str = "sequence_ids", room=None) -> None:
        """Protect the request's sequences from eviction and page in any that live in a
        lower tier (field: the request's name for them, in errors). room: () -> the
        (main, tail, freed) blocks the call's write then takes (room_needed), asked only
        when a sequence is below: the page-ins and the write are refused together, before
        anything moves, when moving every other sequence down could not make room."""
        self.protect = {id(s) for s in seqs}
        if all(s.tier == "gpu" for s in seqs):
            return
        self.check_fits(seqs, field)
        main, tail, freed = room() if room is not None else (0, 0, 0)
        tail = max(0, tail - freed)
        pm, pt, hits = self.page_in_room(seqs)
        if not self.fits_after_moves(main + pm, tail + pt, self.protect, hits):
            below = list({s.seq_id: 0 for s in seqs if s.tier != "gpu"})
            names = f"sequence {quote(below[0])}" if len(below) == 1 else f"sequences {below[:8]}"
            write = f" and write the call's tokens ({self._blocks(main, tail)})" if main or tail else ""
            raise ResourceExhausted(field, f"no GPU room to page in {names} ({self._blocks(pm, pt)}){write} in cache "
                                           f"{quote(self.cfg.name)}, however many other sequences move down a tier")
        for s in seqs:
            if s.tier != "gpu":
                self.tiering.page_in(s, self.protect, field)

    def check_fits(self, seqs: list[Sequence], field: str = "sequence_ids") -> None:
        """Refuse, before anything moves, sequences that cannot be on the GPU together
        however many others go down: their blocks (shared ones once) past the pools'."""
        main, tail = set(), 0
        for s in {id(s): s for s in seqs}.values():      # a batch may name one twice
            if s.tier == "gpu":
                main.update(s.held_sealed())
                tail += len(s.tail)
                continue
            for i, h in self._sealed_below(s):
                b = None if h is None else self.main_pool.lookup(h)      # the pool's copy, maybe a GPU sequence's
                main.add(("below", id(s), i) if h is None else h if b is None else b)
            tail += self.blocks_of(s)[1]
        if self.pools_fit(len(main), tail, self.main_pool.capacity, self.tail_pool.capacity):
            return
        hold = f"{self.main_pool.capacity}" + (f" and {self.tail_pool.capacity}" if self.is_pq else "")
        raise ResourceExhausted(field, f"the sequences need {self._blocks(len(main), tail)} on the GPU at once; "
                                       f"the pools of cache {quote(self.cfg.name)} hold {hold}: name fewer")

    def _sealed_below(self, s: Sequence) -> list[tuple[int, bytes | None]]:
        """(i, content hash or None) of each sealed block s holds below the GPU, holes left out."""
        known, h0 = min(s.hashed_upto, len(s.hashes)), self.sink_blocks + s.freed
        return [(i, s.hashes[h0 + i] if h0 + i < known else None) for i in range(s.held_sealed_count())]

    def _blocks(self, main: int, tail: int) -> str:
        return f"{main} sealed and {tail} fp16 blocks" if self.is_pq else f"{main + tail} blocks"

    def blocks_of(self, s: Sequence) -> tuple[int, int]:
        """(sealed blocks, holes included; fp16 tail blocks) s has on the GPU, or will
        have once paged in."""
        if s.tier == "gpu":
            return len(s.sealed), len(s.tail)
        return s.freed + s.held_sealed_count(), len(s.tail) if s.tier == "host" else s.manifest["n_tail"]

    def page_in_room(self, seqs: list[Sequence]) -> tuple[int, int, set]:
        """(main, tail, hits): blocks that paging in the sequences below the GPU takes from
        what the pools can allocate: a sealed block no GPU block holds under its hash (once,
        however many sequences share it), or whose GPU copy is cached unreferenced; every
        tail block. hits: the GPU blocks the page-ins will reference (moves free none of them).
        In page-in order: a block an earlier page-in of the call makes findable costs nothing."""
        main, tail, hits, found = set(), 0, set(), set()
        for s in {id(s): s for s in seqs if s.tier != "gpu"}.values():
            for i, h in self._sealed_below(s):
                b = None if h is None or h in found else self.main_pool.lookup(h)
                if h not in found and (b is None or self.main_pool.blocks[b].ref_cnt == 0):
                    main.add(("below", id(s), i) if h is None else h)
                if b is not None:
                    hits.add(b)
            n_sealed, n_tail = self.blocks_of(s)
            tail += n_tail
            if not self.is_pq:      # its full tail blocks come up hashed in the one pool (Tiering.page_in)
                known = min(s.hashed_upto, len(s.hashes))
                found.update(s.hashes[i] for i in (self.tail_block_index(j, n_sealed) for j in range(n_tail))
                             if i < known)
        return len(main), tail, hits

    def movable(self, protect: set) -> list[Sequence]:
        """The GPU sequences that may move down a tier to make room for a call."""
        return [s for s in self.seqs.values() if s.tier == "gpu" and id(s) not in protect
                and not any(s.pending) and not s.reserved and (s.sealed or s.tail)]

    def fits_after_moves(self, main: int, tail: int, protect: set, keep: set = frozenset()) -> bool:
        """Whether the pools could give main + tail blocks once every movable sequence
        (protect's left out) had gone down a tier; blocks others share, and the main-pool
        blocks in keep (a page-in's hits), stay."""
        movable = self.movable(protect) if self.tiering is not None else []
        sealed, tails = [b for s in movable for b in s.held_sealed()], [b for s in movable for b in s.tail]
        freed = ((self.main_pool.freed_by(sealed, keep), self.tail_pool.freed_by(tails)) if self.is_pq
                 else (self.main_pool.freed_by(sealed + tails, keep), 0))
        return self.pools_fit(main, tail, self.main_pool.num_allocatable() + freed[0],
                              self.tail_pool.num_allocatable() + freed[1])

    def seals_ahead(self, s: Sequence, end: int) -> int:
        """Blocks sealing takes once s is committed up to position `end`."""
        n_sealed = self.blocks_of(s)[0]
        return max(self.sealed_count(end), n_sealed) - n_sealed

    def check_count(self, s: Sequence, n: int) -> None:
        """InvalidArgument naming counts where s with n more tokens holds more than the cache can."""
        self.check_length(s.length + n - s.freed * self.bs, "counts")     # holes hold nothing

    def room_needed(self, s: Sequence, n: int, layer: int | None) -> tuple[int, int, int]:
        """(main blocks, tail blocks, tail blocks freed by sealing) that
        appending n tokens (all layers, or one layer) will take at most."""
        n_sealed, n_tail = self.blocks_of(s)     # as on the GPU, where the write finds s
        if layer is None:
            T = s.length + n
            self.check_count(s, n)
            sealed_after = max(self.sealed_count(T), n_sealed)
            seal = sealed_after - n_sealed
            if not self.is_pq:
                return 0, max(0, math.ceil(T / self.bs) - n_sealed - n_tail), 0
            sinks = min(n_tail, self.sink_blocks)
            rest = n_tail - sinks               # the tail blocks sealing can take
            if s.tier == "gpu":
                freed = sum(1 for b in s.tail[sinks:sinks + seal] if self.tail_pool.blocks[b].ref_cnt == 1)
            else:                               # paged in, every tail block is the sequence's own
                freed = min(seal, rest)
            return seal, max(0, math.ceil(T / self.bs) - sinks - max(sealed_after, n_sealed + rest)), freed
        end = s.length + s.pending[layer] + n
        tail = max(0, math.ceil(end / self.bs) - n_sealed - n_tail)
        # The seals of the whole step, less those an earlier layer of it already holds.
        seal = max(0, self.seals_ahead(s, end) - len(s.seal_blocks))
        return (seal if self.is_pq else 0), tail, 0

    def check_room(self, main: int, tail: int, freed: int, field: str = "k") -> None:
        """Raise ResourceExhausted unless the pools can give main + tail blocks,
        after moving least recently used sequences down a tier if need be."""
        refused = None
        if self.tiering is not None and not self.gpu_fits(main, tail - freed):
            refused = self.tiering.make_room(main, max(0, tail - freed), self.protect)
        short = None
        if self.is_pq and main > self.main_pool.num_allocatable():
            short = f"{main} blocks, {self.main_pool.num_allocatable()} free"
        elif self.is_pq and tail > self.tail_pool.num_allocatable() + freed:
            short = f"{tail} fp16 tail blocks, {self.tail_pool.num_allocatable() + freed} free"
        elif not self.is_pq and tail > self.main_pool.num_allocatable():
            short = f"{tail} blocks, {self.main_pool.num_allocatable()} free"
        if short is not None:
            raise ResourceExhausted(field, f"no room in cache {quote(self.cfg.name)} for what the call writes: "
                                           f"need {short}" + (f" (a sequence could not move down: {refused})"
                                                              if refused else ""))

    def pools_fit(self, main: int, tail: int, free_main: int, free_tail: int) -> bool:
        """Whether main sealed and tail fp16 blocks fit pools that can give free_main and
        free_tail (codec fp16: one pool, free_main, takes both)."""
        return main <= free_main and tail <= free_tail if self.is_pq else main + tail <= free_main

    def gpu_fits(self, main: int, tail: int) -> bool:
        """Whether the GPU pools can give main + tail blocks now."""
        return self.pools_fit(main, tail, self.main_pool.num_allocatable(), self.tail_pool.num_allocatable())

    def hold_seals(self, s: Sequence) -> None:
        """Make s hold exactly the main-pool blocks that committing its uncommitted
        tokens (per-layer or reserved) will seal: taken after their room was checked,
        given back once a commit (or a dedup hit, or a drop) no longer needs them."""
        if not self.is_pq:
            return
        want, have = self.seals_ahead(s, s.max_length()), s.seal_blocks
        if len(have) > want:
            self.main_pool.release(have[want:][::-1])
            del have[want:]
        elif len(have) < want:
            new = self.main_pool.allocate(want - len(have))
            assert new is not None, "main-pool room was checked before the write"
            have += new

    def seals_at_reserve(self, s: Sequence) -> int:
        """Blocks the next reserve() of s seals (its previous reservation is
        committed then)."""
        return self.seals_ahead(s, s.length + s.reserved)

    def reserve_room(self, s: Sequence, n: int) -> tuple[int, int]:
        """(main blocks, tail blocks) reserve(s, n) takes: the seals of committing the
        previous reservation and of the n new slots, less those s holds, and the tail
        blocks of the slots."""
        seal = max(0, self.seals_ahead(s, s.length + s.reserved + n) - len(s.seal_blocks))
        return (seal if self.is_pq else 0), self.tail_blocks_for(s, n)

    def tail_blocks_for(self, s: Sequence, n: int) -> int:
        """Tail blocks a reserve of n more tokens must allocate."""
        return max(0, math.ceil((s.length + s.reserved + n) / self.bs) - sum(self.blocks_of(s)))
