"""The checksum of a value's bytes, as both tiers that keep values off the
GPU store it: the disk tier beside each value, the Redis tier in each value's
header (redis_format.py). XXH3-64 (xxhash), one C call a value, which gives
the GIL up for the whole value once it is over 64 KiB.

Why not the weighted numpy sum that Redis values carried before: that is three
numpy steps a value (a uint32 view widened to uint64, a dot product with the
weights), each giving up the GIL and taking it back; while any other thread
runs Python, every retake waits up to the interpreter's switch interval.
Measured on 512 KiB rows (256 MiB, cache-cold, one thread): the weighted sum
5.8 GB/s alone and 0.3 GB/s beside one pure-Python thread; XXH3-64 28.6 GB/s
alone. A restore of 64 rows or more to a GPU checks them where they land,
with the same hash computed by a kernel (kernels.xxh3_64_rows: bit for bit
xxhash's; staging.gather_checked); other restores on the copy threads right
after copying each row, and a Redis lookup on the thread that received it,
while it is still in cache.
Errors it catches: any change is missed with probability about 2^-64.
"""
from __future__ import annotations

import numpy as np
import xxhash


def checksum(payload) -> int:
    """XXH3-64 of a bytes-like payload (a contiguous buffer), as an int."""
    return xxhash.xxh3_64_intdigest(payload)


def weighted_sum(payload) -> int:
    """The checksum LMDB stores written before XXH3-64 carry (lmdb_sums.py
    reads them): sum(w[i] * K[i]) mod 2^64 over the payload's little-endian
    32-bit words w (the last one zero-padded), K[i] the (i+1)-th output of
    splitmix64 seeded with 0 with its low bit set."""
    b = np.frombuffer(payload, dtype=np.uint8)
    n, rest = divmod(len(b), 4)
    with np.errstate(over="ignore"):
        z = np.arange(1, n + (rest > 0) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        z |= np.uint64(1)
        s = int(np.dot(b[:4 * n].view("<u4").astype(np.uint64), z[:n])) if n else 0
    if rest:
        s += int.from_bytes(b[4 * n:].tobytes(), "little") * int(z[n])
    return s & 0xFFFF_FFFF_FFFF_FFFF
