"""What an LMDB store's value checksums were made with, and bringing a store
an older kvstore wrote up to date when it is opened (lmdb_store.py).

A record in the checksum database (FORMAT_KEY) names the checksum of every
other record there: FORMAT, XXH3-64 (checksum.py). A store without it was
written before the record existed, by a kvstore that summed values with
XXH3-64 too, or earlier with the weighted numpy sum (checksum.weighted_sum),
or earlier still with no checksums at all. Such a store is not assumed
corrupt where its records are merely of another kind: each value is checked
against its record by either sum; one that passes the weighted sum gets an
XXH3-64 record; one that passes neither keeps its record and is refused when
read, as any corrupt value is. A store whose record names a format this
version does not know (a newer kvstore's) is not read at all: it is moved
aside, untouched (lmdb_recovery.move_aside).
"""
from __future__ import annotations

import struct

from .checksum import checksum, weighted_sum
from .staging import workers

FORMAT_KEY = b"\x00kvstore.checksum-format"   # in the checksum database: value keys never start with a NUL
FORMAT = b"xxh3-64"
SUM = struct.Struct("<QQ")                    # a value's length and checksum, as the checksum database holds them
SUM_CHUNK = 8 << 20                           # bytes of values checksummed per task on the copy threads


def value_bytes(value) -> int:
    """A value's length in bytes (a memoryview of any format, or bytes)."""
    return value.nbytes if isinstance(value, memoryview) else len(value)


def format_of(txn, sums) -> bytes | None:
    """The store's format record (None: written before it)."""
    r = txn.get(FORMAT_KEY, db=sums)
    return None if r is None else bytes(r)


def passes(value, record, legacy: bool = False) -> bool:
    """Whether value is what its record says was written (legacy: by the
    weighted sum too, for a store without a format record)."""
    if record is None or len(record) != SUM.size:
        return False
    n, s = SUM.unpack(record)
    if n != len(value):
        return False
    return checksum(value) == s or (legacy and weighted_sum(value) == s)


def updates(txn, sums, sums_name: bytes) -> tuple[list[tuple[bytes, bytes]], dict]:
    """For a store without a format record: the checksum records to write
    (FORMAT_KEY's last) and what was found, {"unsummed", "weighted", "failed"}:
    values with no record (summed as they are), records of the weighted sum
    (replaced, their values having passed it), records neither sum matches
    (left as they are: refused when read)."""
    out, seen = [], dict(unsummed=0, weighted=0, failed=0)
    for k, v in txn.cursor():
        k = bytes(k)
        if k == sums_name:
            continue
        r, n, x = txn.get(k, db=sums), value_bytes(v), checksum(v)
        if r is None:
            out.append((k, SUM.pack(n, x)))
            seen["unsummed"] += 1
        elif r != SUM.pack(n, x):
            if r == SUM.pack(n, weighted_sum(v)):
                out.append((k, SUM.pack(n, x)))
                seen["weighted"] += 1
            else:
                seen["failed"] += 1
    out.append((FORMAT_KEY, FORMAT))
    return out, seen


def start(puts: list[tuple[bytes, bytes]]):
    """Start the checksums of the values on the copy threads; returns a
    function that waits for them (in order)."""
    chunks, a, nbytes = [], 0, 0
    for i, (_, v) in enumerate(puts):
        nbytes += value_bytes(v)
        if nbytes >= SUM_CHUNK or i == len(puts) - 1:
            chunks.append((a, i + 1))
            a, nbytes = i + 1, 0
    if len(chunks) <= 1:
        return lambda: [checksum(v) for _, v in puts]
    futures = [workers().submit(lambda a, b: [checksum(v) for _, v in puts[a:b]], a, b) for a, b in chunks]
    return lambda: [s for f in futures for s in f.result()]
