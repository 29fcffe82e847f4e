"""Sliding-window memory (docs/design.md, Sliding windows), as vLLM's hybrid
allocator does it for a group of sliding layers: in a cache whose every layer
slides, a sequence's sealed blocks that lie wholly before the earliest position
any later query can read are released as they leave the window.

The earliest such position is window_start(length, W) of the committed length,
W the largest window of the cache's layers: every later query sits at or past
the committed length (per-layer pending and reserved tokens come after it, a
multi-token append queries only its last token), so it reads nothing before.

A released block keeps its content hash: it stays a cached prefix block,
findable by hash until its slot is needed (core/block_pool.py). The sequence's
table keeps its positions: its first `freed` sealed entries become holes that
hold the cache's null block, a block the cache keeps referenced for good and
never writes (the kernels may be pointed at it, never read it: a windowed plan
starts at its window). The table then changed before its end, so it takes a new
epoch (Sequence.rebuilt_table): a client holding a prefix of it fetches it again.
A read of a freed range (Retrieve) is refused, naming the feature.
"""
from __future__ import annotations

from kvstore.core.config import CacheConfig
from kvstore.core.sequence import Sequence
from kvstore.errors import FailedPrecondition, quote
from kvstore.kernels.plan import window_start

# Positions a sequence of a freeing cache may reach: its held tokens are bounded by the
# pool, its length only by what the kernels' int32 lengths can say.
MAX_POSITIONS = 2**31 - 1


def group_window(cfg: CacheConfig) -> int:
    """The window of a cache whose every layer slides (the largest of its layers'), or
    0: a cache with a global layer keeps every block (one block id addresses the same
    slot in every layer, so a block is free only when no layer reads it)."""
    w = cfg.layer_windows
    return max(w) if w and all(w) else 0


class WindowedBlocks:
    """Mixed into Cache: the releases, and the checks of the paths that read holes."""

    window = 0                  # group_window(cfg); 0: nothing is released
    null_block: int | None = None
    _released: list[int] | None = None     # blocks let go while encodes are deferred

    def init_window(self) -> None:
        self.window = group_window(self.cfg)
        if self.window:
            # Block ids of holes: referenced by the cache itself, so never handed out.
            self.null_block = self.main_pool.allocate(1)[0]
        self.counters["window_freed_blocks"] = 0

    def out_of_window(self, s: Sequence) -> int:
        """Leading sealed blocks of s that no later query can read: sealed block j holds
        positions [S + j * bs, S + (j + 1) * bs), S the sink tokens (kept in the tail)."""
        if not self.window:
            return 0
        return min(len(s.sealed), max(0, (window_start(s.length, self.window) - self.sinks) // self.bs))

    def release_window(self, s: Sequence) -> None:
        """Release s's sealed blocks that left the window (after the write that moved
        it registered their hashes, so they stay findable as cached prefix blocks)."""
        n = self.out_of_window(s)
        if s.tier != "gpu" or n <= s.freed:
            return
        ids = s.sealed[s.freed:n]
        s.sealed[s.freed:n] = [self.null_block] * len(ids)
        s.freed = n
        s.rebuilt_table()
        self.counters["window_freed_blocks"] += len(ids)
        if self._deferred is not None:
            # Their codes are not written yet (flush_encodes): a block let go now could be
            # handed out, or spilled below, before it holds what its hash says.
            self._released = (self._released or []) + ids
        else:
            self.main_pool.release(ids)      # oldest first: evicted first among them

    def release_deferred(self) -> None:
        """The releases held back while encodes were deferred (flush_encodes wrote them)."""
        ids, self._released = self._released, None
        if ids:
            self.main_pool.release(ids)

    def check_held(self, s: Sequence, start: int, end: int) -> None:
        """Reading committed tokens [start, end): refused (before anything changes) if the
        window released any of them."""
        first = self.sinks + s.freed * self.bs       # the first held position past the sinks
        if s.freed and start < first and end > self.sinks:
            raise FailedPrecondition("start", f"tokens [{self.sinks}, {first}) of sequence {quote(s.seq_id)} left "
                                     f"the sliding window of cache {quote(self.cfg.name)} (every layer slides, "
                                     f"window {self.window}) and were freed; readable: from {first}")
