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

import xxhash


def checksum(payload) -> int:
    """XXH3-64 of a bytes-like payload (a contiguous buffer), as an int."""
    return xxhash.xxh3_64_intdigest(payload)
