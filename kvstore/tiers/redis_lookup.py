"""One lookup of the Redis tier (RedisStore.read_into): its rows go in chunks, each
chunk's future done when every node's part of it is in and checked; each row is
checked by the connection's thread that received it; and the first row that was
not a hit stops the lookup there (nothing past it is asked or checked)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from . import resp

HIT, MISS, REFUSED, SKIPPED = "hit", "miss", "refused", "skipped"     # a row's verdict


def runs(idx: list[int], per: int):
    """(chunk, start, end) of each run of idx (ascending) within one chunk of per rows."""
    j = 0
    while j < len(idx):
        c = idx[j] // per
        k = j
        while k < len(idx) and idx[k] // per == c:
            k += 1
        yield idx[j], j, k
        j = k


class Lookup:
    """One lookup: its chunks' futures, each done when every node's part of it
    is in and checked; and `at`, the first row that was not a hit (lanes ask
    nothing past it, checks check nothing past it)."""

    def __init__(self, chunks: list[tuple[int, int, Future]], verify):
        self.chunks, self.verify = chunks, verify
        self.at = chunks[-1][1] if chunks else 0
        self.started = time.monotonic()      # Breaker.ok: a lane's success says nothing of after this
        self._lock = threading.Lock()
        self._out = [[SKIPPED] * (b - a) for a, b, _ in chunks]
        self._left = [b - a for a, b, _ in chunks]         # rows of each chunk not yet in

    def lower(self, i: int) -> None:
        with self._lock:
            self.at = min(self.at, i)

    def part(self, c: int, idx, verdicts: list | None) -> None:
        """Rows idx (of chunk c) are in: verdicts, or None where Redis failed for them."""
        a, _, fut = self.chunks[c]
        with self._lock:
            out = self._out[c]
            for j, i in enumerate(idx):
                out[i - a] = v = verdicts[j] if verdicts is not None else None
                if v not in (HIT, SKIPPED):
                    self.at = min(self.at, i)
            self._left[c] -= len(idx)
            if self._left[c] or fut.done():
                return
        fut.set_result(None if all(v is None for v in out) else out)

    def fail(self, c: int, e: BaseException) -> None:
        with self._lock:
            if self.chunks[c][2].done():
                return
            self._left[c] = -1             # parts still to come change nothing
        self.chunks[c][2].set_exception(e)

    def verdict(self, i: int, r: int) -> str:
        """Row i's verdict as received (r: resp.HIT, MISS, OTHER or REDIRECT) and
        checked (verify(i)). A row past one known not to be a hit is not checked
        (SKIPPED): the lookup stops before it."""
        if i > self.at:
            return SKIPPED
        if r == resp.HIT:
            return HIT if self.verify(i) else REFUSED
        return MISS if r in (resp.MISS, resp.REDIRECT) else REFUSED    # a key served elsewhere or not now: a miss
