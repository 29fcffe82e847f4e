"""The room a write takes in a cache's pools: checked before anything changes, and the
main-pool blocks that committing a step will seal taken as soon as the step's first
layer (or a Reserve's slots) is accepted, held by the sequence until its commit, so that
no other caller can take them between a step's layers and leave it half written."""
from __future__ import annotations

import math

from kvstore.core.sequence import Sequence
from kvstore.errors import ResourceExhausted


class Room:
    """Mixed into Cache (through WritePath); uses its pools and tiering."""

    def seals_ahead(self, s: Sequence, end: int) -> int:
        """Blocks sealing takes once s is committed up to position `end`."""
        return max(self.sealed_count(end), len(s.sealed)) - len(s.sealed)

    def room_needed(self, s: Sequence, n: int, layer: int | None) -> tuple[int, int, int]:
        """(main blocks, tail blocks, tail blocks freed by sealing) that
        appending n tokens (all layers, or one layer) will take at most."""
        if layer is None:
            T = s.length + n
            self.check_length(T - s.freed * self.bs, "counts")     # holes hold nothing
            n_sealed = max(self.sealed_count(T), len(s.sealed))
            seal = n_sealed - len(s.sealed)
            if not self.is_pq:
                return 0, max(0, math.ceil(T / self.bs) - len(s.sealed) - len(s.tail)), 0
            sinks = min(len(s.tail), self.sink_blocks)
            rest = len(s.tail) - sinks               # the tail blocks sealing can take
            freed = sum(1 for b in s.tail[sinks:sinks + seal] if self.tail_pool.blocks[b].ref_cnt == 1)
            return seal, max(0, math.ceil(T / self.bs) - sinks - max(n_sealed, len(s.sealed) + rest)), freed
        end = s.length + s.pending[layer] + n
        tail = max(0, math.ceil(end / self.bs) - len(s.sealed) - len(s.tail))
        # The seals of the whole step, less those an earlier layer of it already holds.
        seal = max(0, self.seals_ahead(s, end) - len(s.seal_blocks))
        return (seal if self.is_pq else 0), tail, 0

    def check_room(self, main: int, tail: int, freed: int, field: str = "k") -> None:
        """Raise ResourceExhausted unless the pools can give main + tail blocks,
        after moving least recently used sequences down a tier if need be."""
        if self.tiering is not None and not self._fits(main, tail, freed):
            self.tiering.make_room(main, max(0, tail - freed), self.protect)
        if self.is_pq:
            if main > self.main_pool.num_allocatable():
                raise ResourceExhausted(field, f"need {main} blocks, {self.main_pool.num_allocatable()} free")
            if tail > self.tail_pool.num_allocatable() + freed:
                raise ResourceExhausted(field, f"need {tail} fp16 tail blocks, "
                                        f"{self.tail_pool.num_allocatable() + freed} free")
        elif tail > self.main_pool.num_allocatable():
            raise ResourceExhausted(field, f"need {tail} blocks, {self.main_pool.num_allocatable()} free")

    def _fits(self, main: int, tail: int, freed: int) -> bool:
        if self.is_pq:
            return (main <= self.main_pool.num_allocatable()
                    and tail <= self.tail_pool.num_allocatable() + freed)
        return tail <= self.main_pool.num_allocatable()

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
        return max(0, math.ceil((s.length + s.reserved + n) / self.bs) - len(s.sealed) - len(s.tail))
